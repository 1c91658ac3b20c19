"""The index host: a Ray actor that builds FAISS indexes from vector shards and answers searches.

The driver of a run evaluates and mines from every index it builds. Searching there means holding the index there:
4 bytes x dim per passage for a Flat index (307 MB for 200k MiniLM passages). `IndexHost` holds the indexes
instead, and the driver gets a `RemoteIndex` (the passage ids, the metadata and a handle), which has
`DenseIndex`'s interface, so callers search either the same way. The search itself is still `DenseIndex.search`
(dimension and metric checks), run in the actor. One host per `Retrieval`; it holds each build under its tag.

The host asks for no CPU of its own (as the live index service): it works only while the driver waits on it, and
a reservation would take a CPU from the trainer or the encode actors for the whole run.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import faiss
import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ragtrain.index.faiss_index import DenseIndex, IndexMeta, load_index
from ragtrain.index.shards import build_configured_from_shards
from ragtrain.rss import peak_rss_mb

if TYPE_CHECKING:
    from ragtrain.config import IndexConfig, PoolResources


class BuildHolder:
    """What a holder of FAISS builds by tag answers (the index host, an index shard): each call goes to the
    `DenseIndex` of the build `tag`, run where the build lives."""

    indexes: dict[str, DenseIndex]

    def build_of(self, tag: str) -> DenseIndex:
        if tag not in self.indexes:
            raise KeyError(f"{self.holder()} holds no build {tag!r} (it holds {sorted(self.indexes)})")
        return self.indexes[tag]

    def holder(self) -> str:
        return "the index host"

    def search(self, tag: str, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """`DenseIndex.search` on the build `tag` (its own rows)."""
        return self.build_of(tag).search(queries, k)

    def set_search_params(self, tag: str, nprobe: int, ef_search: int) -> None:
        """IVF nprobe / HNSW efSearch of the build `tag`."""
        self.build_of(tag).set_search_params(nprobe, ef_search)

    def reconstruct_first(self, tag: str, n: int) -> np.ndarray | None:
        """`DenseIndex.reconstruct_first` of the build `tag`."""
        return self.build_of(tag).reconstruct_first(n)

    def as_stored(self, tag: str, x: np.ndarray) -> np.ndarray:
        """`DenseIndex.as_stored` of the build `tag`."""
        return self.build_of(tag).as_stored(x)


class _Host(BuildHolder):
    """The actor's body (a plain class, so tests can use it in-process): indexes by tag."""

    def __init__(self, threads: int = 0) -> None:
        if threads > 0:  # FAISS would use every core of the node, which it shares with trainers and actors
            faiss.omp_set_num_threads(threads)
        self.indexes: dict[str, DenseIndex] = {}

    def build(
        self, tag: str, shard_folder: str, idx: IndexConfig, fingerprint: str, encoder: str, step: int, seed: int
    ) -> tuple[list[str], dict]:
        """Build `tag` from the shards in `shard_folder` (replacing an older build of that tag); returns its row ids
        and metadata."""
        self.indexes.pop(tag, None)  # free the old build first: two copies of a large index need not fit
        index = build_configured_from_shards(shard_folder, idx, fingerprint, encoder, step, seed)
        self.indexes[tag] = index
        return index.doc_ids, asdict(index.meta)

    def load(self, tag: str, folder: str) -> tuple[list[str], dict]:
        """Load a saved index as `tag` (the caller checked it); returns its row ids and metadata."""
        self.indexes.pop(tag, None)
        index = load_index(folder)
        self.indexes[tag] = index
        return index.doc_ids, asdict(index.meta)

    def serialize(self, tag: str) -> np.ndarray:
        """The index as faiss's serialised bytes (for searchers that load their own copy)."""
        return self.indexes[tag].serialize()

    def save(self, tag: str, folder: str) -> str:
        """`DenseIndex.save` of the build `tag` into `folder`."""
        return str(self.indexes[tag].save(folder))

    def drop(self, tag: str) -> None:
        """Forget the build `tag` (its memory goes back)."""
        self.indexes.pop(tag, None)

    def peak_rss_mb(self) -> float:
        """This process's peak resident set (MB)."""
        return peak_rss_mb()


IndexHost = ray.remote(num_cpus=0)(_Host)


def start_host(pool: PoolResources, threads: int = 0) -> Any:
    """An IndexHost actor placed by `host_options` on the live cluster (`threads`: FAISS's, 0 = its default)."""
    return IndexHost.options(**host_options(pool, ray.nodes())).remote(threads)


def host_options(pool: PoolResources, nodes: list[dict]) -> dict[str, Any]:
    """Where the IndexHost goes: a 0-CPU actor would land on the driver's node (on KubeRay the head, meant for the
    driver alone), so it goes next to the pool: to a node that carries the pool's custom resources (soft: any node
    if none is alive), with the pool's CPU count as FAISS threads (the pool is idle while an index is built)."""
    opts: dict[str, Any] = {}
    if pool.resources:
        fit = [
            n["NodeID"] for n in nodes if n.get("Alive") and all(n["Resources"].get(k, 0) > 0 for k in pool.resources)
        ]
        if fit:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(fit[0], soft=True)
    return opts


class RemoteIndex:
    """`DenseIndex`'s interface to a build held by an `IndexHost`: ids and metadata here, the vectors there."""

    def __init__(self, host: Any, tag: str, doc_ids: list[str], meta: IndexMeta):
        self.host, self.tag, self.doc_ids, self.meta = host, tag, doc_ids, meta

    @classmethod
    def build(
        cls,
        host: Any,
        tag: str,
        shard_folder: str | Path,
        idx: IndexConfig,
        fingerprint: str,
        encoder: str,
        step: int,
        seed: int,
    ) -> RemoteIndex:
        """Build `tag` in `host` from a shard folder."""
        ids, meta = ray.get(host.build.remote(tag, str(shard_folder), idx, fingerprint, encoder, step, seed))
        return cls(host, tag, ids, IndexMeta(**meta))

    @classmethod
    def load(cls, host: Any, tag: str, folder: str | Path) -> RemoteIndex:
        """Load a saved index folder into `host` as `tag` (the folder is on storage the host's node reads)."""
        ids, meta = ray.get(host.load.remote(tag, str(folder)))
        return cls(host, tag, ids, IndexMeta(**meta))

    @property
    def ntotal(self) -> int:
        """Rows in the index."""
        return self.meta.ntotal

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, row positions) for each query row (`DenseIndex.search`, in the host)."""
        return ray.get(self.host.search.remote(self.tag, np.ascontiguousarray(queries, dtype=np.float32), k))

    def search_ids(self, queries: np.ndarray, k: int) -> list[list[str]]:
        """Top-k doc ids per query row (FAISS's -1 padding dropped)."""
        _, rows = self.search(queries, k)
        return [[self.doc_ids[r] for r in row if r >= 0] for row in rows]

    def set_search_params(self, nprobe: int = 16, ef_search: int = 128) -> None:
        """IVF nprobe / HNSW efSearch, where the index type has them."""
        ray.get(self.host.set_search_params.remote(self.tag, nprobe, ef_search))

    def reconstruct_first(self, n: int) -> np.ndarray | None:
        """The stored vectors of the first `n` rows (`DenseIndex.reconstruct_first`, in the host)."""
        return ray.get(self.host.reconstruct_first.remote(self.tag, n))

    def as_stored(self, x: np.ndarray) -> np.ndarray:
        """`x` through the index's codec (`DenseIndex.as_stored`, in the host)."""
        return ray.get(self.host.as_stored.remote(self.tag, np.ascontiguousarray(x, dtype=np.float32)))

    def serialize(self) -> Any:
        """An ObjectRef to the serialised index: a searcher fetches it where it runs, not through the driver."""
        return self.host.serialize.remote(self.tag)

    def save(self, folder: str | Path) -> Path:
        """`DenseIndex.save` into `folder`, written by the host (the run folder is on storage every node reads)."""
        return Path(ray.get(self.host.save.remote(self.tag, str(folder))))

    def drop(self) -> None:
        """Free the build in the host (the handle is unusable afterwards)."""
        ray.get(self.host.drop.remote(self.tag))
