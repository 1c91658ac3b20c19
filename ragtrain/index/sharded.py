"""The index: `index.shards=N` IndexShard actors (N=1 by default), each owning a contiguous range of the passages.

With N > 1 each shard reads its own rows' texts from the store (by row range, on its node), encodes them with the
corpus encoder (`EncodeBatch`, the Ray Data stage's class) and writes them as vector files; every shard builds its
FAISS index from its rows of a vector set; trained types (IVF, PQ) copy one quantiser trained once on a seeded
sample of the whole corpus (the same sample one shard trains on), so every shard scores alike and N shards find
what one finds. A shard persists every build as `<root>/<tag>/shard-<i>/` (index files + `manifest.json`: rows,
version, factory, dim, checksum) before it answers, and an actor restarted after a crash reloads its last persisted
builds.

A search encodes its queries once (the caller), sends them to every shard in batches, and merges the shards' top-k
by score, ties broken by global row: with Flat, N shards return exactly the ids and scores of one index.
`ShardedIndex` (the actors' handle) is the one implementation of the `Index` protocol (index/base.py): evaluation,
mining, the live refresh and the generator's retrieval search through it. `ReadOnlyShards` reads a saved folder in
this process (`python -m ragtrain search`, `ask`, `paired`, the checks of a saved index before Ray starts): a
`ReadOnlyIndex`, searched through the same code (`_Merged`: checks, query batches, merge) with the shards' own
`DenseIndex.search` called here instead of in the actors. The driver holds the passage ids and the metadata, never
vectors.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import faiss
import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ragtrain.config.index import GPU_MAX_K
from ragtrain.corpus.encode import VectorSet, write_vectors
from ragtrain.data.store import PassageStore
from ragtrain.embed.encoders import EncodeBatch, LocalEncoder
from ragtrain.index import integrity
from ragtrain.index.checks import check_refresh
from ragtrain.index.faiss_index import (
    METRIC,
    DenseIndex,
    IndexMeta,
    IndexMismatchError,
    build_from_chunks,
    index_to_gpu,
    load_index,
    make_index,
    set_gpu_search_params,
)
from ragtrain.index.live_rows import LiveRows
from ragtrain.index.priority import PRIORITIES
from ragtrain.index.vector_files import build_from_vectors, iter_rows, save_atomic, trained_empty
from ragtrain.runtime.console import get_logger, worker_setup
from ragtrain.runtime.errors import ConfigError
from ragtrain.runtime.netdev import interface_bytes
from ragtrain.runtime.rss import peak_rss_mb

if TYPE_CHECKING:
    from ragtrain.config.index import IndexConfig, RefreshConfig
    from ragtrain.config.resources import PoolResources
    from ragtrain.config.retriever import RetrieverConfig

log = get_logger(__name__)

INDEX_NODE = "index_node"  # the custom resource that marks a node for index shards
MANIFEST = "manifest.json"  # a shard build's summary, written last: a folder without it is unfinished
SHARDED = "sharded.json"  # a saved sharded index's list of shards (beside index_meta.json)
MAX_SHARD_RESTARTS = 3  # a crashed shard actor is restarted this many times; its pending calls are retried on it
SEARCH_BATCH = 1024  # queries per scattered call: bounds each message and lets the shards work in a pipeline
TEXT_CHUNK = 4096  # passages a shard reads, encodes and writes at a time (one vector file each)
LIVE_BASE = "live-base"  # a shard's copy of the build its live rows started from (see _Shard.live_start)
LIVE_STATE = ".live-rows"  # under a shard group's root: each shard's persisted live rows (not a build's tag)
FAULTS = ".faults"  # under a shard group's root: the fault hooks' markers (fault.hold_shard_encode, ...)
HOLD_MAX_S = 300.0  # fault.hold_shard_encode: the longest a held encode waits for its announcement's removal
INDEX_NODE_SHARE = 0.001  # each shard's claim on `index_node`: a placement label, not a capacity (pools share it)


class LiveStateLost(RuntimeError):
    """A restarted shard no longer holds its live rows: the refresh service starts them again (from disk)."""


class ShardUnavailableError(RuntimeError):
    """A shard did not answer within index.shard_timeout_s, or died beyond its restarts; names the shard."""


# ---------------------------------------------------------------------------------------------------------- layout


def shard_ranges(rows: int, n: int) -> list[tuple[int, int]]:
    """The stable partition: `n` contiguous row ranges [start, stop) covering `rows`, sizes differing by <= 1."""
    if n < 1 or n > rows:
        raise ValueError(f"cannot split {rows} rows into {n} shards")
    edges = [rows * i // n for i in range(n + 1)]
    return [(edges[i], edges[i + 1]) for i in range(n)]


def index_nodes(nodes: Sequence[dict]) -> list[dict]:
    """The alive nodes offering `index_node` (ray.nodes() entries)."""
    return [n for n in nodes if n.get("Alive") and n.get("Resources", {}).get(INDEX_NODE, 0) > 0]


def resolve_shards(setting: str, rows: int, nodes: Sequence[dict] | None = None) -> int:
    """The shard count index.shards asks for: a number, or `auto` = one per node offering `index_node` (needs
    `nodes`). A ConfigError names the key when it cannot be served: more shards than passages, or `auto` on a
    cluster without index nodes (the message lists the resources it has)."""
    if setting == "auto":
        if nodes is None:
            raise ValueError("index.shards=auto is resolved against the live cluster's nodes")
        found = index_nodes(nodes)
        if not found:
            have = sorted(
                {
                    k
                    for n in nodes
                    if n.get("Alive")
                    for k in n.get("Resources", {})
                    if not k.startswith(("node:", "accelerator_type:"))
                }
            )
            raise ConfigError(
                f"index.shards=auto places one shard per node offering the {INDEX_NODE!r} resource, "
                f"but no node offers it (this cluster has: {', '.join(have)}): start index nodes with "
                f"--resources='{{\"{INDEX_NODE}\": 1}}' or set index.shards to a number"
            )
        n = len(found)
    else:
        n = int(setting)
    if n > rows:
        raise ConfigError(
            f"index.shards={setting} asks for {n} shards but the corpus has only {rows} passages: "
            "every shard needs at least one"
        )
    return n


def shard_gpus(idx: IndexConfig) -> float:
    """The GPU fraction each index shard claims: index.gpus_per_shard with index.device=cuda, else 0."""
    return idx.gpus_per_shard if idx.device == "cuda" else 0.0


def shard_gpu_claim(idx: IndexConfig) -> tuple[int, float]:
    """(shards, GPU each) that index.device=cuda holds for the whole run, for the resource checks (`auto`: counted
    once the cluster resolves it, so 0 here)."""
    return (int(idx.shards), idx.gpus_per_shard) if idx.device == "cuda" and idx.shards.isdigit() else (0, 0.0)


def check_shard_config(
    idx: IndexConfig,
    refresh: RefreshConfig,
    dim: int,
    rows: int,
    nodes: Sequence[dict] | None = None,
    encode_fault: bool = False,
) -> None:
    """index.shards and the live refresh against the corpus of `rows` passages and the encoder's `dim` (and, for
    `auto`, the cluster's `nodes`), before any work: a ConfigError names the key. `encode_fault`:
    fault.kill_encode_actor_at_batch is set."""
    if nodes is None:
        check_refresh(refresh, dim, rows)
    if idx.shards != "auto" or nodes is not None:
        resolve_shards(idx.shards, rows, nodes)
    if encode_fault and idx.shards != "1":
        raise ConfigError(
            f"fault.kill_encode_actor_at_batch kills a Ray Data encode actor, and with index.shards={idx.shards} "
            "the index shards encode instead: inject it with index.shards=1"
        )


def read_manifest(folder: Path) -> dict:
    """A shard folder's manifest, checked against its files: IndexMismatchError names the shard folder when it is
    missing, unfinished or corrupt (index bytes that do not match the recorded checksum)."""
    path = folder / MANIFEST
    if not path.exists():
        raise IndexMismatchError(f"index shard {folder} is missing or unfinished ({path} does not exist)")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise IndexMismatchError(f"index shard {folder}: unreadable {MANIFEST} ({e})") from None
    integrity.check_shard_files(folder, m, MANIFEST)  # every file a search reads, index.faiss first
    return m


def persist(index: DenseIndex, folder: Path, manifest: dict) -> dict:
    """Save `index` with its manifest (checksum added) into `folder` through a temporary folder renamed on
    success (`shards.save_atomic`): a crash leaves the previous version in place."""

    def complete(tmp: Path) -> None:
        manifest.update(rows=index.ntotal, dim=index.meta.dim, factory=index.meta.factory)
        manifest["files"] = integrity.file_checksums(tmp)
        manifest["checksum"] = manifest["files"]["index.faiss"]
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))

    manifest = dict(manifest)
    save_atomic(index, folder, complete)
    return manifest


# ------------------------------------------------------------------------------------------------------------ merge


def merge_topk(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], offsets: Sequence[int], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Merge the shards' (scores, local rows) into the top-k (scores, global rows) per query: by score, ties by
    global row; FAISS's -1 padding (fewer reachable rows than k) goes last and stays -1."""
    scores = np.concatenate([s for s, _ in parts], axis=1)
    rows = np.concatenate([np.where(r >= 0, r + off, -1) for (_, r), off in zip(parts, offsets)], axis=1)
    key_rows = np.where(rows >= 0, rows, np.iinfo(np.int64).max)
    key_scores = np.where(rows >= 0, -scores.astype(np.float64), np.inf)
    order = np.lexsort((key_rows, key_scores), axis=-1)[:, :k]
    return np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1)


class _Merged:
    """`DenseIndex`'s interface over shards that each search their own rows, the one search path of both index
    handles: subclasses only scatter a query batch to the shards (actors, or in this process); this merges."""

    doc_ids: list[str]
    meta: IndexMeta
    offsets: list[int]

    @property
    def ntotal(self) -> int:
        """Rows in the index (all shards)."""
        return self.meta.ntotal

    def _scatter(self, queries: np.ndarray, k: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        """Per query batch, every shard's (scores, local rows)."""
        raise NotImplementedError

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, global row positions) for each query row; positions are -1 where fewer than k exist."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if q.ndim != 2 or q.shape[1] != self.meta.dim:
            raise IndexMismatchError(f"query vectors have shape {q.shape}, index dim is {self.meta.dim}")
        if k < 1 or self.ntotal == 0:
            raise ValueError(f"search needs k >= 1 and a non-empty index (k={k}, ntotal={self.ntotal})")
        k = min(k, self.ntotal)
        merged = [merge_topk(parts, self.offsets, k) for parts in self._scatter(q, k)]
        return np.concatenate([s for s, _ in merged]), np.concatenate([r for _, r in merged])

    def search_ids(self, queries: np.ndarray, k: int) -> list[list[str]]:
        """Top-k doc ids per query row (FAISS's -1 padding dropped)."""
        _, rows = self.search(queries, k)
        return [[self.doc_ids[r] for r in row if r >= 0] for row in rows]

    def _first_of(self, shard: int, n: int) -> np.ndarray | None:
        """The stored vectors of shard `shard`'s first `n` rows, or None where its type cannot give them back."""
        raise NotImplementedError

    def reconstruct_first(self, n: int) -> np.ndarray | None:
        """The stored vectors of the first `n` rows (from the shards that hold them), or None."""
        sizes = np.diff([*self.offsets, self.ntotal])
        out, got = [], 0
        for shard, size in enumerate(sizes):
            if got >= n:
                break
            part = self._first_of(shard, min(int(size), n - got))
            if part is None:
                return None
            out.append(part)
            got += len(part)
        return np.concatenate(out) if out else None


def _batches(q: np.ndarray) -> list[np.ndarray]:
    return [q[i : i + SEARCH_BATCH] for i in range(0, len(q), SEARCH_BATCH)] or [q]


# ------------------------------------------------------------------------------------------------------ the actor


class _Shard:
    """The actor's body (a plain class, so tests can run it in-process): shard `shard`'s builds by tag, persisted
    under `<root>/<tag>/shard-<shard>/`; a restarted actor reloads them from there. Each search, parameter change
    or codec call goes to the `DenseIndex` of the build `tag`.

    device=cuda (index.device): each build also gets a copy on the actor's GPU, and searches go there; the CPU
    build stays the one that is persisted, saved, reconstructed and cloned for the live refresh's rebuilds (FAISS
    writes only CPU indexes)."""

    def __init__(self, shard: int, root: str, threads: int = 0, device: str = "cpu") -> None:
        worker_setup()
        self.shard, self.root, self.threads, self.device = shard, Path(root), max(0, int(threads)), device
        if self.threads:  # FAISS would use every core of a node it shares with the other shards (torch: encode)
            faiss.omp_set_num_threads(self.threads)
        self.indexes: dict[str, DenseIndex] = {}
        self.on_gpu: dict[str, faiss.Index] = {}  # device=cuda: the GPU copy of each build, what searches use
        # FAISS's GPU resources serve one CPU thread at a time (max_concurrency threads search, build, refresh):
        # every use of a GPU index holds this lock, its copy to the GPU and its freeing included
        self.gpu_lock = threading.Lock()
        self.manifests: dict[str, dict] = {}
        self.restored: list[str] = []
        self.live: Any = None  # LiveRows while a live refresh holds this shard's rows (live_start)
        self.live_encoders: dict[int, Any] = {}
        self.net_start: tuple[int | None, tuple[int, int] | None] = (None, None)
        for m in sorted(self.root.glob(f"*/shard-{shard}/{MANIFEST}")):  # a restart continues from disk
            tag = m.parent.parent.name
            try:
                self._load(tag, m.parent)
            except (IndexMismatchError, ConfigError) as e:  # one unreadable build must not keep the shard from starting
                log.warning("index shard %d does not restore the build %r: %s", shard, tag, e)
                continue
            self.restored.append(tag)

    def _folder(self, tag: str) -> Path:
        return self.root / tag / f"shard-{self.shard}"

    def _load(self, tag: str, folder: Path) -> dict:
        manifest = read_manifest(folder)
        index = load_index(folder)
        params = manifest.get("search_params", (16, 128))
        index.set_search_params(*params)
        self._set_build(tag, index, self._gpu_copy(index, params[0]))
        self.manifests[tag] = manifest
        return manifest

    def _gpu_copy(self, index: DenseIndex, nprobe: int) -> faiss.Index | None:
        """With device=cuda, `index` copied to this actor's GPU and searched with `nprobe` (a factory FAISS cannot
        put on a GPU: ConfigError naming index.factory); None on CPU."""
        if self.device != "cuda":
            return None
        with self.gpu_lock:
            gpu = index_to_gpu(index.index, index.meta.factory)
            set_gpu_search_params(gpu, nprobe)
            return gpu

    def _set_build(self, tag: str, index: DenseIndex, gpu: faiss.Index | None) -> None:
        """Make `index` (and its GPU copy) the build `tag`: a search running meanwhile sees the previous build or
        this one."""
        with self.gpu_lock:  # together: a search pairs a build with its own GPU copy; a replaced copy is freed here
            if gpu is not None:
                self.on_gpu[tag] = gpu
            self.indexes[tag] = index

    def _gpu_tags(self) -> list[str]:
        with self.gpu_lock:  # another thread may be adding or freeing one
            return sorted(self.on_gpu)

    def _drop_gpu(self, tag: str) -> None:
        """Free the GPU copy of the build `tag` (if any), under the lock."""
        with self.gpu_lock:
            self.on_gpu.pop(tag, None)

    def encode(
        self,
        source: Any,
        start: int,
        stop: int,
        weights: list,
        retriever: RetrieverConfig,
        idx: IndexConfig,
        folder: str,
    ) -> dict:
        """Encode rows [start, stop) of `source` (a PassageStore, read here; or [ObjectRef of (ids, texts)] of
        just these rows) with the snapshot `weights` ([ObjectRef]) into vector files in `folder`; returns
        {rows, dim, files, seconds}."""
        t0 = time.perf_counter()
        enc = EncodeBatch(
            retriever,
            weights,
            retriever.passage_max_length,
            idx.batch_size,
            idx.precision.value,
            idx.vector_dtype,
            num_threads=self.threads or None,
        )
        if isinstance(source, PassageStore):

            def read(a: int, b: int) -> tuple[list[str], list[str]]:
                return source.slice_texts(a, b)
        else:
            ids, texts = ray.get(source[0])

            def read(a: int, b: int) -> tuple[list[str], list[str]]:
                return list(ids[a - start : b - start]), list(texts[a - start : b - start])

        def chunks():
            for a in range(start, stop, TEXT_CHUNK):
                chunk_ids, chunk_texts = read(a, min(stop, a + TEXT_CHUNK))
                yield chunk_ids, enc.encode(chunk_texts)

        shards = write_vectors(folder, chunks(), idx.vector_dtype)
        return {
            "rows": shards.rows,
            "dim": shards.dim,
            "files": shards.files,
            "seconds": time.perf_counter() - t0,
            "peak_rss_mb": peak_rss_mb(),
        }

    def build(
        self,
        tag: str,
        shard_folder: str,
        start: int,
        stop: int,
        idx: IndexConfig,
        fingerprint: str,
        encoder: str,
        step: int,
        trained: Any,
        version: int,
    ) -> dict:
        """Build `tag` from rows [start, stop) of the vector files in `shard_folder` (`trained`: serialised
        bytes of the shared trained empty index, or None for types without training), persist it, and hold it;
        returns its manifest plus its row ids."""
        # Free the old build's memory first (two copies of a large shard need not fit); its files stay until the
        # new build is persisted, so a crash meanwhile restarts from the old version
        self.indexes.pop(tag, None)
        self._drop_gpu(tag)
        quantizer = faiss.deserialize_index(trained) if trained is not None else None
        index = build_from_vectors(
            shard_folder,
            idx.factory,
            fingerprint,
            encoder,
            step,
            idx.precision.value,
            rows=(start, stop),
            trained=quantizer,
        )
        index.set_search_params(idx.nprobe, idx.ef_search)
        gpu = self._gpu_copy(index, idx.nprobe)  # before persisting: a build that cannot go on the GPU is not kept
        manifest = persist(
            index,
            self._folder(tag),
            {
                "shard": self.shard,
                "tag": tag,
                "version": version,
                "start": start,
                "stop": stop,
                "encoder": encoder,
                "encoder_step": step,
                "corpus_fingerprint": fingerprint,
                "search_params": [idx.nprobe, idx.ef_search],
                "build_seconds": index.meta.build_seconds,
            },
        )
        self._set_build(tag, index, gpu)
        self.manifests[tag] = manifest
        return {**manifest, "doc_ids": index.doc_ids, "meta": asdict(index.meta), "peak_rss_mb": peak_rss_mb()}

    def load(self, tag: str, folder: str) -> dict:
        """Load a saved shard folder (checked against its manifest) as `tag`, placed first under this shard's root
        (hard links where possible) so a restart reloads it; returns its manifest plus ids."""
        self.drop(tag)
        read_manifest(Path(folder))
        _link_tree(Path(folder), self._folder(tag))
        manifest = self._load(tag, self._folder(tag))
        index = self.indexes[tag]
        return {**manifest, "doc_ids": index.doc_ids, "meta": asdict(index.meta)}

    def build_of(self, tag: str) -> DenseIndex:
        if tag not in self.indexes:
            raise KeyError(f"index shard {self.shard} holds no build {tag!r} (it holds {sorted(self.indexes)})")
        return self.indexes[tag]

    def search(self, tag: str, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """`DenseIndex.search` on the build `tag` (this shard's rows), on its GPU copy with device=cuda (on the CPU
        build past the GPU's k limit, GPU_MAX_K)."""
        with self.gpu_lock:  # the same checks as on the CPU (shape, k), then FAISS's GPU search
            build, gpu = self.build_of(tag), self.on_gpu.get(tag)  # one build's rows and its GPU copy
            # deeper (mining, MaxP over chunks) FAISS's GPU search refuses: the CPU build answers it
            if gpu is not None and min(k, build.ntotal) <= GPU_MAX_K:
                found = DenseIndex(gpu, build.doc_ids, build.meta).search(queries, k)
                del gpu  # the last reference may be ours (a refresh replaced the build): freed under the lock
                return found
        return build.search(queries, k)

    def set_search_params(self, tag: str, nprobe: int, ef_search: int) -> None:
        """IVF nprobe / HNSW efSearch of the build `tag` (and of its GPU copy: nprobe)."""
        self.build_of(tag).set_search_params(nprobe, ef_search)
        with self.gpu_lock:
            gpu = self.on_gpu.get(tag)
            if gpu is not None:
                set_gpu_search_params(gpu, nprobe)
                del gpu  # (see search)

    def reconstruct_first(self, tag: str, n: int) -> np.ndarray | None:
        """`DenseIndex.reconstruct_first` of the build `tag`."""
        return self.build_of(tag).reconstruct_first(n)

    def as_stored(self, tag: str, x: np.ndarray) -> np.ndarray:
        """`DenseIndex.as_stored` of the build `tag`."""
        return self.build_of(tag).as_stored(x)

    def save(self, tag: str, folder: str) -> dict:
        """Place this shard's persisted build `tag` in `folder` (hard links where the file system allows)."""
        _link_tree(self._folder(tag), Path(folder))
        return self.manifests[tag]

    def drop(self, tag: str) -> None:
        """Forget the build `tag` and its persisted folder (a restart does not bring it back)."""
        self.indexes.pop(tag, None)
        self._drop_gpu(tag)
        self.manifests.pop(tag, None)
        shutil.rmtree(self._folder(tag), ignore_errors=True)

    # -------------------------------------------------------------------------------- the live index (refresh)

    def live_start(
        self,
        from_tag: str,
        vector_folder: str,
        source: Any,
        start: int,
        stop: int,
        fresh: bool = False,
        committed: int = 0,
    ) -> dict:
        """Hold rows [start, stop)'s vectors from the vector set `vector_folder` (the build `from_tag` was made
        from) as this shard's live rows, and their texts' source (a PassageStore, or [ObjectRef of (ids, texts)]
        of these rows) for re-encoding. A persisted live state of the same rows (a restart) is continued, unless
        `fresh` (the start of a run's live index); a journaled round is finished if it is the version searches
        were switched to (`committed`), else dropped (`LiveRows.resolve`)."""
        vecs = np.concatenate([v for _, v in iter_rows(VectorSet.load(vector_folder), start, stop)])
        if isinstance(source, PassageStore):

            def read(local: np.ndarray) -> list[str]:  # one slice per run of consecutive rows
                out: list[str] = []
                for run in np.split(local, np.flatnonzero(np.diff(local) != 1) + 1):
                    if len(run):
                        out.extend(source.slice_texts(start + int(run[0]), start + int(run[-1]) + 1)[1])
                return out
        else:
            texts = ray.get(source[0])[1]

            def read(local: np.ndarray) -> list[str]:
                return [texts[int(r)] for r in local]

        if fresh:
            shutil.rmtree(self._live_folder(), ignore_errors=True)
        self.live = LiveRows(self._live_folder(), vecs.astype(np.float32), read)
        resolved = self.live.resolve(committed)
        if resolved is not None:
            log.warning("index shard %d restarted between a barrier and its apply: %s", self.shard, resolved)
        if from_tag != LIVE_BASE:  # its own persisted copy: the run may drop `from_tag`, and a restart reloads this
            self.load(LIVE_BASE, str(self._folder(from_tag)))
        self.live_template = self.indexes[LIVE_BASE]  # ids, metadata and the trained quantiser of every rebuild
        self.live_params = self.manifests[LIVE_BASE].get("search_params", (16, 128))
        return {"rows": self.live.rows, "mix": self.live.mix()}

    def _live_folder(self) -> Path:
        """Where this shard persists its live rows: a folder no build's tag names, so drop() spares it."""
        return self.root / LIVE_STATE / f"shard-{self.shard}"

    def _live(self) -> Any:
        if self.live is None:
            raise LiveStateLost(f"index shard {self.shard} holds no live rows (restarted): start them again")
        return self.live

    def _encoder(self, version: int, weights: list, retriever: RetrieverConfig, idx: IndexConfig) -> Any:
        if version not in self.live_encoders:  # one encoder per snapshot, dropped when a newer one comes
            # the node's interface counters before the snapshot is fetched: a round's bytes are measured from here
            self.net_start = (version, interface_bytes())
            self.live_encoders = {version: LocalEncoder(retriever, weights, idx.batch_size, idx.precision.value)}
        return self.live_encoders[version]

    def _net_since(self, version: int) -> dict:
        """The bytes this shard's node received and sent since it began fetching the snapshot of `version` (all of
        the node's traffic: the snapshot, the texts, and anything else on its link meanwhile); {} without counters."""
        since, before = self.net_start
        now = interface_bytes()
        if since != version or before is None or now is None:
            return {}
        node = ray.get_runtime_context().get_node_id()
        return {"node": node, "rx_bytes": now[0] - before[0], "tx_bytes": now[1] - before[1]}

    def encode_few(
        self, version: int, weights: list, retriever: RetrieverConfig, idx: IndexConfig, texts: list[str], role: str
    ) -> np.ndarray:
        """Vectors of a few texts (queries, anchors, probe passages) with the snapshot of `version`."""
        enc = self._encoder(version, weights, retriever, idx)
        n = retriever.query_max_length if role == "query" else retriever.passage_max_length
        return enc.encode(texts, n, role)

    def live_encode(
        self,
        version: int,
        weights: list,
        retriever: RetrieverConfig,
        idx: IndexConfig,
        fraction: float,
        priority: str,
        hot: np.ndarray | None,
        seed: int,
        threads: int,
        hold_shard: int = -1,
    ) -> dict:
        """Re-encode this round's share of the live rows with the snapshot of `version` (kept pending), on
        `threads` CPUs (the refresh's share of the cluster: training runs beside it). `hold_shard`:
        fault.hold_shard_encode."""
        import torch  # lazy: torch is heavy (seconds); this module imports without it

        live = self._live()
        if hold_shard == self.shard and self._fault_once("hold-encode"):
            self._hold(version)
        torch.set_num_threads(max(1, threads))
        enc = self._encoder(version, weights, retriever, idx)
        stats = live.encode_round(
            version,
            lambda texts: enc.encode(texts, retriever.passage_max_length, "passage"),
            fraction,
            PRIORITIES[priority](),
            hot,
            seed,
        )
        return {**stats, "shard": self.shard, **self._net_since(version)}

    def live_apply(self, version: int, kill_shard: int = -1) -> dict:
        """Make the pending round searchable-to-be (stored and persisted); returns {version: rows}. `kill_shard`:
        fault.kill_shard_before_apply (the service calls this after the barrier)."""
        live = self._live()
        if kill_shard == self.shard and self._fault_once("kill-before-apply"):
            log.warning(
                "index shard %d exits before applying version %d (fault.kill_shard_before_apply)", self.shard, version
            )
            os._exit(1)
        return live.apply(version)

    def live_discard(self, tag: str) -> None:
        """A round that failed before its barrier: forget its staged build `tag` and its journal."""
        self.drop(tag)
        if self.live is not None:
            self.live.drop_journal()

    def _fault_once(self, name: str) -> bool:
        """Whether fault hook `name` fires now: once per run folder (a marker file), so a restarted shard's
        retried call passes."""
        marker = self.root / FAULTS / f"{name}-shard-{self.shard}"
        if marker.exists():
            return False
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(os.getpid()))
        return True

    def _hold(self, version: int) -> None:
        """fault.hold_shard_encode: announce this encode (pid, version) and wait until the announcement is removed
        (at most HOLD_MAX_S): a test's signal then lands while the round is in flight."""
        note = self.root / FAULTS / f"encoding-shard-{self.shard}.json"
        tmp = note.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "version": version, "shard": self.shard}))
        os.replace(tmp, note)
        deadline = time.monotonic() + HOLD_MAX_S
        while note.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def live_build(self, tag: str, maps: dict[int, np.ndarray] | None = None, staged: int | None = None) -> dict:
        """Build `tag` from the live rows (rows at a version in `maps` through its map), copying the template
        build's trained quantiser; returns the version mix. `staged`: from the stored rows with the pending round
        of that version in place (not yet applied; fails if this shard lost it). The previous build of `tag`
        answers until this one replaces it (one assignment)."""
        live = self._live()
        t0 = time.perf_counter()
        if staged is not None:  # before the barrier: a restart after it finishes the round from this journal
            live.journal(staged)
        vectors = live.searchable(maps) if staged is None else live.staged(staged)
        index = faiss.clone_index(self.live_template.index)
        index.reset()  # keeps a trained quantiser (IVF, PQ): every shard still scores alike
        meta = replace(self.live_template.meta, build_seconds=0.0, extra={**self.live_template.meta.extra})
        built = build_from_chunks([(self.live_template.doc_ids, vectors)], index, meta)
        built.set_search_params(*self.live_params)
        self._set_build(tag, built, self._gpu_copy(built, self.live_params[0]))
        return {"mix": live.mix(), "seconds": time.perf_counter() - t0}

    def live_end(self, tags: list[str]) -> None:
        """The end of the live index: forget its builds (`tags`), its rows and the files of both."""
        for tag in tags:
            self.drop(tag)
        shutil.rmtree(self._live_folder(), ignore_errors=True)  # also after a restart, when no LiveRows is held
        self.live, self.live_encoders = None, {}

    def live_rows(self, local: list[int], maps: dict[int, np.ndarray] | None = None) -> np.ndarray:
        """Searchable vectors of local rows (probe, anchors, gold)."""
        return self._live().rows_of(local, maps)

    def live_mix(self) -> dict:
        return self._live().mix()

    def info(self) -> dict:
        """pid, node, builds held and restored at start, peak RSS: for tests, placement and benchmarks."""
        return {
            "shard": self.shard,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "tags": sorted(self.indexes),
            "on_gpu": self._gpu_tags(),  # index.device=cuda: the builds searched on the GPU
            "restored": self.restored,
            "peak_rss_mb": peak_rss_mb(),
            "versions": {t: m.get("version") for t, m in self.manifests.items()},
        }


def _link_tree(src: Path, dst: Path) -> None:
    """`src`'s files into a fresh `dst`: hard links where the file system allows, else copies; into a temporary
    folder renamed at the end, so a crash never leaves a manifest beside a half-copied index."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        try:
            os.link(f, tmp / f.name)
        except OSError:
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)


# 0 CPUs: a shard works while the driver waits on it, and a reservation would take a CPU from
# the trainer for the whole run. Its calls are retried on the restarted actor (searches and builds are idempotent).
# Threaded (max_concurrency): searches and mining go on while a live refresh encodes in another thread; a build
# is swapped in by one assignment, so a search sees the old build or the new one.
IndexShard = ray.remote(
    num_cpus=0, max_restarts=MAX_SHARD_RESTARTS, max_task_retries=MAX_SHARD_RESTARTS, max_concurrency=4
)(_Shard)


@ray.remote(num_cpus=0)
def _train_quantizer(shard_folder: str, factory: str, seed: int) -> Any:
    """The shared quantiser: `trained_empty` on the whole set's seeded sample, serialised (read where it runs)."""
    index, _ = trained_empty(VectorSet.load(shard_folder), factory, seed)
    return faiss.serialize_index(index)


# ------------------------------------------------------------------------------------------------ driver side


def _gather(
    refs: Sequence[Any], shards: Sequence[int], what: str, timeout_s: float | None, key: str = "index.shard_timeout_s"
) -> list[Any]:
    """ray.get of one call per shard, waiting at most `timeout_s` (the setting `key`) in all; a shard that does not
    answer in time, or died beyond its restarts, is a ShardUnavailableError naming it."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    out = []
    for ref, shard in zip(refs, shards):
        try:
            out.append(ray.get(ref, timeout=None if deadline is None else max(0.0, deadline - time.monotonic())))
        except GetTimeoutError:
            raise ShardUnavailableError(
                f"index shard {shard} did not answer {what} within {timeout_s:g} s "
                f"({key}): it is stopped, restarting or its node is lost"
            ) from None
        except RayActorError as e:
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ShardUnavailableError(
                f"index shard {shard} died during {what} and was not restarted (at most "
                f"{MAX_SHARD_RESTARTS} restarts): {cause}"
            ) from None
    return out


def pool_node_options(pool: PoolResources, nodes: list[dict]) -> dict[str, Any]:
    """Where a shard goes without index nodes: a 0-CPU actor would land on the driver's node (on KubeRay the head,
    meant for the driver alone), so it goes next to the pool: to a node that carries the pool's custom resources
    (soft: any node if none is alive)."""
    opts: dict[str, Any] = {}
    if pool.resources:
        fit = [
            n["NodeID"] for n in nodes if n.get("Alive") and all(n["Resources"].get(k, 0) > 0 for k in pool.resources)
        ]
        if fit:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(fit[0], soft=True)
    return opts


class ShardGroup:
    """The run's N IndexShard actors: N > 1 on a cluster with `index_node` nodes, a placement group SPREADs them over
    those nodes (one per node when there are enough); elsewhere, and one shard always, on the pool's node. FAISS and
    torch threads per shard: the CPUs of its node shared by the shards placed there. `gpu` > 0 (index.device=cuda:
    `shard_gpus`): each shard claims that fraction of a GPU and searches its index there."""

    def __init__(
        self,
        n: int,
        root: str | Path,
        pool: PoolResources,
        timeout_s: float,
        nodes: list[dict] | None = None,
        gpu: float = 0.0,
    ) -> None:
        nodes = ray.nodes() if nodes is None else nodes
        # One shard has nothing to spread: it goes next to the pool and claims no `index_node`, which the pool's
        # actors and the live refresh's reservation may claim whole (deploy/: 2 x 0.5 of a node's 1)
        found = index_nodes(nodes) if n > 1 else []
        self.n, self.root, self.timeout_s, self.pg = n, Path(root).resolve(), timeout_s, None
        self.root.mkdir(parents=True, exist_ok=True)
        if found:
            per_node = -(-n // len(found))
            cpus = min(float(x["Resources"].get("CPU", 1)) for x in found)
            bundle = {INDEX_NODE: INDEX_NODE_SHARE, **({"GPU": gpu} if gpu > 0 else {})}
            self.pg = placement_group([bundle] * n, strategy="STRICT_SPREAD" if n <= len(found) else "SPREAD")
            ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
            if not ready:
                remove_placement_group(self.pg)
                raise RuntimeError(
                    f"index.shards: {n} shards could not be placed on the {len(found)} index nodes "
                    f"within {timeout_s:g} s"
                )
            opts = [
                {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)}
                for i in range(n)
            ]
        else:
            per_node, cpus = n, float(ray.cluster_resources().get("CPU", 1))
            opts = [pool_node_options(pool, nodes)] * n
        threads = max(1, int(cpus) // per_node)
        device = "cuda" if gpu > 0 else "cpu"
        if gpu > 0:  # Ray gives each shard its GPU as device 0 (CUDA_VISIBLE_DEVICES); shards may share one
            opts = [{**o, "num_gpus": gpu} for o in opts]
        self.actors = [IndexShard.options(**o).remote(i, str(self.root), threads, device) for i, o in enumerate(opts)]
        self.versions: dict[str, int] = {}

    def gather(self, refs: Sequence[Any], what: str, timeout_s: float | None = None) -> list[Any]:
        return _gather(refs, range(len(refs)), what, timeout_s)

    def info(self) -> list[dict]:
        """Every shard's `_Shard.info` (pid, node, builds)."""
        return self.gather([a.info.remote() for a in self.actors], "an info call", self.timeout_s)

    def encode(
        self, source: Any, weights_ref: Any, retriever: RetrieverConfig, idx: IndexConfig, folder: str | Path
    ) -> VectorSet:
        """Every shard encodes its rows of `source` (a PassageStore, or an (ids, texts) pair of lists) with the
        snapshot `weights_ref` into `folder/shard-<i>/`; returns the whole set as one VectorSet (corpus order)."""
        rows = len(source) if isinstance(source, PassageStore) else len(source[0])
        folder = Path(folder).resolve()
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        start = time.perf_counter()
        refs = []
        for i, (a, b) in enumerate(shard_ranges(rows, self.n)):
            src = source if isinstance(source, PassageStore) else [ray.put((source[0][a:b], source[1][a:b]))]
            refs.append(
                self.actors[i].encode.remote(src, a, b, [weights_ref], retriever, idx, str(folder / f"shard-{i}"))
            )
        parts = self.gather(refs, "an encode")  # a long job: no time limit, but a shard that dies for good fails
        seconds = time.perf_counter() - start
        stats = {
            "shards": self.n,
            "shard_seconds": [p["seconds"] for p in parts],
            "shard_peak_rss_mb": [p["peak_rss_mb"] for p in parts],
        }
        return VectorSet(
            str(Path(folder).resolve()),
            [f"shard-{i}/{f}" for i, p in enumerate(parts) for f in p["files"]],
            sum(p["rows"] for p in parts),
            parts[0]["dim"],
            idx.vector_dtype,
            seconds,
            stats,
        ).save_meta()

    def build(
        self, tag: str, shards: VectorSet, idx: IndexConfig, fingerprint: str, encoder: str, step: int, seed: int
    ) -> ShardedIndex:
        """Build `tag` from the vector set `shards`: shard i indexes its row range, every shard copying one
        quantiser trained once on the set's seeded sample (IVF, PQ); each persists its build before answering."""
        start = time.perf_counter()
        trained = None
        if not make_index(idx.factory, shards.dim).is_trained:  # trained in a task: the driver never gets vectors
            trained = _train_quantizer.remote(shards.folder, idx.factory, seed)
        version = self.versions[tag] = self.versions.get(tag, 0) + 1
        refs = [
            a.build.remote(tag, shards.folder, lo, hi, idx, fingerprint, encoder, step, trained, version)
            for a, (lo, hi) in zip(self.actors, shard_ranges(shards.rows, self.n))
        ]
        parts = self.gather(refs, f"the build of {tag!r}")
        return self._index(tag, parts, time.perf_counter() - start, idx.precision.value)

    def load(self, tag: str, folder: str | Path) -> ShardedIndex:
        """Load a saved sharded index folder (`ShardedIndex.save`) into the shards as `tag`."""
        entries = read_sharded(Path(folder))
        if len(entries) != self.n:
            raise IndexMismatchError(f"{folder} holds {len(entries)} index shards, this group has {self.n}")
        start = time.perf_counter()
        refs = [a.load.remote(tag, str(Path(folder) / e["folder"])) for a, e in zip(self.actors, entries)]
        parts = self.gather(refs, f"the load of {tag!r}")
        meta = json.loads((Path(folder) / "index_meta.json").read_text())
        return self._index(tag, parts, time.perf_counter() - start, meta["precision"], meta)

    def _index(
        self, tag: str, parts: list[dict], seconds: float, precision: str, saved: dict | None = None
    ) -> ShardedIndex:
        doc_ids = [d for p in parts for d in p["doc_ids"]]
        offsets = list(np.cumsum([0] + [len(p["doc_ids"]) for p in parts[:-1]]).tolist())
        m0 = parts[0]["meta"]
        extra = {
            "shards": self.n,
            "layout": "sharded",
            "rows_per_shard": [len(p["doc_ids"]) for p in parts],
            "shard_peak_rss_mb": [p.get("peak_rss_mb", 0.0) for p in parts],
            "shard_versions": [p["version"] for p in parts],
        }
        meta = IndexMeta(
            factory=m0["factory"],
            dim=m0["dim"],
            metric=METRIC,
            ntotal=len(doc_ids),
            corpus_fingerprint=m0["corpus_fingerprint"],
            encoder=m0["encoder"],
            encoder_step=m0["encoder_step"],
            precision=precision,
            version=parts[0]["version"],
            build_seconds=seconds,
            extra=extra if saved is None else {**saved.get("extra", {}), **extra},
        )
        return ShardedIndex(self.actors, tag, doc_ids, meta, offsets, self.timeout_s)

    def close(self) -> None:
        """Stop the shard actors and free their placement group (the end of a run)."""
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


class ShardedIndex(_Merged):
    """`DenseIndex`'s interface to a build held by the shard actors: ids and metadata here, the vectors there.
    Picklable (actor handles): the generator's searchers scatter to the same shards."""

    def __init__(
        self, actors: list, tag: str, doc_ids: list[str], meta: IndexMeta, offsets: list[int], timeout_s: float
    ) -> None:
        self.actors, self.tag, self.doc_ids, self.meta = list(actors), tag, doc_ids, meta
        self.offsets, self.timeout_s = [int(o) for o in offsets], float(timeout_s)

    def _call(self, what: str, method: str, *args: Any, shards: Sequence[int] | None = None) -> list[Any]:
        shards = range(len(self.actors)) if shards is None else shards
        refs = [getattr(self.actors[i], method).remote(self.tag, *args) for i in shards]
        return _gather(refs, shards, what, self.timeout_s)

    def _scatter(self, queries: np.ndarray, k: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        sent = []
        for b in _batches(queries):  # every batch goes out before any answer is awaited: the shards pipeline
            ref = ray.put(b)
            sent.append([a.search.remote(self.tag, ref, k) for a in self.actors])
        shards = range(len(self.actors))
        return [_gather(refs, shards, f"a search of {self.tag!r}", self.timeout_s) for refs in sent]

    def set_search_params(self, nprobe: int = 16, ef_search: int = 128) -> None:
        """IVF nprobe / HNSW efSearch on every shard, where the index type has them."""
        self._call("a parameter change", "set_search_params", nprobe, ef_search)

    def _first_of(self, shard: int, n: int) -> np.ndarray | None:
        return self._call("a reconstruct", "reconstruct_first", n, shards=[shard])[0]

    def as_stored(self, x: np.ndarray) -> np.ndarray:
        """`x` through the index's codec (every shard copies one quantiser: shard 0 speaks for all)."""
        return self._call("a codec call", "as_stored", np.ascontiguousarray(x, dtype=np.float32), shards=[0])[0]

    def serialize(self) -> ShardedIndex:
        """A sharded index travels as its handle: searchers elsewhere scatter to the same shard actors."""
        return self

    def save(self, folder: str | Path) -> Path:
        """Each shard places its persisted build in `folder/shard-<i>/`; then index_meta.json and sharded.json."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        manifests = _gather(
            [a.save.remote(self.tag, str(folder / f"shard-{i}")) for i, a in enumerate(self.actors)],
            range(len(self.actors)),
            f"the save of {self.tag!r}",
            None,
        )
        entries = [
            {
                "shard": i,
                "folder": f"shard-{i}",
                "start": m["start"],
                "stop": m["stop"],
                "rows": m["rows"],
                "version": m["version"],
                "checksum": m["checksum"],
                "manifest": integrity.sha256_file(folder / f"shard-{i}" / MANIFEST),
            }
            for i, m in enumerate(manifests)
        ]
        (folder / "index_meta.json").write_text(json.dumps(asdict(self.meta), indent=2, sort_keys=True))
        listed = {"shards": entries, "index_meta": integrity.sha256_file(folder / "index_meta.json")}
        (folder / SHARDED).write_text(json.dumps(integrity.seal_shard_list(listed), indent=2))
        return folder

    def drop(self) -> None:
        """Free the build in every shard (the handle is unusable afterwards)."""
        self._call("a drop", "drop")


def is_sharded(folder: str | Path) -> bool:
    """Whether a saved index folder is a sharded one (`ShardedIndex.save`)."""
    return (Path(folder) / SHARDED).is_file()


def read_sharded(folder: Path) -> list[dict]:
    """The shard entries of a saved sharded index, every file a search reads checked against its checksum and the
    list against the shards (`index.integrity`): IndexMismatchError names the file that is missing, edited or
    damaged."""
    try:
        doc = json.loads((folder / SHARDED).read_text())
        entries = doc["shards"]
        meta = integrity.check_shard_list(folder, SHARDED, doc)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise IndexMismatchError(f"{folder / SHARDED}: unreadable list of index shards ({err})") from None
    manifests = []
    for e in entries:
        m = read_manifest(folder / e["folder"])
        if m["checksum"] != e["checksum"] or m["rows"] != e["rows"]:
            raise IndexMismatchError(
                f"index shard {folder / e['folder']} is not the one {SHARDED} lists (another build's files)"
            )
        integrity.check_manifest_file(folder / e["folder"] / MANIFEST, e, folder / SHARDED)
        manifests.append(m)
    integrity.check_consistency(folder, entries, manifests, meta)
    return entries


class ReadOnlyShards(_Merged):
    """A saved sharded index loaded in this process (`python -m ragtrain search`, the generator's checks): a
    `ReadOnlyIndex` (index/base.py), searched through the actors' merge over in-process shards; never saved (it is
    a saved folder) nor dropped (nothing is held elsewhere)."""

    def __init__(self, shards: list[DenseIndex], meta: IndexMeta) -> None:
        self.shards, self.meta = shards, meta
        self.doc_ids = [d for s in shards for d in s.doc_ids]
        self.offsets = list(np.cumsum([0] + [s.ntotal for s in shards[:-1]]).tolist())

    @classmethod
    def load(cls, folder: str | Path, mmap: bool = False) -> ReadOnlyShards:
        """Every shard of the saved folder, checked against its manifest and the list of shards."""
        folder = Path(folder)
        entries = read_sharded(folder)
        meta = IndexMeta(**json.loads((folder / "index_meta.json").read_text()))
        shards = [load_index(folder / e["folder"], expect_dim=meta.dim, mmap=mmap) for e in entries]
        if sum(s.ntotal for s in shards) != meta.ntotal:
            raise IndexMismatchError(
                f"{folder}: the shards hold {sum(s.ntotal for s in shards)} rows, its index_meta.json {meta.ntotal}"
            )
        return cls(shards, meta)

    def _scatter(self, queries: np.ndarray, k: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        return [[s.search(b, k) for s in self.shards] for b in _batches(queries)]

    def set_search_params(self, nprobe: int = 16, ef_search: int = 128) -> None:
        for s in self.shards:
            s.set_search_params(nprobe, ef_search)

    def _first_of(self, shard: int, n: int) -> np.ndarray | None:
        return self.shards[shard].reconstruct_first(n)

    def as_stored(self, x: np.ndarray) -> np.ndarray:
        return self.shards[0].as_stored(x)


def open_saved(folder: str | Path, expect_corpus: str | None = None, mmap: bool = False) -> ReadOnlyShards:
    """A saved index folder (`ShardedIndex.save`) in this process, read-only, every shard checked, and checked
    against the corpus."""
    if not is_sharded(folder):
        raise IndexMismatchError(
            f"{folder} holds no {SHARDED}: not an index saved by this ragtrain (an older one wrote a single "
            "index): rebuild it with the index stage"
        )
    index = ReadOnlyShards.load(folder, mmap=mmap)
    if expect_corpus is not None and index.meta.corpus_fingerprint != expect_corpus:
        raise IndexMismatchError(
            f"{Path(folder) / 'index_meta.json'}: index was built from a different corpus "
            f"(fingerprint {index.meta.corpus_fingerprint}, this corpus is {expect_corpus}): "
            "rebuild the index"
        )
    return index
