"""The teacher step of a run (retriever.teacher.weight > 0): train or load it, score the candidates, evaluate it.

Runs after the zero-shot index has mined the hard negatives and before the bi-encoder trains:
1. the cross-encoder is trained on the training split (`reranker/train.py`) or taken from `retriever.teacher.path`
   (checked against this retriever's tokenizer before any work: `check_teacher` in the pipeline's preflight);
2. it scores every training query's positives and mined negatives once, and the zero-shot index's top
   `rerank_depth` of every evaluated query, in one Ray Data pass (one actor start-up), cached in the run folder;
3. its reranking of that top list is evaluated: the reranker's own nDCG@10 (a number users want: what the
   teacher knows that the bi-encoder does not yet).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ragtrain.config import Config
from ragtrain.eval.metrics import evaluate, maxp_run
from ragtrain.reranker.score import teacher_targets
from ragtrain.retriever.batching import TrainData, TrainExample
from ragtrain.runtime.console import get_logger

log = get_logger(__name__)


def prepare_teacher(
    cfg: Config, retrieval, built, examples: list[TrainExample], sink
) -> tuple[dict[int, dict[int, float]], dict[str, float]]:
    """Train/load the teacher, score each training query's candidates and the evaluated split's top
    `rerank_depth` of `built` in one Ray Data pass, and evaluate the teacher's reranking.

    Returns ({qidx: {corpus position: score}}, metrics of the teacher's reranking incl. its training summary)."""
    # lazy: ragtrain.reranker.train imports torch; this module imports without it
    from ragtrain.reranker.train import TEACHER_DIR, fit_teacher

    tc, out, data = cfg.retriever.teacher, Path(cfg.output_dir), retrieval.data
    if not examples:
        raise ValueError("retriever.teacher: the training split has no (query, relevant passage) pairs to teach on")
    passages = retrieval.passages()
    summary: dict[str, float] = {}
    if tc.path:
        folder = Path(tc.path)
        log.info(f"[teacher] using the cross-encoder in {folder}")
    else:
        folder, summary = fit_teacher(cfg, TrainData(passages, examples), sink)
    # query positions 0..n-1: the training queries (TrainExample.qidx), with their positives and mined negatives
    candidates: dict[int, set[int]] = {}
    for e in examples:
        candidates.setdefault(e.qidx, set()).update([*e.gold, *e.negatives])
    queries = {e.qidx: e.query for e in examples}
    n = max(queries) + 1
    texts = [queries.get(i, "") for i in range(n)]
    lists = [sorted(candidates.get(i, ())) for i in range(n)]
    # then the evaluated split's queries with the zero-shot index's top rerank_depth: what the teacher knows
    eval_qids = sorted(data.eval_qrels)
    run = retrieval.search(built, eval_qids, min(tc.rerank_depth, len(retrieval.doc_ids)))
    pos = retrieval.positions
    texts += [data.queries[q] for q in eval_qids]
    lists += [[pos[d] for d in run[q]] for q in eval_qids]
    table = teacher_targets(
        cfg.retriever,
        folder,
        texts,
        passages,
        lists,
        tc.max_length,
        cfg.resources.pool,
        out / TEACHER_DIR,
        retrieval.fingerprint,
    )
    reranked = rerank_run(run, eval_qids, [table[n + j][pos[d]] for j, q in enumerate(eval_qids) for d in run[q]])
    if data.doc_of:  # documents: MaxP over the reranked chunks, as the bi-encoder's evaluation
        reranked = maxp_run(reranked, data.doc_of, depth=cfg.index.top_k)
    metrics = evaluate(reranked, data.eval_qrels)
    log.info(f"[teacher] reranking the zero-shot top {tc.rerank_depth}: {data.split} nDCG@10 {metrics['ndcg@10']:.4f}")
    train_table = {q: table[q] for q in range(n) if q in table}
    return train_table, {**metrics, **{f"teacher_{k.split('/')[-1]}": v for k, v in summary.items()}}


def rerank_run(run: dict[str, list[str]], qids: list[str], scores) -> dict[str, list[str]]:
    """Each query's list reordered by `scores` (the lists of `qids` concatenated, in order), best first; ties
    keep the first-stage order."""
    out, k = {}, 0
    for q in qids:
        ids = run[q]
        s = np.asarray(scores[k : k + len(ids)])
        k += len(ids)
        out[q] = [ids[i] for i in np.argsort(-s, kind="stable")]
    if k != len(scores):
        raise ValueError(f"{len(scores)} scores for {k} ranked passages")
    return out
