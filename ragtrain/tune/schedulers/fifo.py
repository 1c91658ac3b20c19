"""`fifo`: every trial runs to its end, in the order they start."""

from __future__ import annotations

from ray.tune.schedulers import FIFOScheduler, TrialScheduler

from ragtrain.config.tune import TuneConfig


class Fifo:
    def __init__(self, t: TuneConfig):
        pass

    def scheduler(self) -> TrialScheduler:
        return FIFOScheduler()
