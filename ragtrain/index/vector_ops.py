"""Vector-file transforms that stream one file at a time, so the driver never holds a corpus's vectors.

Used where a run derives vectors from other vectors: vector_avg's consensus (the re-normalised mean of every
replica's files), the stale index mapped onto the trained space (`index.align_anchors`), and drift between two
encodes, measured on a seeded sample of rows. Each result is a `VectorSet` that the index shards build FAISS from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ragtrain.corpus.encode import VectorSet, write_vectors
from ragtrain.embed.align import embedding_drift
from ragtrain.embed.encoders import consensus_vectors

DRIFT_SAMPLE = 20_000  # rows compared when measuring drift: the mean's standard error is < 1 % of the mean here


def map_vectors(src: VectorSet, fn: Callable[[np.ndarray], np.ndarray], folder: str | Path) -> VectorSet:
    """`fn` applied to every file's fp32 vectors, written as a new vector folder with the same ids and files."""
    return write_vectors(folder, ((ids, fn(v.astype(np.float32))) for ids, v in src.iter_parts()), src.dtype)


def mean_vectors(sets: Sequence[VectorSet], folder: str | Path) -> VectorSet:
    """The replicas' consensus, file by file: the re-normalised mean vector of every id (vector_avg's index).

    The replicas were encoded from one source in order, so their files normally hold the same ids; where they do
    not, the other replicas' rows are looked up by id (slower, same result)."""
    first, others = sets[0], list(sets[1:])
    for s in others:
        if s.rows != first.rows or s.dim != first.dim:
            raise ValueError(
                f"mean_vectors: {s.folder} holds {s.rows} x {s.dim}, {first.folder} {first.rows} x "
                f"{first.dim}: replicas of one corpus must match"
            )

    def chunks():
        iters = [o.iter_parts() for o in others] if all(len(o.files) == len(first.files) for o in others) else None
        for ids, vecs in first.iter_parts():
            per_replica = [vecs.astype(np.float32)]
            for j, o in enumerate(others):
                theirs = next(iters[j]) if iters is not None else None
                same = theirs is not None and theirs[0] == ids
                per_replica.append(theirs[1].astype(np.float32) if same and theirs is not None else o.vectors_of(ids))
            yield ids, consensus_vectors(per_replica)

    return write_vectors(folder, chunks(), first.dtype)


def sample_ids(ids: Sequence[str], n: int, seed: int) -> list[str]:
    """`n` ids drawn without replacement by a seeded permutation (all of them when n >= len(ids))."""
    rows = np.random.default_rng(seed).permutation(len(ids))[:n]
    return [ids[i] for i in rows]


def drift(a: VectorSet, b: VectorSet, ids: Sequence[str]) -> float:
    """Mean 1 - cos between the two encodes' vectors of `ids` (read by id: only those rows are in memory)."""
    return embedding_drift(a.vectors_of(ids), b.vectors_of(ids))
