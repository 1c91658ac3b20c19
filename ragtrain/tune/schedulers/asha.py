"""`asha`: Ray Tune's ASHA stops trials whose training curve (tune.asha_metric, reported at every log window)
falls behind at a rung (grace_period, reduction_factor, time_attr, max_t)."""

from __future__ import annotations

from ray.tune.schedulers import ASHAScheduler, TrialScheduler

from ragtrain.config.tune import TuneConfig
from ragtrain.tune.trial import normalize_metric

UNCAPPED_T = 10**6  # ASHA needs a max_t for its rungs; a trial reaching it would be stopped before its evaluation


class Asha:
    def __init__(self, t: TuneConfig):
        self.t = t

    def scheduler(self) -> TrialScheduler:
        t = self.t
        return ASHAScheduler(
            time_attr=t.time_attr,
            metric=normalize_metric(t.asha_metric),
            mode=t.asha_mode,
            max_t=t.max_t or UNCAPPED_T,
            grace_period=t.grace_period,
            reduction_factor=t.reduction_factor,
        )
