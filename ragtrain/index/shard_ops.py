"""Vector-shard transforms that stream one shard file at a time, so the driver never holds a corpus's vectors.

Used where a run derives vectors from other vectors: vector_avg's consensus (the re-normalised mean of every
replica's shards), the stale index mapped onto the trained space (`index.align_anchors`), and drift between two
encodes, measured on a seeded sample of rows. Each result is a `ShardSet` that the index host builds FAISS from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ragtrain.corpus.encode import ShardSet, write_shards
from ragtrain.embed.align import embedding_drift
from ragtrain.embed.encoders import consensus_vectors

DRIFT_SAMPLE = 20_000  # rows compared when measuring drift: the mean's standard error is < 1 % of the mean here


def map_shards(src: ShardSet, fn: Callable[[np.ndarray], np.ndarray], folder: str | Path) -> ShardSet:
    """`fn` applied to every shard's fp32 vectors, written as a new shard folder with the same ids and files."""
    return write_shards(folder, ((ids, fn(v.astype(np.float32))) for ids, v in src.iter_shards()), src.dtype)


def mean_shards(sets: Sequence[ShardSet], folder: str | Path) -> ShardSet:
    """The replicas' consensus, shard by shard: the re-normalised mean vector of every id (vector_avg's index).

    The replicas were encoded from one source in order, so their files normally hold the same ids; where they do
    not, the other replicas' rows are looked up by id (slower, same result)."""
    first, others = sets[0], list(sets[1:])
    for s in others:
        if s.rows != first.rows or s.dim != first.dim:
            raise ValueError(
                f"mean_shards: {s.folder} holds {s.rows} x {s.dim}, {first.folder} {first.rows} x "
                f"{first.dim}: replicas of one corpus must match"
            )

    def chunks():
        iters = [o.iter_shards() for o in others] if all(len(o.files) == len(first.files) for o in others) else None
        for ids, vecs in first.iter_shards():
            per_replica = [vecs.astype(np.float32)]
            for j, o in enumerate(others):
                theirs = next(iters[j]) if iters is not None else None
                same = theirs is not None and theirs[0] == ids
                per_replica.append(theirs[1].astype(np.float32) if same else o.vectors_of(ids))
            yield ids, consensus_vectors(per_replica)

    return write_shards(folder, chunks(), first.dtype)


def sample_ids(ids: Sequence[str], n: int, seed: int) -> list[str]:
    """`n` ids drawn without replacement by a seeded permutation (all of them when n >= len(ids))."""
    rows = np.random.default_rng(seed).permutation(len(ids))[:n]
    return [ids[i] for i in rows]


def drift(a: ShardSet, b: ShardSet, ids: Sequence[str]) -> float:
    """Mean 1 - cos between the two encodes' vectors of `ids` (read by id: only those rows are in memory)."""
    return embedding_drift(a.vectors_of(ids), b.vectors_of(ids))
