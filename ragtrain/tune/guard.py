"""A sweep whose metric no trial reports stops at the first result that shows it, not after every trial.

Tune only warns about a missing metric (and ragtrain turns its strict check off: a trial reports its sweep metric
only when its pipeline ends). So a misspelled `tune.metric` would run the whole grid and pick no winner, and a
misspelled `tune.asha_metric` would switch early stopping off without a word. The metric names depend on the stages,
the sync strategy and the data, so they are checked against what the first trial actually reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray.tune.stopper import Stopper

__all__ = ["MetricGuard", "recorded_error"]

SHOWN = 40  # names listed in the error at most


class MetricGuard(Stopper):
    """Tune stopper: ends the sweep when a training window lacks `asha_metric` or a finished trial lacks `metric`;
    `error` then says which, with the names the trial did report, and so does the file `record` when given.

    The file is how a resumed sweep learns it: Tune restores the stopper the sweep was started with (a copy, not
    this object), so only what that copy writes reaches the driver's code after `fit`.
    """

    def __init__(
        self,
        metric: str,
        asha_metric: str | None,
        done_key: str,
        window_key: str = "train/loss",
        record: str | None = None,
    ):
        self.metric, self.asha_metric, self.done_key, self.window_key = metric, asha_metric, done_key, window_key
        self.record = record
        self.error: str | None = None

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        """Tune calls this with every result; True ends that trial (and `stop_all` then ends the sweep)."""
        if self.error is None:
            if result.get(self.done_key) and self.metric not in result:
                self.error = self._missing("tune.metric", self.metric, "its final metrics", trial_id, result)
            elif self.asha_metric and self.window_key in result and self.asha_metric not in result:
                self.error = self._missing(
                    "tune.asha_metric", self.asha_metric, "a training window's metrics", trial_id, result
                )
            record = getattr(self, "record", None)  # None: a guard pickled before `record` existed
            if self.error is not None and record:
                Path(record).write_text(self.error)
        return self.error is not None

    def stop_all(self) -> bool:
        """End every trial once a metric is known to be missing."""
        return self.error is not None

    @staticmethod
    def _missing(key: str, name: str, where: str, trial_id: str, result: dict[str, Any]) -> str:
        names = sorted(k for k in result if "/" in k)
        more = f" (+{len(names) - SHOWN} more)" if len(names) > SHOWN else ""
        return f"{key}={name!r} is not among {where} (trial {trial_id}): {names[:SHOWN]}{more}"


def recorded_error(record: str | Path) -> str | None:
    """The error a `MetricGuard` (this one or the copy a resumed sweep restored) wrote to `record`, if any."""
    path = Path(record)
    return path.read_text() if path.is_file() else None
