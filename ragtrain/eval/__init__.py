"""Evaluation: retrieval metrics (nDCG@10, MRR@10, Recall@k) with BEIR / trec_eval conventions (metrics.py), answer
recall@k (answers.py) and the generator's exact match / F1 (qa_metrics.py)."""

from ragtrain.eval.metrics import (
    DEFAULT_KS,
    Qrels,
    Run,
    evaluate,
    per_query,
    run_from_scores,
)

__all__ = ["DEFAULT_KS", "Qrels", "Run", "evaluate", "per_query", "run_from_scores"]
