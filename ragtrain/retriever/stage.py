"""The retriever stage of a run (`stages: [retriever, ...]`): the zero-shot index, then the bi-encoder trained on
Ray Train, then its weights saved.

1. zero-shot: the index of the initial encoder when evaluation, static mining, the live index or the stale-index
   alignment needs it (`first_index_is_zeroshot`), evaluated (`zeroshot_eval`) and mined for hard negatives once
   when the live index does not provide them;
2. training (`ragtrain/retriever/train.py`): beside the live refresh on the index shards (refresh.enabled), with a
   cross-encoder teacher's scores (retriever.teacher.weight > 0: the `teach` the pipeline passes in, since the
   reranker sits above this layer), resumed from its checkpoint (resume=true);
3. the trained weights into <output_dir>/encoder (sync=vector_avg: the parameter mean, every replica beside it).

Takes the run's retrieval facade (ragtrain/pipeline/retrieval.py, a layer above) as `retrieval`, as the other stages do.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ragtrain.config import Config, ConfigError
from ragtrain.corpus.dataset import passage_qrels
from ragtrain.data import RetrievalData
from ragtrain.embed.weights import save_weights
from ragtrain.retriever.batching import TrainData, TrainExample, build_examples, steps_per_epoch
from ragtrain.retriever.validation import make_val_set
from ragtrain.runtime.console import get_logger

log = get_logger(__name__)

# (the zero-shot build, the training examples) -> (the teacher's scores by query and passage, its metrics)
Teach = Callable[[Any, list[TrainExample]], tuple[dict[int, dict[int, float]], dict[str, float]]]


def check_train_batch(cfg: Config, data: RetrievalData) -> None:
    """Retriever training needs one global batch of examples (a relevant passage per example: every chunk of a
    relevant document counts); fewer would fail inside the trainer workers after start-up: fail now, in one line."""
    if "retriever" not in cfg.stages:
        return
    global_batch = cfg.retriever.train.batch_size * cfg.resources.trainer.num_workers

    def positives(qrels: dict[str, dict[str, int]]) -> int:
        return sum(1 for judged in qrels.values() for g in judged.values() if g > 0)

    # documents are a lower bound on passages: the chunk map is expanded only when that bound is short
    if positives(data.train_qrels) >= global_batch:
        return
    try:
        steps_per_epoch(positives(passage_qrels(data.train_qrels, data.doc_of)), global_batch)
    except ValueError as e:
        raise ConfigError(f"{e} ({len(data.train_qrels)} training queries in {data.name})") from None


def first_index_is_zeroshot(cfg: Config) -> bool:
    """Whether the run's first index encodes the corpus with the initial weights (the retriever stage builds
    "zeroshot" first; without it, the index stage does)."""
    if "retriever" not in cfg.stages:
        return "index" in cfg.stages
    t = cfg.retriever.train
    return bool(cfg.zeroshot_eval or t.hard_negatives > 0 or cfg.refresh.enabled or cfg.index.align_anchors)


def parameter_mean(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of several replicas' weights (non-float entries are taken from the first)."""
    return {
        k: torch.stack([s[k] for s in states]).mean(0) if states[0][k].is_floating_point() else states[0][k]
        for k in states[0]
    }


@dataclass
class RetrieverRun:
    """What the retriever stage reads (the run's folder and MLflow run, the retrieval facade, the initial weights
    and their name) and leaves for the stages after it (the trained weights, their name and step, every replica, the
    stale index for alignment, the phases' metrics: `zeroshot`, `teacher_rerank`, `train`). The pipeline's run
    state extends it."""

    cfg: Config
    data: RetrievalData
    out: Path
    logger: Any
    retrieval: Any  # ragtrain.pipeline.retrieval.Retrieval
    weights: dict[str, torch.Tensor]
    encoder_name: str
    step: int = 0
    results: dict[str, dict[str, float]] = field(default_factory=dict)
    zeroshot: Any = None  # the zero-shot build (evaluation, mining, the live index's version 0)
    stale: Any = None  # the zero-shot vectors kept for index.align_anchors
    negatives: dict[str, list[int]] | None = None  # hard negatives mined once from the zero-shot index
    replicas: list[dict[str, torch.Tensor]] = field(default_factory=list)  # sync=vector_avg: every replica


def run_retriever_stage(
    r: RetrieverRun, teach: Teach, callbacks: list | None = None, report_intermediate: bool = False
) -> RetrieverRun:
    """Zero-shot index (when needed), training, saved weights; returns `r` with what the later stages start from.
    `teach` runs when retriever.teacher.weight > 0; a Tune trial passes `callbacks` and `report_intermediate`
    (ragtrain/pipeline/stages.py's `run`)."""
    zeroshot_phase(r)
    train_phase(r, teach, callbacks, report_intermediate)
    return r


def zeroshot_phase(r: RetrieverRun) -> None:
    """Before training: the zero-shot index when evaluation, static mining, the live index or the stale-index
    alignment needs it; hard negatives mined once from it when the live index does not provide them."""
    cfg = r.cfg
    if not first_index_is_zeroshot(cfg):
        return
    live = cfg.refresh.enabled
    needs_negatives = cfg.retriever.train.hard_negatives > 0
    if cfg.zeroshot_eval or needs_negatives or live:
        r.zeroshot, r.results["zeroshot"] = r.retrieval.build_and_evaluate("zeroshot", [r.weights], r.encoder_name, 0)
        if needs_negatives and not live:  # static negatives, mined once from the zero-shot index
            r.negatives = r.retrieval.mine_negatives(r.zeroshot)
    else:  # index.align_anchors with zeroshot_eval=false (e.g. sync_compare's later variants): the stale
        r.zeroshot = r.retrieval.build("zeroshot", [r.weights], r.encoder_name, 0)  # vectors, not evaluated
    r.stale = r.zeroshot if cfg.index.align_anchors else None


def train_phase(r: RetrieverRun, teach: Teach, callbacks: list | None, report_intermediate: bool) -> None:
    """Retriever training on Ray Train: beside the live refresh on the index shards (refresh.enabled, its CPUs
    reserved apart from the trainer's); with a cross-encoder teacher when one is configured. Saves the trained
    weights."""
    # lazy: ragtrain.retriever.train imports ray; this module imports without it
    from ragtrain.retriever.train import fit_retriever

    cfg, retrieval, t = r.cfg, r.retrieval, r.cfg.retriever.train
    service = probe = None
    if cfg.refresh.enabled:  # the index shards refresh the index while training steps
        service, probe = start_live_index(r)
    examples = build_examples(r.data.queries, retrieval.train_qrels, retrieval.positions, r.negatives)
    teacher = None
    if cfg.retriever.teacher.weight > 0:  # a cross-encoder scores the mined candidates (ragtrain/reranker)
        teacher, r.results["teacher_rerank"] = teach(r.zeroshot, examples)
    if r.zeroshot is not None:  # searched for the last time (evaluation, mining, the teacher): the shards free it
        r.zeroshot.index.drop()  # before the trained index arrives; its vectors stay in the shards (alignment)
    try:
        sink = r.logger.sink()
        if sink is not None and cfg.resume:
            sink.skip_logged = True  # steps before the interruption are already in the run
        val = make_val_set(r.data, t.val_queries, t.val_passages, cfg.seed) if t.val_every else None
        fit = fit_retriever(
            cfg, TrainData(retrieval.passages(), examples, teacher), r.weights, sink, resume=cfg.resume,
            callbacks=callbacks, report_intermediate=report_intermediate, index_service=service, probe=probe,
            val=val,
        )  # fmt: skip
    finally:
        refresh_report = retrieval.stop_service(service) if service is not None else None
    if refresh_report is not None:
        (r.out / "refresh_history.json").write_text(json.dumps(refresh_report, indent=2))
        r.logger.log_artifact(r.out / "refresh_history.json")
    save_trained(r, fit)


def start_live_index(r: RetrieverRun) -> tuple[Any, Any]:
    """The live index service: from the zero-shot index, or for a run resumed from a training checkpoint, from an
    index of the checkpoint's weights, its versions numbered on from the checkpoint's newest one (a resumed run's
    live index neither restarts from the untrained encoder nor repeats version numbers it logged)."""
    # lazy: ragtrain.retriever.train imports ray; this module imports without it
    from ragtrain.retriever.train import checkpoint_weights
    from ragtrain.train.harness import resume_or_none

    path, meta = resume_or_none(r.cfg, "retriever")
    if path is None or meta.get("final"):  # a fresh run, or the stage finished before (it is not trained again)
        return r.retrieval.start_service(r.zeroshot, r.weights)
    weights, step = checkpoint_weights(r.cfg, path), int(meta["step"])
    start = r.retrieval.build("resumed", [weights], f"{r.cfg.retriever.model}@{path.name}", step)
    first = int(meta.get("live_version", -1)) + 1
    log.info(f"[index] resume: the live index starts from the step-{step} checkpoint's weights as version {first}")
    try:
        return r.retrieval.start_service(start, weights, first_version=first, step=step)
    finally:
        start.index.drop()  # the service holds its own copy (as the zero-shot index's, dropped after training starts)


def save_trained(r: RetrieverRun, fit: Any) -> None:
    """The trained encoder into <output_dir>/encoder (vector_avg: the parameter mean, each replica beside it)."""
    r.weights, r.step, r.replicas = fit.weights, fit.steps, list(fit.replicas or [])
    (r.out / "encoder").mkdir(exist_ok=True)
    if r.replicas:
        r.weights = parameter_mean(r.replicas)
        for i, state in enumerate(r.replicas):
            save_weights(state, r.out / "encoder", name=f"replica_{i}")
    path = save_weights(r.weights, r.out / "encoder")
    r.encoder_name = f"{r.cfg.retriever.model}@{path}"
    log.info(f"[retriever] {fit.steps} steps in {fit.seconds:.1f}s; weights: {path}")
    r.results["train"] = {"seconds": fit.seconds, "steps": fit.steps, **fit.metrics}
