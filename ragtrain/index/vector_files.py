"""FAISS from vector files: check the factory first, train IVF/PQ on a seeded sample, add file by file.

The index holds the rows in file order (the ids come from the files), so the caller never needs the whole vector
matrix: only one vector file is in memory at a time next to the index itself. A Flat index built this way equals
one built from all vectors at once (same ids, same scores; tested), and so does a trained index whose training
sample covers the corpus (`train_size >= rows`). Saving goes through a temporary folder renamed on success.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import faiss
import numpy as np

from ragtrain.corpus.encode import VectorSet
from ragtrain.index.faiss_index import METRIC, DenseIndex, IndexMeta, build_from_chunks
from ragtrain.index.faiss_index import trained_empty as faiss_trained_empty

if TYPE_CHECKING:
    from ragtrain.corpus.encode import VectorSet
    from ragtrain.index.base import Index


def _sample(shards: VectorSet, size: int, seed: int) -> np.ndarray:
    """fp32 rows at seeded random positions, in corpus (file) order; read file by file."""
    pick = np.sort(np.random.default_rng(seed).choice(shards.rows, size=size, replace=False))
    out = np.empty((size, shards.dim), dtype=np.float32)
    start = got = 0
    for _, vecs in shards.iter_parts(columns=("id", "vector")):
        end = start + len(vecs)
        lo, hi = np.searchsorted(pick, [start, end])
        out[got : got + hi - lo] = vecs[pick[lo:hi] - start]
        got += hi - lo
        start = end
    return out


def iter_rows(shards: VectorSet, start: int = 0, stop: int | None = None):
    """(ids, vectors) of rows [start, stop) in file order, one file at a time; files wholly outside the range are
    skipped by their parquet row counts (not read), so a slice of a large set costs only its own files."""
    import pyarrow.parquet as pq  # lazy: pyarrow loads a native library; this module imports without it

    stop = shards.rows if stop is None else stop
    at = 0
    for f in shards.files:
        n = pq.read_metadata(Path(shards.folder, f)).num_rows
        if at + n > start and at < stop:
            for ids, vecs in replace(shards, files=[f]).iter_parts():
                lo, hi = max(0, start - at), min(n, stop - at)
                yield ids[lo:hi], vecs[lo:hi]
        at += n
        if at >= stop:
            break


def trained_empty(
    shards: VectorSet, factory: str, seed: int = 0, train_size: int | None = None
) -> tuple[faiss.Index, int]:
    """`faiss_index.trained_empty` on a seeded sample of the files' rows (read file by file)."""
    return faiss_trained_empty(
        factory, shards.dim, shards.rows, lambda size, seed: _sample(shards, size, seed), seed, train_size
    )


def build_from_vectors(
    shards: VectorSet | str | Path,
    factory: str,
    corpus_fingerprint: str,
    encoder: str,
    encoder_step: int = 0,
    precision: str = "fp32",
    seed: int = 0,
    train_size: int | None = None,
    *,
    rows: tuple[int, int] | None = None,
    trained: faiss.Index | None = None,
) -> DenseIndex:
    """An inner-product index of every shard row; ids in file order.

    Trained types (IVF, PQ) train on a seeded sample of `train_size` rows (default: what their quantisers use,
    256 per centroid, capped at the corpus), then every file is added in turn. `rows` = (start, stop): only that
    row range is added; `trained`: an empty trained index to copy instead of training one (`trained_empty`).
    """
    if not isinstance(shards, VectorSet):
        shards = VectorSet.load(shards)
    start = time.perf_counter()
    if trained is not None:
        index, sampled = faiss.clone_index(trained), 0  # trained once on the whole set's sample, elsewhere
    else:
        index, sampled = trained_empty(shards, factory, seed, train_size)
    meta = IndexMeta(
        factory=factory,
        dim=int(shards.dim),
        metric=METRIC,
        ntotal=0,
        corpus_fingerprint=corpus_fingerprint,
        encoder=encoder,
        encoder_step=encoder_step,
        precision=precision,
        build_seconds=time.perf_counter() - start,
        extra={
            "shards": len(shards.files),
            "train_rows": sampled,
            "vector_dtype": shards.dtype,
            **({"shared_quantizer": True} if trained is not None else {}),
        },
    )
    try:
        return build_from_chunks(shards.iter_parts() if rows is None else iter_rows(shards, *rows), index, meta)
    except ValueError as e:
        raise ValueError(f"{shards.folder}: {e}") from None


def save_atomic(index: Index, folder: str | Path, complete: Callable[[Path], None] | None = None) -> Path:
    """`index.save` (a `DenseIndex`, or the run's `ShardedIndex`) into `<folder>.tmp-<pid>`, renamed to `folder` on
    success (an old index is replaced only once the new one is complete; a failed save leaves the old one
    untouched). `complete(tmp)` adds files to the new folder before the rename (an index shard's manifest)."""
    folder = Path(folder)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    old = folder.with_name(f"{folder.name}.old-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        index.save(tmp)
        if complete is not None:
            complete(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)
    return folder
