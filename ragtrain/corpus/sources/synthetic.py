"""`data=synthetic`: the built-in KB (fictional entities, one passage per fact), generated in memory."""

from __future__ import annotations

from ragtrain.corpus.sources.base import Load
from ragtrain.data import RetrievalData, make_synthetic
from ragtrain.data.store import write_store


class Synthetic:
    def load(self, ld: Load) -> RetrievalData:
        data = make_synthetic(num_entities=ld.cfg.num_entities, seed=ld.cfg.seed, split=ld.cfg.split)
        if ld.passages is not None:
            data.corpus = write_store(ld.passages, data.corpus.values())
        return data
