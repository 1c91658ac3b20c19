"""Deterministic, worker-count-invariant batches of (query, positive, hard negatives) training examples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class TrainExample:
    query: str
    positive: int  # corpus position of the gold passage
    gold: list[int]  # all gold passages of the query (masked as negatives)
    negatives: list[int] = field(default_factory=list)  # hard-negative candidates (corpus positions)
    qidx: int = -1  # position of the query in sorted training query ids (row of a live index's negatives table)


@dataclass
class TrainData:
    """What every trainer worker receives through the object store."""

    passages: Sequence[str]  # full passage texts in corpus order (a list, or the run's passage store)
    examples: list[TrainExample]
    # retriever.teacher: the cross-encoder's score of each query's candidates, {qidx: {corpus position: score}}
    teacher: dict[int, dict[int, float]] | None = None


def build_examples(
    queries: dict[str, str],
    qrels: dict[str, dict[str, int]],
    doc_pos: dict[str, int],
    negatives: dict[str, list[int]] | None = None,
) -> list[TrainExample]:
    """One example per (query, relevant passage) pair, in sorted query order (stable across runs)."""
    out = []
    for qidx, qid in enumerate(sorted(qrels)):
        gold = [doc_pos[d] for d, g in sorted(qrels[qid].items()) if g > 0]
        for pos in gold:
            out.append(TrainExample(queries[qid], pos, gold, list((negatives or {}).get(qid, [])), qidx))
    return out


def steps_per_epoch(num_examples: int, global_batch: int) -> int:
    """Full global batches per epoch (the last partial batch is dropped so every step has the same size)."""
    if num_examples < global_batch:
        raise ValueError(
            f"{num_examples} training examples < one global batch of {global_batch} "
            "(retriever.train.batch_size x resources.trainer.num_workers): lower the batch size"
        )
    return num_examples // global_batch


def global_batch_indices(num_examples: int, global_batch: int, step: int, seed: int) -> np.ndarray:
    """Example indices of the global batch at `step`: a seeded permutation per epoch, sliced in order."""
    spe = steps_per_epoch(num_examples, global_batch)
    epoch, pos = divmod(step, spe)
    perm = np.random.default_rng([seed, epoch]).permutation(num_examples)
    return perm[pos * global_batch : (pos + 1) * global_batch]


def local_indices(num_examples: int, global_batch: int, step: int, seed: int, rank: int, world_size: int) -> np.ndarray:
    """Example indices of this rank's slice of the global batch at `step`."""
    b = global_batch // world_size
    return global_batch_indices(num_examples, global_batch, step, seed)[rank * b : (rank + 1) * b]


def query_candidates(pids: Sequence[int], num_queries: int, num_negatives: int) -> list[list[int]]:
    """Each query's candidate list in a `local_batch` passage layout (B positives, then H negatives per query):
    [its positive, its H negatives]."""
    b, h = num_queries, num_negatives
    return [[pids[j], *pids[b + h * j : b + h * (j + 1)]] for j in range(b)]


def local_batch(
    data: TrainData,
    global_batch: int,
    step: int,
    seed: int,
    rank: int,
    world_size: int,
    num_negatives: int,
    live_negatives: list[list[int]] | None = None,
    sampling: str = "random",
) -> tuple[list[str], list[int], list[list[int]]]:
    """This rank's slice of the global batch: query texts, passage positions (positives then negatives), golds.

    Negatives are sampled per example with an RNG keyed by (seed, step, example index), so the same global batch
    gets the same negatives whatever the number of workers; `sampling="top"` takes the first (best-ranked)
    candidates instead. The candidates come from `live_negatives` (a live index's candidates per query) or the
    example's mined ones, gold already removed; a query with too few (many gold passages in the top ranks, or
    the false-negative filters of ragtrain/index/mining.py dropped them) is topped up with random non-gold
    passages, so every rank still sends the same number of passages.
    """
    mine = local_indices(len(data.examples), global_batch, step, seed, rank, world_size)
    exs = [data.examples[i] for i in mine]
    negs: list[int] = []
    for i, ex in zip(mine, exs):
        if num_negatives == 0:
            continue
        rng = np.random.default_rng([seed, step, int(i)])
        pool = list(live_negatives[ex.qidx] if live_negatives is not None else ex.negatives or [])
        if len(pool) < num_negatives and len(data.passages) - len(set(ex.gold)) < num_negatives:
            raise ValueError(f"example {i} has {len(pool)} hard-negative candidates, needs {num_negatives}")
        while len(pool) < num_negatives:
            r = int(rng.integers(len(data.passages)))
            if r not in ex.gold and r not in pool:
                pool.append(r)
        if sampling == "top":
            negs.extend(int(d) for d in pool[:num_negatives])
        else:
            negs.extend(int(pool[j]) for j in rng.choice(len(pool), num_negatives, replace=False))
    return [e.query for e in exs], [e.positive for e in exs] + negs, [e.gold for e in exs]
