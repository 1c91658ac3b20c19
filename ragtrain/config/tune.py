"""Typed config of a Ray Tune sweep (`tune` group, conf/tune/*.yaml), with its range checks.

Imported by ragtrain/config/__init__.py, so this module imports nothing heavy (no Ray).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ragtrain.config.registry import Variant
from ragtrain.runtime.errors import check as _check


@dataclass(frozen=True)
class SchedulerVariant(Variant):
    """A trial scheduler (ragtrain/tune/schedulers/)."""

    stops_early: bool = False  # stops trials on their training curves: tune.asha_metric, the retriever stage


@dataclass(frozen=True)
class SearcherVariant(Variant):
    """A search algorithm (ragtrain/tune/searchers/)."""

    grid: bool = True  # can sample a `grid` domain of tune.space


# One registry per family: name -> the class and the facts the checks read (docs/adding-a-variant.md)
TUNE_SCHEDULERS: dict[str, SchedulerVariant] = {
    "fifo": SchedulerVariant("ragtrain.tune.schedulers.fifo:Fifo"),
    "asha": SchedulerVariant("ragtrain.tune.schedulers.asha:Asha", stops_early=True),
}
TUNE_SEARCHERS: dict[str, SearcherVariant] = {
    "random": SearcherVariant("ragtrain.tune.searchers.random_search:RandomSearch"),
    "optuna": SearcherVariant("ragtrain.tune.searchers.optuna_tpe:OptunaTPE", grid=False),
}
TUNE_TIME_ATTRS = ("step", "training_iteration")


@dataclass
class TuneConfig:
    """A Ray Tune sweep (ragtrain/tune, conf/tune): search space over config keys, scheduler, searcher."""

    # dotted config key (or `sync`: a conf/sync option name) -> {choice|grid|uniform|loguniform|randint: [...]}
    space: dict[str, Any] = field(default_factory=dict)
    metric: str = "trained/ndcg@10"  # searched for and used to pick the best trial (known when a trial ends)
    mode: str = "max"
    num_samples: int = 1  # samples of the space (each grid point is repeated num_samples times)
    max_concurrent_trials: int | None = None  # None: cluster CPUs // one trial's peak CPUs (trainer | pool)
    trial_cpus: float = 0.0  # the trial's driver function only; its trainer workers and pool reserve their own
    scheduler: str = "fifo"  # a name in TUNE_SCHEDULERS: fifo | asha
    searcher: str = "random"  # a name in TUNE_SEARCHERS: random | optuna
    seed: int | None = None  # searcher seed
    asha_metric: str = "train/loss"  # asha: a metric every log window reports (retriever.train.log_every)
    asha_mode: str = "min"
    time_attr: str = "step"  # asha: step (training steps) | training_iteration (reports)
    grace_period: int = 1
    reduction_factor: float = 2.0
    max_t: int | None = None  # asha: None = no cap (a capped trial is stopped before its final evaluation)
    report: bool = True  # write the comparison report (CSV + PNG) when the sweep ends

    def __post_init__(self) -> None:
        k = "tune."
        _check(
            self.scheduler in TUNE_SCHEDULERS,
            k + "scheduler",
            f"must be one of {list(TUNE_SCHEDULERS)}",
            self.scheduler,
        )
        _check(self.searcher in TUNE_SEARCHERS, k + "searcher", f"must be one of {list(TUNE_SEARCHERS)}", self.searcher)
        _check(self.mode in ("min", "max"), k + "mode", "must be one of ['min', 'max']", self.mode)
        _check(self.asha_mode in ("min", "max"), k + "asha_mode", "must be one of ['min', 'max']", self.asha_mode)
        _check(
            self.time_attr in TUNE_TIME_ATTRS,
            k + "time_attr",
            f"must be one of {list(TUNE_TIME_ATTRS)}",
            self.time_attr,
        )
        _check(bool(self.space), k + "space", "is empty: nothing to sweep", self.space)
        _check(self.num_samples > 0, k + "num_samples", "must be > 0", self.num_samples)
        mct = self.max_concurrent_trials
        _check(mct is None or mct > 0, k + "max_concurrent_trials", "must be > 0 (or null: derived)", mct)
        _check(self.trial_cpus >= 0, k + "trial_cpus", "must be >= 0", self.trial_cpus)
        _check(self.grace_period > 0, k + "grace_period", "must be > 0", self.grace_period)
        _check(self.reduction_factor > 1, k + "reduction_factor", "must be > 1", self.reduction_factor)
        _check(
            self.max_t is None or self.max_t > self.grace_period, k + "max_t", "must be > tune.grace_period", self.max_t
        )
