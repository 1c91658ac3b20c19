"""Retrieval metrics: nDCG@10, MRR@10 and Recall@k, following BEIR / pytrec_eval / trec_eval.

Inputs
------
* ``Run``   -- ``query id -> [doc id, ...]``, ranked best first. Ties must already be broken by
  the retriever: the list order *is* the ranking, no scores are consulted.
* ``Qrels`` -- ``query id -> {doc id: grade}``. A grade ``<= 0`` means "judged, not relevant";
  only grades ``> 0`` count as relevant.

Conventions
-----------
* **Evaluated queries** are the queries in the qrels that have at least one relevant doc
  (grade > 0). Qrels queries whose judgments are all ``<= 0`` are skipped (they have no
  defined recall or ideal DCG), and queries in the run but not in the qrels are ignored.
* A query in the qrels but **missing from the run** (or with an empty ranked list) scores 0 on
  every metric and still counts in the mean -- a retriever cannot raise its score by dropping
  hard queries.
* **Duplicate doc ids** within one ranked list: only the first (best-ranked) occurrence counts;
  later occurrences are dropped *before* the cut-offs are applied, so the following docs move
  up. This is exactly what a dict-based run (pytrec_eval, ranx) sees when each doc keeps its
  best-ranked occurrence.
* Ranks ``i`` are 1-based positions in the de-duplicated list. ``rel(d)`` is the set of
  relevant docs of a query, ``g(d)`` the grade of doc ``d`` (0 if unjudged or ``<= 0``).
* Every reported value is the arithmetic mean of the per-query value over the evaluated queries.

Metrics
-------
* ``recall@k`` = ``|rel ∩ top-k| / |rel|``.
* ``mrr@10``   = ``1 / i`` for the smallest rank ``i <= 10`` holding a relevant doc, else 0.
* ``ndcg@10``  = ``DCG@10 / IDCG@10`` with **linear** graded gain (trec_eval ``ndcg_cut``, BEIR,
  ranx ``ndcg``; *not* the ``2^g - 1`` "Burges" gain):
  ``DCG@10 = sum_{i=1..10} g(d_i) / log2(i + 1)``, and ``IDCG@10`` is the same sum over the
  ideal ordering of *all* judged relevant docs of the query (grades sorted descending), cut at
  10 -- relevant docs the retriever never returned still raise the ideal.

An empty qrels (no evaluable query) raises ``ValueError``.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

Run = dict[str, list[str]]
Qrels = dict[str, dict[str, int]]

DEFAULT_KS: tuple[int, ...] = (1, 5, 10, 100)

# Fixed cut-off of the rank-sensitive metrics (the BEIR headline numbers).
_CUTOFF = 10
# 1 / log2(i + 1) for ranks i = 1..10, precomputed because it is in the innermost loop.
_DISCOUNT = tuple(1.0 / math.log2(i + 1) for i in range(1, _CUTOFF + 1))


def _check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    """Validate the recall cut-offs and drop repeats, keeping their order."""
    out: list[int] = []
    for k in ks:
        # bool is an int subclass; recall@True would be a silent bug.
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"recall cut-offs must be positive integers, got {k!r}")
        if int(k) not in out:
            out.append(int(k))
    if not out:
        raise ValueError("ks must contain at least one cut-off")
    return tuple(out)


def _metric_names(ks: tuple[int, ...]) -> list[str]:
    """Output metric names, in reporting order."""
    return [f"ndcg@{_CUTOFF}", f"mrr@{_CUTOFF}", *(f"recall@{k}" for k in ks)]


def _relevant(judgments: dict[str, int]) -> dict[str, int]:
    """Keep only the relevant (grade > 0) judgments of one query."""
    return {d: g for d, g in judgments.items() if g > 0}


def _score_query(ranked: Sequence[str], rel: dict[str, int], ks: tuple[int, ...], depth: int) -> dict[str, float]:
    """Metrics for one query whose relevant docs (grade > 0) are ``rel`` (non-empty)."""
    # Walk the ranking once, de-duplicating, and record the 1-based rank and grade of each hit;
    # everything below is computed from these few hits, not from the whole list.
    seen: set[str] = set()
    hit_ranks: list[int] = []
    hit_grades: list[int] = []
    rank = 0
    for doc in ranked:
        if doc in seen:
            continue
        seen.add(doc)
        rank += 1
        grade = rel.get(doc)
        if grade is not None:
            hit_ranks.append(rank)
            hit_grades.append(grade)
        if rank >= depth:
            break

    dcg = 0.0
    for r, g in zip(hit_ranks, hit_grades):
        if r > _CUTOFF:
            break  # hit_ranks is increasing
        dcg += g * _DISCOUNT[r - 1]
    ideal = sorted(rel.values(), reverse=True)[:_CUTOFF]
    idcg = sum(g * _DISCOUNT[i] for i, g in enumerate(ideal))  # > 0 since rel is non-empty

    first = hit_ranks[0] if hit_ranks else None
    out = {
        f"ndcg@{_CUTOFF}": dcg / idcg,
        f"mrr@{_CUTOFF}": 1.0 / first if first is not None and first <= _CUTOFF else 0.0,
    }
    n_rel = len(rel)
    for k in ks:
        out[f"recall@{k}"] = bisect_right(hit_ranks, k) / n_rel
    return out


def per_query(run: Run, qrels: Qrels, ks: Sequence[int] = DEFAULT_KS) -> dict[str, dict[str, float]]:
    """Per-query metrics (qid -> metric -> value) over the evaluated queries; see module doc."""
    ks_ = _check_ks(ks)
    # Deepest rank any metric looks at; the rest of a long ranked list is never read.
    depth = max(max(ks_), _CUTOFF)

    out: dict[str, dict[str, float]] = {}
    for qid, judgments in qrels.items():
        rel = _relevant(judgments)
        if not rel:
            continue  # no relevant doc: recall and nDCG undefined, so not evaluated
        # Absent from the run = an empty ranking, which scores 0 everywhere.
        out[qid] = _score_query(run.get(qid, ()), rel, ks_, depth)
    if not out:
        raise ValueError("no evaluable query: qrels is empty or no query has a relevant doc (grade > 0)")
    return out


def evaluate(run: Run, qrels: Qrels, ks: Sequence[int] = DEFAULT_KS) -> dict[str, float]:
    """Mean nDCG@10, MRR@10 and Recall@k over the evaluated queries; see module doc."""
    scores = per_query(run, qrels, ks)
    names = _metric_names(_check_ks(ks))
    n = len(scores)
    # fsum: the mean should not depend on query order beyond the last ulp.
    return {m: math.fsum(q[m] for q in scores.values()) / n for m in names}


def run_from_scores(ids: Sequence[str], doc_ids: Sequence[str], indices: np.ndarray) -> Run:
    """Turn FAISS search output (positions into ``doc_ids``, -1 = missing) into a ``Run``."""
    idx = np.asarray(indices)
    if idx.ndim != 2:
        raise ValueError(f"indices must be 2-D [n_queries, k], got shape {idx.shape}")
    if idx.shape[0] != len(ids):
        raise ValueError(f"{len(ids)} query ids but indices has {idx.shape[0]} rows")
    if len(set(ids)) != len(ids):
        raise ValueError("query ids must be unique (a repeated id would silently drop a row)")
    if not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"indices must be integers, got dtype {idx.dtype}")
    # Only -1 is FAISS's "no result" marker; any other negative would silently wrap around
    # under Python indexing and name the wrong doc.
    if idx.size and (idx.min() < -1 or idx.max() >= len(doc_ids)):
        raise ValueError(f"indices must lie in [-1, {len(doc_ids) - 1}], got range [{idx.min()}, {idx.max()}]")
    # tolist() once: indexing a numpy array element by element is far slower than a list.
    return {qid: [doc_ids[j] for j in row if j != -1] for qid, row in zip(ids, idx.tolist())}


def maxp_run(run: Run, doc_of: dict[str, str], depth: int | None = None) -> Run:
    """Passage rankings -> document rankings (MaxP): a document's score is its best chunk's, so it takes the rank
    of its first chunk in the list; later chunks of it are dropped before any cut-off. Ids absent from
    ``doc_of`` are documents already. ``depth`` keeps the first ``depth`` documents."""
    out: Run = {}
    for qid, ranked in run.items():
        docs: dict[str, None] = {}  # insertion-ordered set
        for pid in ranked:
            docs.setdefault(doc_of.get(pid, pid), None)
            if depth is not None and len(docs) >= depth:
                break
        out[qid] = list(docs)
    return out
