"""What a sweep and its results share: trial context, plan, result, names and tags (imports neither of them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from ragtrain.config import Config, TuneConfig
from ragtrain.tune import space as sp

NAME = "sweep"  # the Tune experiment folder: <output_dir>/tune/sweep
DONE_KEY = "pipeline_done"  # in a trial's final result only: tells a finished trial from one a scheduler stopped
# MLflow tags: on child runs (trial id, sync option, stopped by the scheduler) and on the parent (role=sweep)
TRIAL_TAG, SYNC_TAG = "ragtrain.tune.trial_id", "ragtrain.sync"
STOPPED_TAG, ROLE_TAG = "ragtrain.tune.stopped_early", "ragtrain.role"


@dataclass
class TrialContext:
    """What every trial needs, shipped once through the object store (tune.with_parameters)."""

    base: dict  # the resolved sweep config as plain data (tune = None): trials never see Hydra
    sync_options: dict[str, dict]
    keys: list[str]  # swept keys, in display order
    out_dir: str  # absolute: Tune runs trials in other working directories
    tracking_uri: str  # absolute, the parent's store
    parent_run_id: str | None
    experiment_name: str


@dataclass
class SweepPlan:
    """A validated sweep: the space, the trials' base config, and where everything goes."""

    cfg: Config
    params: list[sp.Param]
    base: dict
    sync_options: dict[str, dict]
    out_dir: Path
    tracking_uri: str

    @property
    def tune(self) -> TuneConfig:
        """The sweep's settings (plan_sweep refuses a config without them)."""
        if self.cfg.tune is None:
            raise ValueError("a sweep plan needs cfg.tune: build it with plan_sweep")
        return self.cfg.tune

    @property
    def experiment_path(self) -> Path:
        """Tune's experiment folder (what resume restores)."""
        return self.out_dir / "tune" / NAME

    def context(self, parent_run_id: str | None) -> TrialContext:
        """What the trials of this sweep receive."""
        return TrialContext(
            self.base,
            self.sync_options,
            [p.key for p in self.params],
            str(self.out_dir),
            self.tracking_uri,
            parent_run_id,
            self.cfg.experiment_name,
        )


@dataclass
class SweepResult:
    parent_run_id: str | None
    experiment_path: Path
    trials: pd.DataFrame  # one row per trial: id, status, stopped_early, swept values, metric
    best: dict | None  # {"trial_id", "values", "metric"} of the best finished trial
    best_config: Path | None
    report: list[Path] = field(default_factory=list)
    interrupted: bool = False


def normalize_metric(name: str) -> str:
    """Accept MLflow spelling (ndcg_at_10) for pipeline metric names (ndcg@10)."""
    return name.replace("_at_", "@")


def trial_config(ctx: TrialContext, values: dict[str, Any], trial_id: str) -> Config:
    """One trial's typed config: its own output folder and a child-run name that says what it tried."""
    base = dict(ctx.base)
    base["output_dir"] = str(Path(ctx.out_dir, "trials", trial_id))
    # the sweep owns its trial folders: a trial cut off by an interruption (status "running") starts again there
    base["overwrite"] = True
    label = sp.describe(values, ctx.keys)
    base["logger"] = {
        **base["logger"],
        "tracking_uri": ctx.tracking_uri or None,
        "run_name": f"{ctx.experiment_name}/{trial_id} {label}".strip(),
    }
    return sp.apply(base, values, ctx.sync_options)
