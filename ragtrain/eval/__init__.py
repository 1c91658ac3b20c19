"""Evaluation: retrieval metrics (nDCG@10, MRR@10, Recall@k) with BEIR / trec_eval conventions."""

from ragtrain.eval.metrics import (
    DEFAULT_KS,
    Qrels,
    Run,
    evaluate,
    per_query,
    run_from_scores,
)

__all__ = ["DEFAULT_KS", "Qrels", "Run", "evaluate", "per_query", "run_from_scores"]
