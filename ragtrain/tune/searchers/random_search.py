"""`random`: Tune's BasicVariantGenerator: grid points in order, every other domain sampled at random (seeded)."""

from __future__ import annotations

from ray.tune.search import SearchAlgorithm
from ray.tune.search.basic_variant import BasicVariantGenerator

from ragtrain.config.tune import TuneConfig


class RandomSearch:
    def __init__(self, t: TuneConfig):
        self.t = t

    def searcher(self, concurrency: int) -> SearchAlgorithm:
        # Tune ignores TuneConfig.max_concurrent_trials for a BasicVariantGenerator passed in: it takes its own.
        return BasicVariantGenerator(random_state=self.t.seed, max_concurrent=concurrency)
