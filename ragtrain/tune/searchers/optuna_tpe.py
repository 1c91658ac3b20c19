"""`optuna`: Optuna's TPE, fitted to a pipeline trial: the searched metric (e.g. trained/ndcg@10) arrives only in
the trial's last result. It cannot sample `grid` domains (the config checks say so)."""

from __future__ import annotations

from ray.tune.search import ConcurrencyLimiter, Searcher
from ray.tune.search.optuna import OptunaSearch

from ragtrain.config.tune import TuneConfig
from ragtrain.tune.trial import normalize_metric


class OptunaTPE:
    def __init__(self, t: TuneConfig):
        self.t = t

    def searcher(self, concurrency: int) -> Searcher:
        t = self.t
        optuna = FinalMetricOptunaSearch(metric=normalize_metric(t.metric), mode=t.mode, seed=t.seed)
        return ConcurrencyLimiter(optuna, max_concurrent=concurrency)


class FinalMetricOptunaSearch(OptunaSearch):
    """Optuna TPE that skips intermediate results lacking its metric (OptunaSearch would raise KeyError on them)."""

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if isinstance(self.metric, str) and self.metric in result:
            super().on_trial_result(trial_id, result)
