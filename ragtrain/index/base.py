"""The `Index` protocol: what every user of an index (evaluation, mining, the live refresh, the generator's
retrieval) calls. Its implementation is the shard group's `ShardedIndex` (index/sharded.py), at any shard count;
`LocalShards` reads a saved one in-process: a `SearchIndex`, the protocol without `save`."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from ragtrain.index.faiss_index import IndexMeta


class SearchIndex(Protocol):
    """An index to search: the run's `ShardedIndex`, or a saved one loaded in this process (`LocalShards`)."""

    doc_ids: list[str]  # the id of every row, in row order
    meta: IndexMeta

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, row positions) for each query row; positions are -1 where fewer than k exist."""
        ...

    def search_ids(self, queries: np.ndarray, k: int) -> list[list[str]]:
        """Top-k row ids per query row."""
        ...

    def set_search_params(self, nprobe: int = 16, ef_search: int = 128) -> None:
        """IVF nprobe / HNSW efSearch, where the index type has them."""
        ...

    def drop(self) -> None:
        """Free the index where it is held (the handle is unusable afterwards)."""
        ...


@runtime_checkable  # the pipeline checks that the index it saves is one (a loaded saved index is not)
class Index(SearchIndex, Protocol):
    """A `SearchIndex` that can write itself: the run's `ShardedIndex`."""

    def save(self, folder: str | Path) -> Path:
        """Write the index into `folder` (read back by `LocalShards.load` or `ShardGroup.load`)."""
        ...
