"""Searchers that fit a pipeline trial: the searched metric (e.g. trained/ndcg@10) arrives only in the last result."""

from __future__ import annotations

from ray.tune.search.optuna import OptunaSearch


class FinalMetricOptunaSearch(OptunaSearch):
    """Optuna TPE that skips intermediate results lacking its metric (OptunaSearch would raise KeyError on them)."""

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if isinstance(self.metric, str) and self.metric in result:
            super().on_trial_result(trial_id, result)
