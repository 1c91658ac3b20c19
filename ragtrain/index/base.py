"""What users of an index call. `Index` is the run's index, held by the shard group's actors (`ShardedIndex`,
index/sharded.py, at any shard count): evaluation, mining, the live refresh and the generator's retrieval search
it, save it and drop it. `ReadOnlyIndex` is the part that only reads: a saved index opened in this process
(`ReadOnlyShards`, by `open_saved`: `python -m ragtrain search`, `ask`, `paired`, the generator's checks) is one,
searched through the same scatter-and-merge as the actors' index, and it can be neither saved nor dropped."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from ragtrain.index.faiss_index import IndexMeta


class ReadOnlyIndex(Protocol):
    """An index that is searched, never written."""

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

    def reconstruct_first(self, n: int) -> np.ndarray | None:
        """The stored vectors of the first `n` rows, or None where the index type cannot give them back."""
        ...

    def as_stored(self, x: np.ndarray) -> np.ndarray:
        """`x` through the index's codec: what storing it would give back."""
        ...


@runtime_checkable  # what saves an index checks that it is one (a saved index opened read-only is not)
class Index(ReadOnlyIndex, Protocol):
    """The run's index: read as a `ReadOnlyIndex`, and saved and freed where it is held."""

    def save(self, folder: str | Path) -> Path:
        """Write the index into `folder` (read back by `open_saved` or `ShardGroup.load`)."""
        ...

    def drop(self) -> None:
        """Free the index where it is held (the handle is unusable afterwards)."""
        ...
