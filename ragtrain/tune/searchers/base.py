"""The Protocol of a search algorithm: it builds the Ray Tune searcher a sweep samples its space with."""

from __future__ import annotations

from typing import Protocol

from ray.tune.search import SearchAlgorithm
from ray.tune.search import Searcher as TuneSearcher

from ragtrain.config.tune import TUNE_SEARCHERS, TuneConfig


class Searcher(Protocol):
    """Built as `cls(t: TuneConfig)`."""

    def searcher(self, concurrency: int) -> TuneSearcher | SearchAlgorithm:
        """Ray Tune's search algorithm for the sweep `t`, running at most `concurrency` trials at once."""
        ...


def build_searcher(t: TuneConfig, concurrency: int) -> TuneSearcher | SearchAlgorithm:
    """The search algorithm `t.searcher` names in the TUNE_SEARCHERS registry."""
    return TUNE_SEARCHERS[t.searcher].load()(t).searcher(concurrency)
