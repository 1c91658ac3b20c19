"""After a sweep: trial table, MLflow child-run bookkeeping, the best trial's config, and the comparison report."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import OmegaConf

from ragtrain.commands.compare import compare_runs
from ragtrain.config.logger import LoggerConfig
from ragtrain.runtime.console import get_logger
from ragtrain.runtime.errors import ConfigError
from ragtrain.track.mlflow import RunLogger, find_runs, update_run
from ragtrain.tune import space as sp
from ragtrain.tune.trial import (
    DONE_KEY,
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

DONE = ("TERMINATED", "ERROR")


def trial_id_of(run_name: str) -> str:
    """The trial id in a child run's name (`<experiment>/<trial_id> <values>`)."""
    return run_name.split("/", 1)[-1].split(" ", 1)[0]


def close_orphans(uri: str, parent: str | None) -> int:
    """Mark child runs still RUNNING (their trial was cut off) as KILLED; returns how many."""
    if not uri or not parent:
        return 0
    n = 0
    for r in find_runs(uri, parent_run_id=parent):
        if r.status == "RUNNING":
            update_run(uri, r.run_id, tags={"ragtrain.tune.interrupted": "true"}, status="KILLED")
            n += 1
    return n


def expected_trials(plan: SweepPlan) -> int:
    """Trials a complete sweep has: num_samples x the grid's points (Tune repeats the grid per sample)."""
    n = plan.tune.num_samples
    for p in plan.params:
        if p.kind == "grid":
            n *= len(p.args)
    return n


def _trials(plan: SweepPlan) -> list:
    from ray.tune import ExperimentAnalysis  # lazy: ray is heavy (~0.5 s); this module imports without it

    return list(ExperimentAnalysis(str(plan.experiment_path)).trials)


def trial_table(plan: SweepPlan, trials: list) -> pd.DataFrame:
    """One row per trial: id, Tune status, stopped early (by the scheduler), swept values, the sweep metric."""
    metric = normalize_metric(plan.tune.metric)
    rows = []
    for tr in trials:
        last = tr.last_result or {}
        value = last.get(metric)
        rows.append(
            {
                "trial_id": tr.trial_id,
                "status": tr.status,
                "stopped_early": tr.status == "TERMINATED" and not last.get(DONE_KEY),
                **{k: sp._plain(tr.config.get(k)) for k in (p.key for p in plan.params)},
                metric: float(value) if tr.status == "TERMINATED" and value is not None else float("nan"),
                "last_step": last.get("step"),
                "error": str(tr.error_file or "") if tr.status == "ERROR" else "",
            }
        )
    return pd.DataFrame(rows)


def best_trial(df: pd.DataFrame, metric: str, mode: str) -> pd.Series | None:
    """The finished trial with the best finite metric (None when no trial finished)."""
    ok = df[df[metric].map(lambda v: isinstance(v, float) and math.isfinite(v))]
    if ok.empty:
        return None
    return ok.loc[ok[metric].idxmax() if mode == "max" else ok[metric].idxmin()]


def write_best_config(plan: SweepPlan, ctx: TrialContext, values: dict[str, Any], trial_id: str) -> Path:
    """The best trial's full config as an experiment file (and a copy to run as `-cd <dir> experiment=best`)."""
    cfg = trial_config(ctx, values, trial_id)
    data = sp.as_dict(OmegaConf.structured(cfg))
    for key in ("output_dir", "tune", "resume"):  # per-run / sweep-only: Hydra's defaults apply again
        data.pop(key, None)
    data["experiment_name"] = f"{plan.cfg.experiment_name}_best"
    data["logger"]["run_name"] = None
    data["logger"]["tracking_uri"] = plan.cfg.logger.tracking_uri  # as the sweep was given it (None: default)
    run_dir = plan.out_dir / "conf"
    header = (
        f"# @package _global_\n# Best trial {trial_id} of the sweep in {plan.out_dir} "
        f"({plan.tune.metric}; {sp.describe(values, ctx.keys)}).\n"
        f"# Run it: python -m ragtrain --config-dir {run_dir} experiment=best\n"
    )
    text = header + OmegaConf.to_yaml(OmegaConf.create(data))
    path = plan.out_dir / "best_config.yaml"
    path.write_text(text)
    (run_dir / "experiment").mkdir(parents=True, exist_ok=True)
    (run_dir / "experiment" / "best.yaml").write_text(text)
    return path


def _tag_children(plan: SweepPlan, parent: str, df: pd.DataFrame) -> dict[str, str]:
    """Tag each child run with its trial id, sync option and whether the scheduler stopped it; returns trial->run."""
    by_trial = df.set_index("trial_id")
    out: dict[str, str] = {}
    for r in find_runs(plan.tracking_uri, parent_run_id=parent):
        tid = trial_id_of(r.run_name)
        if tid not in by_trial.index:
            continue
        row = by_trial.loc[tid]
        tags = {TRIAL_TAG: tid, STOPPED_TAG: str(bool(row["stopped_early"])).lower()}
        if sp.SYNC_KEY in row.index:
            tags[SYNC_TAG] = row[sp.SYNC_KEY]
        # A trial the scheduler stopped ends as KILLED (its run may say RUNNING or FAILED: it was cut off mid-way).
        status = "KILLED" if row["stopped_early"] or r.status == "RUNNING" else None
        update_run(plan.tracking_uri, r.run_id, tags=tags, status=status)
        if r.status != "RUNNING" or row["stopped_early"]:
            out[tid] = r.run_id
    return out


def finish(plan: SweepPlan, parent: str | None) -> SweepResult:
    """Collect the trials, tag the child runs, write trials.csv, the best config and the report; log them."""
    t = plan.tune
    metric = normalize_metric(t.metric)
    trials = _trials(plan)
    df = trial_table(plan, trials)
    # Interrupted: a trial did not end, or the searcher had not even created them all yet (max_concurrent_trials).
    interrupted = any(tr.status not in DONE for tr in trials) or len(trials) < expected_trials(plan)
    runs = _tag_children(plan, parent, df) if parent else {}
    df["run_id"] = df["trial_id"].map(runs)
    df.to_csv(plan.out_dir / "trials.csv", index=False)
    ctx = plan.context(parent)
    logger = None
    if parent:
        logger = RunLogger(LoggerConfig(tracking_uri=plan.tracking_uri), "", run_id=parent)
        logger.log_artifact(plan.out_dir / "trials.csv")
    log.info("\n" + df.drop(columns=["error"]).to_markdown(index=False, floatfmt=".4g"))
    result = SweepResult(parent, plan.experiment_path, df, None, None, [], interrupted)
    if interrupted:
        log.info(
            f"[tune] interrupted: {int((df['status'].isin(DONE)).sum())}/{expected_trials(plan)} trials done. "
            f"Continue with: "
            f"python -m ragtrain <same overrides> output_dir={plan.out_dir} resume=true"
        )
        return result
    best = best_trial(df, metric, t.mode)
    finished = [tr for tr in trials if (tr.last_result or {}).get(DONE_KEY)]
    if best is None and finished and metric not in finished[0].last_result:  # the guard's last line of defence
        names = sorted(k for k in finished[0].last_result if "/" in k)
        raise ConfigError(
            f"tune.metric={t.metric!r} is not among the finished trials' metrics: {names} "
            f"(the trials are in {plan.out_dir / 'trials.csv'})"
        )
    if best is None and finished:
        log.warning(f"no finished trial reported a finite {metric} (see {plan.out_dir / 'trials.csv'}): no best trial")
    if best is not None:
        values = {k: best[k] for k in ctx.keys}
        result.best = {"trial_id": best["trial_id"], "values": values, "metric": float(best[metric])}
        result.best_config = write_best_config(plan, ctx, values, best["trial_id"])
        log.info(
            f"[tune] best trial {best['trial_id']} ({sp.describe(values, ctx.keys)}): {metric} = {best[metric]:.4f}"
            f"\n[tune] best config: {result.best_config}"
        )
        if logger is not None:
            logger.log_artifact(result.best_config)
            logger.log_metrics({f"best/{metric}": float(best[metric])})
            best_run = runs.get(best["trial_id"], "")
            logger.set_tags({"ragtrain.tune.best_trial": best["trial_id"], "ragtrain.tune.best_run": best_run})
    if t.report and logger is not None:  # a parent run to report on
        _, result.report = compare_runs(
            plan.tracking_uri,
            parent_run_id=parent,
            out_dir=plan.out_dir / "report",
            title=f"{plan.cfg.experiment_name} sweep",
        )
        for f in result.report:
            logger.log_artifact(f, "report")
        log.info(f"[tune] report: {', '.join(str(f) for f in result.report)}")
    return result
