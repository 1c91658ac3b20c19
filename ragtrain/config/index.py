"""The `index:` group (conf/index/*.yaml): the FAISS index shards; and `refresh:`, their live refresh while the
retriever trains."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ragtrain.config.retriever import Precision
from ragtrain.runtime.errors import check as _check

RECALL_DEPTH = 100  # the deepest recall cut-off reported (ragtrain.eval.metrics.DEFAULT_KS)


INDEX_DEVICES = ("cpu", "cuda")  # where the index shards' FAISS indexes search
GPU_MAX_K = 2048  # FAISS's GPU k-selection limit: a GPU search takes k <= 2048 and IVF nprobe <= 2048


@dataclass
class IndexConfig:
    factory: str = "Flat"  # any faiss.index_factory string: Flat, IVF64,Flat, HNSW32, IVF64,PQ16, ...
    precision: Precision = Precision.auto  # bf16: embed-only encoders hold bf16 weights (~1e-4 cosine off)
    batch_size: int = 64
    shard_size: int = 512  # passages per Ray Data encode call (one parquet vector file each)
    vector_dtype: str = "float32"  # stored vector files: float32 | float16 (half the disk; FAISS adds them as fp32)
    top_k: int = 100  # depth retrieved for evaluation
    nprobe: int = 16  # IVF search parameter
    ef_search: int = 128  # HNSW search parameter
    # > 0: after training, also map the zero-shot (stale) index onto the trained encoder's space with an
    # orthogonal Procrustes map fitted on this many anchor passages (ragtrain/embed/align.py), and evaluate it
    align_anchors: int = 0
    # > 0 (sync=vector_avg): after training, distill one student encoder (initialised from the replicas'
    # parameter mean) onto the consensus vectors for this many steps, index it and evaluate it
    # (ragtrain/repair/distill.py)
    distill_steps: int = 0
    distill_lr: float = 5e-5
    distill_batch_size: int = 32
    # a folder: encoded corpora are kept there and reused when the same weights, corpus and encode settings come
    # again (a sweep's zero-shot index, repeated runs; ragtrain/index/vector_cache.py). null: always encode
    cache_dir: str | None = None
    # Index shards (ragtrain/index/sharded.py), the only index: N IndexShard actors (1 by default), each indexing
    # and searching a contiguous range of passages (with N > 1 each also encodes it); auto = one per node offering
    # `index_node`
    shards: str = "1"
    shard_timeout_s: float = 120.0  # a search waits this long for every shard (one restarting) before failing
    # cuda: each shard moves its FAISS index to its node's GPU and searches there (`pip install -e .[gpu]`: FAISS
    # with GPU support); builds, saves and the live refresh's rebuilds go through a CPU copy
    device: str = "cpu"
    gpus_per_shard: float = 0.5  # index.device=cuda: each shard actor's claim on its GPU (shards may share one)

    def __post_init__(self) -> None:
        self.shards = str(self.shards).strip()
        _check(self.device in INDEX_DEVICES, "index.device", f"must be one of {list(INDEX_DEVICES)}", self.device)
        _check(
            0 < self.gpus_per_shard <= 1,
            "index.gpus_per_shard",
            "must be a fraction of one GPU in (0, 1] (several shards share a GPU with fractions)",
            self.gpus_per_shard,
        )
        _check(
            self.shards == "auto" or (self.shards.isdigit() and int(self.shards) > 0),
            "index.shards",
            "must be a positive number of shards or auto (one per node offering the index_node resource)",
            self.shards,
        )
        # a search or a refresh call waits this long for a shard: below 1 s a busy shard counts as lost, above an
        # hour (inf, and nan, which compares false) a lost one is waited on for good
        _check(
            SHARD_TIMEOUT_RANGE[0] <= self.shard_timeout_s <= SHARD_TIMEOUT_RANGE[1],
            "index.shard_timeout_s",
            f"must be a number of seconds in [{SHARD_TIMEOUT_RANGE[0]:g}, {SHARD_TIMEOUT_RANGE[1]:g}]",
            self.shard_timeout_s,
        )
        _check(bool(self.factory.strip()), "index.factory", "must be a faiss index_factory string", self.factory)
        _check(
            self.vector_dtype in ("float32", "float16"),
            "index.vector_dtype",
            "must be float32 or float16",
            self.vector_dtype,
        )
        _check(self.align_anchors >= 0, "index.align_anchors", "must be >= 0", self.align_anchors)
        _check(self.distill_steps >= 0, "index.distill_steps", "must be >= 0", self.distill_steps)
        _check(self.distill_lr > 0, "index.distill_lr", "must be > 0", self.distill_lr)
        _check(self.distill_batch_size > 0, "index.distill_batch_size", "must be > 0", self.distill_batch_size)
        if self.cache_dir:  # resolved on the driver: sweep trials and Ray processes run in other folders
            self.cache_dir = str(Path(self.cache_dir).expanduser().resolve())
        for key in ("batch_size", "shard_size", "top_k", "nprobe", "ef_search"):
            _check(getattr(self, key) > 0, f"index.{key}", "must be > 0", getattr(self, key))
        _check(
            self.device != "cuda" or self.nprobe <= GPU_MAX_K,
            "index.nprobe",
            f"must be <= {GPU_MAX_K} with index.device=cuda (FAISS's GPU search probes at most {GPU_MAX_K} lists)",
            self.nprobe,
        )
        # Recall@100 is read off the top_k hits: a shallower search would report recall@top_k under its name.
        _check(
            self.top_k >= RECALL_DEPTH,
            "index.top_k",
            f"must be >= {RECALL_DEPTH} (recall@{RECALL_DEPTH} is reported from the top_k hits)",
            self.top_k,
        )


SHARD_TIMEOUT_RANGE = (1.0, 3600.0)  # index.shard_timeout_s, seconds
REFRESH_TIMEOUT_RANGE = (1.0, 86400.0)  # refresh.timeout_s, seconds


@dataclass
class RefreshConfig:
    """Live index refresh during retriever training (ragtrain/index/refresh_service.py): the index shards re-encode
    their rows with a recent encoder snapshot while training steps; hard negatives come from the live index."""

    enabled: bool = False
    every_steps: int = 0  # refresh every N steps (0 = only when drift_threshold is exceeded)
    drift_threshold: float = 0.0  # adaptive: refresh when index/drift_cosine exceeds this (0 = off)
    check_every: int = 5  # steps between staleness measurements (and adaptive checks) on rank 0
    # Bounded staleness: a step whose live index is this many steps older than the model waits for the round in
    # flight (0 = training never waits). It bounds how stale the mined negatives can get, whatever the box's speed
    max_lag_steps: int = 0
    probe_passages: int = 128  # staleness probe: passages (gold passages of the probe queries + seeded others)
    probe_queries: int = 32  # staleness probe: training queries whose recall@10 is compared stale vs fresh
    # Each index shard refreshes its own rows: when its new rows become searchable (a policy of
    # ragtrain/index/consistency/: global, eager, aligned), and which share of its rows a round re-encodes, chosen
    # by a priority of ragtrain/index/priority/ (oldest, drift, hot). Both names are checked against those
    # registries before any work (ragtrain/index/sharded.py: check_refresh)
    consistency: str = "global"
    fraction: float = 1.0
    priority: str = "oldest"
    anchors: int = 1024  # aligned: passages every encoder version encodes (at least the encoder's dimension)
    # How long a round waits for a shard's encode or build: past it the round is abandoned (one log line naming the
    # shard), the live version stays and training goes on. Long enough for a full re-encode of a large shard
    timeout_s: float = 1800.0
    # Single-query searches timed after each round (index/search_ms_p50, _p95: a scatter to every shard and the
    # merge, from the refresh service's node); 0 = none
    search_probe: int = 0

    def __post_init__(self) -> None:
        k = "refresh."
        _check(self.every_steps >= 0, k + "every_steps", "must be >= 0", self.every_steps)
        _check(self.drift_threshold >= 0, k + "drift_threshold", "must be >= 0", self.drift_threshold)
        _check(
            not self.enabled or self.every_steps > 0 or self.drift_threshold > 0,
            k + "enabled",
            "needs a schedule: set refresh.every_steps > 0 or refresh.drift_threshold > 0",
            self.enabled,
        )
        _check(self.check_every > 0, k + "check_every", "must be > 0", self.check_every)
        _check(self.max_lag_steps >= 0, k + "max_lag_steps", "must be >= 0 (0 = never wait)", self.max_lag_steps)
        _check(self.probe_queries > 0, k + "probe_queries", "must be > 0", self.probe_queries)
        _check(self.probe_passages > 1, k + "probe_passages", "must be > 1", self.probe_passages)
        _check(0.0 < self.fraction <= 1.0, k + "fraction", "must be in (0, 1]", self.fraction)
        _check(self.anchors > 0, k + "anchors", "must be > 0", self.anchors)
        _check(self.search_probe >= 0, k + "search_probe", "must be >= 0 (0 = none)", self.search_probe)
        # below a second a working shard counts as stopped; above a day (inf, and nan, which compares false) a
        # stopped one holds the refresh for good
        _check(
            REFRESH_TIMEOUT_RANGE[0] <= self.timeout_s <= REFRESH_TIMEOUT_RANGE[1],
            k + "timeout_s",
            f"must be a number of seconds in [{REFRESH_TIMEOUT_RANGE[0]:g}, {REFRESH_TIMEOUT_RANGE[1]:g}]",
            self.timeout_s,
        )
