"""The generator stage: index + encoder checks -> retrieval service -> fit_generator -> EM/F1 in three modes.

Entry point for the pipeline: `run_generator_stage(cfg, data, retrieval, built, out_dir, logger)`. Call
`preflight(cfg, data)` right after loading the data so bad input fails before any (retriever) training.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from tabulate import tabulate

from ragtrain.cluster.resources import check_config
from ragtrain.config import Config
from ragtrain.config.generator import GENERATOR_ARCHS, GenPrecision
from ragtrain.config.resources import TrainerResources
from ragtrain.data import RetrievalData
from ragtrain.embed.model import missing_folder
from ragtrain.eval.likelihood import LIKELIHOOD_METRICS
from ragtrain.eval.per_question import PER_QUESTION_FILE, write_per_question
from ragtrain.generator.archs.base import build_arch, resolve_path
from ragtrain.generator.model import load_tokenizer
from ragtrain.generator.prompt import ChatTemplateError, PromptPassages, PromptTooLongError
from ragtrain.generator.retriever_client import IndexPayload, RetrievalClient, check_encoder, load_snapshots
from ragtrain.generator.steps import GenData, GenExample, prompt_builder
from ragtrain.generator.train import fit_generator
from ragtrain.index.base import ReadOnlyIndex
from ragtrain.index.faiss_index import IndexMismatchError
from ragtrain.index.sharded import ShardGroup, open_saved, read_sharded, shard_gpu_claim, shard_gpus
from ragtrain.runtime.console import get_logger
from ragtrain.runtime.errors import ConfigError

log = get_logger(__name__)

PHASES = {"closed_book": "gen_closed_book", "rag": "gen_rag", "oracle": "gen_oracle"}
# generator.eval.before: the same modes scored before fine-tuning
PHASES.update({f"before_{mode}": f"gen_before_{mode}" for mode in list(PHASES)})


def build_gen_data(cfg: Config, data: RetrievalData) -> GenData:
    """Questions with short answers and gold passages (train and the evaluated split), and passage texts."""
    if not data.answers:
        raise ConfigError(
            f"the generator stage needs short answers per question, and dataset {data.name!r} has "
            "none (the synthetic KB has them; BEIR retrieval sets do not): drop 'generator' from stages"
        )

    def examples(qrels: dict[str, dict[str, int]]) -> list[GenExample]:
        out = []
        for qid in sorted(qrels):
            if qid in data.answers:
                gold = [d for d, grade in qrels[qid].items() if grade > 0 and d in data.corpus]
                out.append(GenExample(qid, data.queries[qid], list(data.answers[qid]), gold))
        return out

    train, evaluation = examples(data.train_qrels), examples(data.eval_qrels)
    if not train or not evaluation:
        raise ConfigError(
            f"the generator stage found {len(train)} training and {len(evaluation)} {data.split} "
            "questions with answers: it needs both"
        )
    g = cfg.generator
    every = evaluation
    if 0 < g.eval.max_questions < len(evaluation):  # drawn with data.seed: the same questions for every training seed
        evaluation = sorted(random.Random(cfg.data.seed).sample(evaluation, g.eval.max_questions), key=lambda e: e.qid)
    return GenData(
        train, evaluation, PromptPassages(data.corpus, g.include_title), likelihood_questions(cfg, every, evaluation)
    )


def likelihood_questions(cfg: Config, every: list[GenExample], em: list[GenExample]) -> list[GenExample]:
    """The answer likelihood's questions: every question of the split, or EM / F1's sample and others drawn with
    data.seed up to generator.eval.likelihood_questions (the same for every training seed; none with
    generator.eval.likelihood_top_k=0)."""
    e = cfg.generator.eval
    if not e.likelihood_top_k:
        return []
    if not 0 < e.likelihood_questions < len(every):
        return every
    chosen = {x.qid for x in em}
    rest = [x for x in every if x.qid not in chosen]
    more = random.Random(cfg.data.seed).sample(rest, max(0, e.likelihood_questions - len(em)))
    return sorted(em + more, key=lambda x: x.qid)


def preflight(cfg: Config, data: RetrievalData, out_dir: Path | None = None) -> None:
    """Fail fast (before any training) on inputs the generator stage cannot use."""
    g = cfg.generator
    if GenPrecision(g.train.precision) == GenPrecision.fp16 and not cfg.resources.trainer.use_gpu:
        raise ConfigError(
            "generator.train.precision=fp16 needs a GPU (resources.trainer.use_gpu=true); use bf16 or fp32 on CPU"
        )
    if GenPrecision(g.train.precision) == GenPrecision.fp16 and "joint" in cfg.stages:
        # fp16 needs loss scaling, which the generator stage has (GradScaler) and the joint step does not
        raise ConfigError(
            "generator.train.precision=fp16 is not supported by the joint stage (its step has no loss scaling): "
            "use bf16 (a GPU since Ampere) or fp32"
        )
    check_top_k(cfg, len(data.corpus))
    if "generator" in cfg.stages:  # its worker count may differ from resources.trainer's: checked the same way
        generator_trainer(cfg)
    gen = build_gen_data(cfg, data)
    tokenizer = check_model(cfg)
    check_prompts(cfg, gen, tokenizer)
    if "index" not in cfg.stages:  # no index will be built by this run: the configured one must exist and fit
        try:
            resolve_index(cfg, data, None, out_dir or Path(cfg.output_dir), check_only=True)
        except FileNotFoundError as e:  # a user's missing folder, not a bug: a config error (exit 2 on the CLI)
            raise ConfigError(f"generator.retrieval.index_dir: {e}") from None


def check_top_k(cfg: Config, passages: int) -> None:
    """The passages a prompt or a joint step asks for exist: a top_k past the index would crash a joint step in a
    worker, or be cut silently for a prompt (and the run would report the top_k it asked for)."""
    asked = [("generator.retrieval.top_k", cfg.generator.retrieval.top_k)]
    asked.append(("generator.eval.likelihood_top_k", cfg.generator.eval.likelihood_top_k))
    if "joint" in cfg.stages:
        asked.append(("joint.top_k", cfg.joint.top_k))
    for key, k in asked:
        if k > passages:
            raise ConfigError(f"{key}={k} is more than the {passages} passages of the index: set it to <= {passages}")


def check_model(cfg: Config) -> Any:
    """The generator's tokenizer and model config load offline and fit the configured architecture and lengths (a
    typo or a mismatch fails now, not after retriever training); returns the tokenizer."""
    from transformers import AutoConfig  # lazy: transformers is heavy (~1 s); this module imports without it

    g = cfg.generator
    for key, name in (("generator.model", g.model), ("generator.tokenizer", g.tokenizer)):
        if name and missing_folder(resolve_path(name)):  # a path, not a hub id: say so, not the hub's id rules
            raise ConfigError(
                f"{key}={name!r}: no such folder; give a local folder with config.json and tokenizer files, a "
                f"packaged model (smollm2) or a name in the local Hugging Face cache"
            )
    try:
        tokenizer = load_tokenizer(g)
        hf = AutoConfig.from_pretrained(resolve_path(g.model))
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"generator.model={g.model!r} (tokenizer {g.tokenizer or g.model!r}) cannot be loaded "
            f"offline: give a local path or a name in the local HF cache ({str(e).splitlines()[0]})"
        ) from None
    if g.model == "tiny":  # the config allows it only where the architecture builds one
        return tokenizer  # built from generator.tiny: T5 (relative positions) or GPT-2 with enough positions
    arch = build_arch(g.arch)
    kind = arch.mismatch(g, hf)
    if kind is not None:
        raise ConfigError(
            f"generator.arch={g.arch} needs {kind}, and generator.model={g.model!r} is a "
            f"{hf.model_type!r} model: set generator.arch to the model's kind (choices: {list(GENERATOR_ARCHS)})"
        )
    # Learned position tables end somewhere: a longer input fails inside a worker, after the retriever trained
    limit = getattr(hf, "n_positions", None) or getattr(hf, "max_position_embeddings", None)
    need, what = arch.positions(g)
    if hf.model_type != "t5" and isinstance(limit, int) and need > limit:  # T5's positions are relative: no limit
        raise ConfigError(f"{what} = {need} is more than generator.model={g.model!r} has positions for ({limit})")
    return tokenizer


def check_prompts(cfg: Config, gen: Any, tokenizer: Any) -> None:
    """Every training and evaluated question fits the prompt budget with the template (questions are never cut)."""
    try:
        builder = prompt_builder(cfg.generator, tokenizer)
    except ChatTemplateError as e:
        raise ConfigError(f"generator.prompt=chat: generator.model={cfg.generator.model!r}: {e}") from None
    for ex in list(gen.train) + list(gen.eval):
        try:
            builder.source(ex.question)
        except PromptTooLongError as e:
            raise ConfigError(f"question {ex.qid!r}: {e}") from None


def resolve_index(cfg: Config, data: RetrievalData, built: Any, out_dir: Path, check_only: bool = False):
    """The index to retrieve from and the encoder snapshot(s) that built it, checked against each other.

    `built` given (this run's `BuiltIndex`): its index and snapshots. Otherwise the index is loaded from
    generator.retrieval.index_dir (default <out_dir>/index) and its metadata names the encoder. The driver checks a
    saved index memory-mapped and loads it for searching into index shards, so it never holds the vectors.
    Returns an IndexPayload (None with check_only); raises FileNotFoundError / IndexMismatchError with the reason.
    """
    folder = None
    if built is None:
        folder = Path(cfg.generator.retrieval.index_dir or out_dir / "index")
        if not (folder / "index_meta.json").exists():
            stage = "joint" if "joint" in cfg.stages else "generator"
            raise FileNotFoundError(
                f"the {stage} stage needs a retrieval index and there is none at {folder}: run the 'index' stage "
                f"before '{stage}' (e.g. stages: [index, {stage}]) or set generator.retrieval.index_dir to a saved "
                "index"
            )
        # one index, or sharded; searched only (the index shards that load it below too)
        index: ReadOnlyIndex = open_saved(folder, expect_corpus=data.fingerprint(), mmap=True)
        weights = load_snapshots(cfg.retriever, cfg.seed, index.meta.encoder)
    else:
        index, weights = built.index, built.snapshots
        if index.meta.corpus_fingerprint != data.fingerprint():
            raise IndexMismatchError("the index was built from a different corpus than the loaded data")
    # Dims always; then re-encode a few passages: a wrong encoder fails here, not as a silently poor RAG score.
    n = cfg.generator.retrieval.encoder_check
    check_encoder(
        cfg.retriever, weights, cfg.index.precision, [data.corpus[d].full_text() for d in index.doc_ids[:n]], index, n
    )
    if check_only:
        return None
    if folder is not None:  # the searchers scatter to index shards that hold the saved folder
        n = len(read_sharded(folder))
        group = ShardGroup(
            n, out_dir / "shards", cfg.resources.pool, cfg.index.shard_timeout_s, gpu=shard_gpus(cfg.index)
        )
        index = group.load("generator", folder)
    index.set_search_params(cfg.index.nprobe, cfg.index.ef_search)
    return IndexPayload.from_index(index, cfg.retriever, weights, cfg.index.precision)


def generator_trainer(cfg: Config) -> TrainerResources:
    """The generator's worker group: generator.train.num_workers / cpus_per_worker over resources.trainer, checked
    as resources.trainer is (e.g. 2 ranks on a fraction of one GPU each: NCCL refuses two ranks on one device)."""
    r, t = cfg.resources.trainer, cfg.generator.train
    return replace(
        r, num_workers=t.num_workers or r.num_workers, cpus_per_worker=t.cpus_per_worker or r.cpus_per_worker
    )


def check_resources(cfg: Config) -> None:
    """The generator's worker group fits the cluster: an infeasible request fails in seconds instead of pending
    forever."""
    check_config(replace(cfg.resources, trainer=generator_trainer(cfg)), shard_gpus=shard_gpu_claim(cfg.index))


def likelihood_results(m: dict[str, float], prefix: str = "gen_") -> dict[str, dict[str, float]]:
    """The answer likelihood's phases of a stage's summary (`likelihood/rag_nll`, ...; generator.eval.before:
    `before_likelihood/...`): {"<prefix>likelihood": {rag_nll, rag_nll_top1, oracle_nll, n, top_k, seconds}}."""
    keys = (*LIKELIHOOD_METRICS, "n", "top_k", "seconds")
    return {
        f"{prefix}{mode}": {k: m[f"{mode}/{k}"] for k in keys if f"{mode}/{k}" in m}
        for mode in ("likelihood", "before_likelihood")
        if f"{mode}/n" in m
    }


def likelihood_line(results: dict[str, dict[str, float]], prefix: str = "gen_") -> str:
    """The answer likelihood in one line (nats per answer; "" when it was not computed)."""
    r = results.get(f"{prefix}likelihood")
    if not r:
        return ""
    figures = ", ".join(f"{k} {r[k]:.4f}" for k in LIKELIHOOD_METRICS if k in r)
    return f"answer likelihood on {int(r['n'])} questions, top {int(r['top_k'])} (nats): {figures}"


def summary_table(results: dict[str, dict[str, float]], prefix: str = "gen_") -> str:
    """EM / F1 per mode side by side (`prefix` "joint_": the joint stage's generator)."""
    modes = [m for m in (p.replace("gen_", prefix, 1) for p in PHASES.values()) if m in results]
    rows = [[k] + [results[m].get(k) for m in modes] for k in ("em", "f1", "gold_in_top_k")]
    headers = ["metric"] + [m.removeprefix(prefix).replace("before_", "untrained ") for m in modes]
    return tabulate(rows, headers=headers, floatfmt=".4f", missingval="")


def run_generator_stage(
    cfg: Config, data: RetrievalData, retrieval: Any, built: Any, out_dir: Path, logger: Any
) -> dict[str, dict[str, float]]:
    """Train + evaluate the generator; returns {"gen_closed_book": {em, f1, n}, "gen_rag": ..., "gen_oracle":
    ..., "gen_likelihood": {rag_nll, rag_nll_top1, oracle_nll, n, top_k, seconds}, "gen_train": {steps, seconds,
    wall_seconds, samples_per_s, tokens_per_s, final_loss, ...}}; writes <out_dir>/generator/ (the model as a
    Hugging Face folder: save_pretrained + tokenizer; predictions.json, per_question.jsonl, loss_history.json,
    metrics.json)."""
    g = cfg.generator
    out_dir = Path(out_dir)
    gen_data = build_gen_data(cfg, data)  # fails fast on missing answers
    payload = resolve_index(cfg, data, built, out_dir)
    check_resources(cfg)
    if retrieval is not None:
        retrieval.release()  # the live refresh's reserved CPUs (if still held) go to the trainer
    client = RetrievalClient(ray.put(payload))
    fit = fit_generator(cfg, gen_data, client, logger.sink() if logger else None, out_dir / "generator")
    m = fit.metrics
    results: dict[str, dict[str, float]] = {}
    for mode, phase in PHASES.items():
        if f"{mode}/em" in m:
            results[phase] = {
                k: m[f"{mode}/{k}"] for k in ("em", "f1", "n", "seconds", "gold_in_top_k") if f"{mode}/{k}" in m
            }
    results.update(likelihood_results(m))  # gen_likelihood: on its own, larger question set
    # seconds = the training loop (rank 0, without eval and checkpoint writes); wall_seconds = the whole fit
    results["gen_train"] = {
        "steps": fit.steps,
        "wall_seconds": fit.seconds,
        **{k.removeprefix("train/"): v for k, v in m.items() if k.startswith("train/")},
    }
    (out_dir / "generator" / "metrics.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    write_per_question(out_dir / "generator", fit.predictions)  # each question's EM, F1 and NLL: runs pair on them
    if logger is not None:
        # the run summary as run/gen_train/* (like the pipeline's run/train/*); per-window curves are gen_train/*
        sink = logger.sink()
        if sink is not None:
            sink.skip_logged = cfg.resume  # a resumed run may hold these already (the stage had finished)
            sink.log(
                {f"{'run/' if p == 'gen_train' else ''}{p}/{k}": v for p, r in results.items() for k, v in r.items()},
                step=fit.steps,
            )
        logger.log_artifact(out_dir / "generator" / "metrics.json", "generator")
        logger.log_artifact(out_dir / "generator" / "predictions.json", "generator")
        logger.log_artifact(out_dir / "generator" / PER_QUESTION_FILE, "generator")
    log.info(
        f"\n== generator: {g.arch} {g.model}, {fit.steps} steps, {len(gen_data.eval)} {data.split} "
        f"questions, top_k={g.retrieval.top_k} =="
    )
    log.info(summary_table(results))
    if likelihood_line(results):
        log.info(likelihood_line(results))
    return results
