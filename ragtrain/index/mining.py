"""Hard-negative candidates from a ranking: the one rule that static mining and the live index both use.

False-negative control (`retriever.train.*`), each an independent filter on the ranking with gold removed:
- `hard_negative_skip_top`: drop the top k non-gold ranks.
- `hard_negative_margin` m (NV-Retriever's TopK-PercPos): drop candidates scoring above (1 - m) x the positive's
  score. The positive's score is the query's best gold score, q . v_gold, computed exactly from the query vector
  and the stored gold passage vectors (not from the search scores: the gold passage need not be in the top
  `hard_negative_depth`, and approximate indexes (IVF/PQ/HNSW) return approximate scores). With several gold
  passages (a document's chunks, several judged passages) the best one is "the positive", as MaxP evaluation
  scores a document by its best chunk.
- `hard_negative_max_score`: drop candidates scoring above this absolute (inner-product / cosine) ceiling.
Scores of the candidates are the index's search scores. The filters only remove; what remains keeps rank order,
and `local_batch` samples `hard_negatives` of them (`hard_negative_sampling`: random, or the top ones), topping
up with random non-gold passages when a query has too few left.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

if TYPE_CHECKING:
    from ragtrain.config.retriever import RetrieverTrainConfig

T = TypeVar("T")


@dataclass(frozen=True)
class MiningSpec:
    """The mining rule's settings (`retriever.train.hard_negative_*`), built once on the driver."""

    depth: int  # the index's top `depth` rows are the candidates
    skip_top: int = 0
    margin: float | None = None
    max_score: float | None = None

    @classmethod
    def of(cls, train: RetrieverTrainConfig) -> MiningSpec:
        return cls(
            train.hard_negative_depth,
            train.hard_negative_skip_top,
            train.hard_negative_margin,
            train.hard_negative_max_score,
        )


def hard_negative_candidates(
    ranked: Sequence[T],
    gold: Container[T],
    skip_top: int,
    scores: Sequence[float] | None = None,
    positive_score: float | None = None,
    margin: float | None = None,
    max_score: float | None = None,
) -> list[T]:
    """The ranking minus gold, minus the top `skip_top` of what remains, minus the candidates scoring above the
    margin threshold `(1 - margin) * positive_score` or above `max_score` (scores[i] belongs to ranked[i]).

    Gold is removed before counting the skipped ranks: the top non-gold passages are the likeliest false
    negatives (unjudged relevant passages), and that is what `hard_negative_skip_top` guards against. Counting a
    gold passage among them would keep, e.g. with gold at rank 1 and skip_top=1, the passage at rank 2.
    """
    ceiling = float("inf")
    if margin is not None:
        if positive_score is None:
            raise ValueError("hard_negative_margin needs the positive's score")
        ceiling = min(ceiling, (1.0 - margin) * float(positive_score))
    if max_score is not None:
        ceiling = min(ceiling, float(max_score))
    if ceiling < float("inf") and (scores is None or len(scores) != len(ranked)):
        raise ValueError("a score filter (margin / max_score) needs one score per ranked candidate")
    keep = [i for i, d in enumerate(ranked) if d not in gold][skip_top:]
    if ceiling < float("inf"):
        keep = [i for i in keep if float(scores[i]) <= ceiling]  # type: ignore[index]
    return [ranked[i] for i in keep]


def positive_scores(qvecs: np.ndarray, gold: Sequence[Sequence[int]], passage_vectors: np.ndarray) -> np.ndarray:
    """Each query's best score over its gold rows (q . v); -inf for a query without gold."""
    out = np.full(len(gold), -np.inf, dtype=np.float64)
    for i, g in enumerate(gold):
        if len(g):
            out[i] = float((passage_vectors[np.asarray(list(g))] @ qvecs[i]).max())
    return out


def mine_rows(
    index,
    qvecs: np.ndarray,
    gold: Sequence[Sequence[int]],
    spec: MiningSpec,
    passage_vectors: np.ndarray | None = None,
    positive: np.ndarray | None = None,
) -> list[list[int]]:
    """Hard-negative candidates (index rows) per query: the index's top `spec.depth` rows through
    `hard_negative_candidates`. `spec.margin` needs each query's positive score: `positive` (one per query, e.g.
    from `positive_scores` over the gold rows' vectors only), or `passage_vectors` (rows aligned with the index)."""
    scores, rows = index.search(qvecs, spec.depth)
    pos = positive
    if spec.margin is not None and pos is None:
        if passage_vectors is None:
            raise ValueError("hard_negative_margin needs the passage vectors to score each query's positive")
        pos = positive_scores(np.asarray(qvecs, dtype=np.float32), gold, passage_vectors)
    out = []
    for i in range(len(gold)):
        ok = rows[i] >= 0
        out.append(
            hard_negative_candidates(
                [int(r) for r in rows[i][ok]],
                set(gold[i]),
                spec.skip_top,
                scores[i][ok].tolist(),
                None if pos is None else float(pos[i]),
                spec.margin,
                spec.max_score,
            )
        )
    return out
