"""Ray Tune sweeps: one trial = one pipeline run, fitted by a TorchTrainer inside the trial's driver function.

`python -m ragtrain experiment=NAME tune=NAME` lands in `run_sweep`. Everything that can be wrong with the sweep
(an unknown key or out-of-range value in `tune.space`, an unknown scheduler/searcher, a trial bigger than the
cluster) fails before the first trial starts. MLflow: one parent run per sweep, one child run per trial (the
pipeline's own run, with the trial's full config as params and its training curves); the best trial's config is
written as a ready-to-run experiment; the comparison report (ragtrain.commands.compare) closes the sweep.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from omegaconf import OmegaConf
from ray import tune
from ray.tune import Callback
from ray.tune.integration.ray_train import TuneReportCallback

from ragtrain.cluster.resources import (
    SWEEP_WORKER_START_TIMEOUT_S,
    InfeasibleResourcesError,
    check_config,
    init_ray,
    node_capacities,
    remove_recorded_placement_groups,
    trains_with_live_refresh,
)
from ragtrain.config import Config, absolute_paths, changed_keys, to_flat_dict
from ragtrain.config.tune import TUNE_SCHEDULERS
from ragtrain.index.sharded import shard_gpu_claim
from ragtrain.runtime.console import get_logger
from ragtrain.runtime.errors import ConfigError
from ragtrain.track.mlflow import RunLogger, absolute_tracking_uri, check_tracking_uri, tracking_uri, update_run
from ragtrain.tune import space as sp
from ragtrain.tune.guard import MetricGuard, recorded_error
from ragtrain.tune.results import close_orphans, finish
from ragtrain.tune.schedulers.base import build_scheduler
from ragtrain.tune.searchers.base import build_searcher
from ragtrain.tune.trial import (  # noqa: F401  (re-exported: the sweep's public names stay importable from here)
    DONE_KEY,
    NAME,
    ROLE_TAG,
    STOPPED_TAG,
    SYNC_TAG,
    TRIAL_TAG,
    SweepPlan,
    SweepResult,
    TrialContext,
    normalize_metric,
    trial_config,
)

log = get_logger(__name__)

# Reported at every log window while training (what ASHA can act on); everything else (trained/..., run/...,
# any later pipeline phase) is reported once, when the trial's pipeline ends.
WINDOW_PREFIXES = ("train/", "comm/", "drift/", "sync/", "val/")


def plan_sweep(cfg: Config, conf_dir: str | Path) -> SweepPlan:
    """Validate the sweep without starting anything: keys, values, metrics, scheduler/searcher combination."""
    t = cfg.tune
    if t is None:
        raise ConfigError("tune is not set: choose a sweep with tune=NAME (conf/tune)")
    if cfg.compare.strategies or getattr(cfg.compare, "variants", None):
        raise ConfigError(
            "tune and compare.strategies / compare.variants are exclusive: sweep the sync option with "
            "tune.space.sync instead"
        )
    metric = normalize_metric(t.metric)
    if "/" not in metric or metric.startswith(WINDOW_PREFIXES):
        raise ConfigError(
            f"tune.metric must be a final pipeline metric <phase>/<name> (e.g. trained/ndcg@10, "
            f"run/train/samples_per_s), not a training-window one {list(WINDOW_PREFIXES)}, got {t.metric!r}"
        )
    stops_early = TUNE_SCHEDULERS[t.scheduler].stops_early
    if stops_early and not normalize_metric(t.asha_metric).startswith(WINDOW_PREFIXES):
        raise ConfigError(
            f"tune.asha_metric must be reported at every log window (starting with "
            f"{list(WINDOW_PREFIXES)}, e.g. train/loss), got {t.asha_metric!r}"
        )
    tr = cfg.retriever.train
    if normalize_metric(t.asha_metric).startswith("val/") and tr.val_every != tr.log_every:
        raise ConfigError(
            f"tune.asha_metric={t.asha_metric!r} is reported only when validation runs: set "
            f"retriever.train.val_every={tr.log_every} (= retriever.train.log_every), got {tr.val_every}"
        )
    if stops_early and "retriever" not in cfg.stages:
        raise ConfigError(
            f"tune.scheduler={t.scheduler} needs the retriever stage (it stops trials on their training curves)"
        )
    params = sp.parse_space(t.space)
    base = sp.as_dict(OmegaConf.structured(cfg))
    base.update(tune=None, resume=False)
    opts = sp.sync_options(conf_dir)
    sp.validate(params, base, opts, t.searcher)
    uri = absolute_tracking_uri(tracking_uri(cfg.logger)) if cfg.logger.backend.value == "mlflow" else ""
    if uri:  # a store that cannot work fails now, in one line, not in every trial
        check_tracking_uri(uri)
    return SweepPlan(cfg, params, base, opts, Path(cfg.output_dir).resolve(), uri)


def trial_need(cfg: Config) -> dict[str, float]:
    """Peak resources of one trial: trainer and pool take turns, unless live index refresh runs both at once; index
    shards on GPUs (index.device=cuda) hold theirs for the whole trial, beside both."""
    t, p = cfg.resources.trainer, cfg.resources.pool
    trainer = {"CPU": t.num_workers * t.cpus_per_worker, **{k: v * t.num_workers for k, v in t.resources.items()}}
    if t.use_gpu:
        trainer["GPU"] = t.num_workers * t.gpus_per_worker
    pool = {"CPU": p.num_actors * p.cpus_per_actor, **{k: v * p.num_actors for k, v in p.resources.items()}}
    if p.gpus_per_actor:
        pool["GPU"] = p.num_actors * p.gpus_per_actor
    both = set(trainer) | set(pool)
    if trains_with_live_refresh(cfg.stages, cfg.refresh.enabled):
        need = {k: trainer.get(k, 0.0) + pool.get(k, 0.0) for k in both}
    else:
        need = {k: max(trainer.get(k, 0.0), pool.get(k, 0.0)) for k in both}
    shards, each = shard_gpu_claim(cfg.index)
    if shards * each:
        need["GPU"] = need.get("GPU", 0.0) + shards * each
    return need


TOKEN_MEMORY = 1 << 20  # bytes: Tune refuses an all-zero request, so a CPU-free trial driver asks for 1 MiB


def trial_request(cpus: float) -> dict[str, float]:
    """The trial driver's own Tune request: `cpus` (default 0, so trials' trainers and pools pack exactly)."""
    return {"CPU": cpus} if cpus > 0 else {"CPU": 0, "memory": TOKEN_MEMORY}


def max_concurrency(need: dict[str, float], total: dict[str, float]) -> int:
    """How many trials fit the cluster at once (at least 1: feasibility is checked separately)."""
    fits = [math.floor(total.get(k, 0.0) / v + 1e-9) for k, v in need.items() if v > 0]
    return max(1, min(fits)) if fits else 1


def check_resources(plan: SweepPlan) -> int:
    """Fail now if the biggest trial can never run here; return the number of trials to run at once."""
    t = plan.tune
    worst = sp.worst_case(plan.params, plan.base, plan.sync_options)
    nodes = node_capacities()
    try:
        check_config(
            worst.resources,
            together=trains_with_live_refresh(worst.stages, worst.refresh.enabled),
            nodes=nodes,
            shard_gpus=shard_gpu_claim(worst.index),
        )
        if t.trial_cpus > max(n.get("CPU", 0.0) for n in nodes):
            raise InfeasibleResourcesError(f"tune.trial_cpus={t.trial_cpus} is more than any node has")
    except InfeasibleResourcesError as e:
        swept = [p.key for p in plan.params if p.key.startswith("resources.")]
        which = f"the largest trial ({', '.join(swept)} at their maximum)" if swept else "every trial"
        raise InfeasibleResourcesError(f"tune: {which} needs more than the cluster has: {e}") from None
    need = trial_need(worst)
    need["CPU"] = need.get("CPU", 0.0) + t.trial_cpus
    fits = max_concurrency(need, ray.cluster_resources())
    if t.max_concurrent_trials is None:
        return fits
    if t.max_concurrent_trials > fits:
        log.warning(
            f"tune.max_concurrent_trials={t.max_concurrent_trials} but only {fits} trial(s) of {need} fit "
            "the cluster now: the others wait for resources (fine when an autoscaler adds nodes)"
        )
    return t.max_concurrent_trials


class LogWindowReport(TuneReportCallback):
    """Forward every log window's metrics to Tune (what ASHA sees); the trial reports the final metrics itself."""

    def after_report(self, run_context, metrics, checkpoint) -> None:
        m = dict(metrics[0])
        if "train/loss" not in m:  # the run summary with the checkpoint: known again, with more, when the trial ends
            return
        loss = m["train/loss"]
        if not math.isfinite(loss):  # NaN compares False with everything: ASHA would never stop a diverged trial
            m["train/loss"] = math.inf
        super().after_report(run_context, [m], None)


def final_metrics(results: dict[str, dict[str, float]]) -> dict[str, float]:
    """The pipeline's results as one flat Tune result (`trained/ndcg@10`, `run/comm/bytes_per_step`, ...)."""
    out: dict[str, float] = {"step": int(results.get("train", {}).get("steps", 0)), DONE_KEY: 1}
    for phase, m in results.items():
        prefix = "run/" if phase == "train" else f"{phase}/"
        out.update({prefix + k: float(v) for k, v in m.items()})
    return out


def run_trial(config: dict[str, Any], ctx: TrialContext) -> None:
    """Tune trial (driver function): build the trial's config, run the pipeline, report its final metrics."""
    from ragtrain.pipeline.stages import (
        run,  # lazy: ragtrain.pipeline.stages imports torch; this module imports without it
    )

    trial_id = tune.get_context().get_trial_id()
    cfg = trial_config(ctx, {k: config[k] for k in ctx.keys}, trial_id)
    shutil.rmtree(cfg.output_dir, ignore_errors=True)  # a trial restarted after an interruption starts clean
    results = run(cfg, train_callbacks=[LogWindowReport()], report_intermediate=True, parent_run_id=ctx.parent_run_id)
    tune.report(final_metrics(results))


class PlacementGroupReaper(Callback):
    """Removes the placement groups a trial recorded once it ends (ASHA stop, error or completion).

    They belong to the sweep's job, so they outlive a stopped trial and would keep its CPUs from the next one.
    Ended trials are swept again whenever a trial starts: a trial's Train controller can outlive the trial actor by
    a moment and reserve once more."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.ended: list[str] = []

    def _reap(self) -> None:
        for trial_id in self.ended:
            n = remove_recorded_placement_groups(Path(self.out_dir, "trials", trial_id))
            if n:
                log.info(f"[tune] removed {n} placement group(s) left by trial {trial_id}")

    def on_trial_start(self, iteration: int, trials: list, trial, **info) -> None:
        self._reap()

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        self.ended.append(trial.trial_id)
        self._reap()

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        self.on_trial_complete(iteration, trials, trial)


def trial_dirname(trial) -> str:
    """Tune's folder for a trial: its id (stable across resume)."""
    return trial.trial_id


def _state_file(plan: SweepPlan) -> Path:
    return plan.out_dir / "tune" / "sweep_state.json"


def _start(plan: SweepPlan) -> str | None:
    """Check the output folder against `resume` and open (or re-open) the parent MLflow run."""
    cfg, state = plan.cfg, _state_file(plan)
    exists = tune.Tuner.can_restore(str(plan.experiment_path))
    flat = {k: v for k, v in to_flat_dict(cfg).items() if k not in ("resume", "resume_allow_changes", "output_dir")}
    if cfg.resume:
        if not exists or not state.exists():
            raise ConfigError(
                f"resume=true but {plan.out_dir} holds no sweep to resume: pass output_dir=<the "
                "interrupted sweep's output_dir>"
            )
        saved = json.loads(state.read_text())
        changed = changed_keys(
            absolute_paths(saved["config"]), flat, cfg.resume_allow_changes
        )  # keys or groups the user accepts
        if changed:
            raise ConfigError(f"resume=true with a different config than the interrupted sweep: {changed[:10]}")
        parent = saved["parent_run_id"]
        if parent:
            RunLogger(replace(cfg.logger, tracking_uri=plan.tracking_uri or None), "", run_id=parent)  # RUNNING again
        return parent
    if exists:
        raise ConfigError(
            f"output_dir {plan.out_dir} already holds a sweep: continue it with resume=true, or choose "
            "another output_dir"
        )
    parent = None
    logger = RunLogger(
        replace(cfg.logger, tracking_uri=plan.tracking_uri or None),
        f"{cfg.experiment_name}/sweep",
        tags={ROLE_TAG: "sweep"},
    )
    if logger.enabled:
        parent = logger.run_id
        logger.log_params(to_flat_dict(cfg))
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"parent_run_id": parent, "config": flat}, indent=2))
    return parent


def run_sweep(cfg: Config, conf_dir: str | Path, *, callbacks: list | None = None) -> SweepResult:
    """Run (or with resume=true continue) the sweep `cfg.tune` over `cfg`; returns the trials and the best one.

    `callbacks`: extra Tune callbacks for a new sweep (a resumed sweep keeps the ones it was started with).
    """
    # lazy: ragtrain.pipeline.stages imports torch; this module imports without it
    from ragtrain.pipeline.stages import prepare_output_dir

    plan = plan_sweep(cfg, conf_dir)  # ConfigError before anything starts
    prepare_output_dir(str(plan.out_dir))
    init_ray(cfg.resources, worker_start_timeout_s=SWEEP_WORKER_START_TIMEOUT_S)  # trials' trainers may queue
    concurrency = check_resources(plan)
    parent = _start(plan)
    t = plan.tune
    ctx = plan.context(parent)
    trainable = tune.with_resources(tune.with_parameters(run_trial, ctx=ctx), trial_request(t.trial_cpus))
    # Trials lack the sweep metric until they end and ASHA's metric in their last report: Tune's strict check
    # (every result must carry every metric) does not fit a pipeline whose best figure comes last.
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    # ... so a misspelled metric is caught here instead, at the first result that lacks it. A resumed sweep runs the
    # copy of the stopper it was started with, which reports through the same file.
    record = plan.out_dir / "tune" / "metric_guard_error.txt"
    record.unlink(missing_ok=True)
    guard = MetricGuard(
        normalize_metric(t.metric),
        normalize_metric(t.asha_metric) if TUNE_SCHEDULERS[t.scheduler].stops_early else None,
        DONE_KEY,
        record=str(record),
    )
    if cfg.resume:
        close_orphans(plan.tracking_uri, parent)  # runs of trials cut off by the interruption: they start again
        # Errored trials start again from scratch too (their folder is cleared): an error that was the machine's
        # (a lost worker, a broken environment) should not leave a hole in the grid; a real bug errors again.
        tuner = tune.Tuner.restore(
            str(plan.experiment_path), trainable=trainable, resume_unfinished=True, restart_errored=True
        )
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=sp.to_tune(plan.params),
            tune_config=tune.TuneConfig(
                search_alg=build_searcher(t, concurrency),
                scheduler=build_scheduler(t),
                num_samples=t.num_samples,
                trial_dirname_creator=trial_dirname,
            ),
            run_config=tune.RunConfig(
                name=NAME,
                storage_path=str(plan.experiment_path.parent),
                callbacks=[PlacementGroupReaper(str(plan.out_dir)), *(callbacks or [])],
                failure_config=tune.FailureConfig(max_failures=0),
                stop=guard,
            ),
        )
    log.info(
        f"[tune] {len(plan.params)} swept key(s), up to {concurrency} trial(s) at once; "
        f"parent run {parent}; Tune state: {plan.experiment_path}"
    )
    status = "FAILED"
    try:
        tuner.fit()
        error = guard.error or recorded_error(record)
        if error:  # a misspelled metric: stopped at the first result that showed it
            raise ConfigError(error)
        result = finish(plan, parent)
        status = "KILLED" if result.interrupted else "FINISHED"
        return result
    finally:
        if parent:
            update_run(plan.tracking_uri, parent, status=status)
