"""The Protocol of a trial scheduler: it builds the Ray Tune scheduler a sweep runs with."""

from __future__ import annotations

from typing import Protocol

from ray.tune.schedulers import TrialScheduler

from ragtrain.config.tune import TUNE_SCHEDULERS, TuneConfig


class Scheduler(Protocol):
    """Built as `cls(t: TuneConfig)`."""

    def scheduler(self) -> TrialScheduler:
        """Ray Tune's scheduler for the sweep `t`."""
        ...


def build_scheduler(t: TuneConfig) -> TrialScheduler:
    """The scheduler `t.scheduler` names in the TUNE_SCHEDULERS registry."""
    return TUNE_SCHEDULERS[t.scheduler].load()(t).scheduler()
