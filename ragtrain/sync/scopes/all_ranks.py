"""Reducer scope `all`: one reduction over every rank."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from ragtrain.config.sync import REDUCERS, ReducerConfig
from ragtrain.sync.reducers.base import Reducer, build_reducer
from ragtrain.sync.scopes.base import Layout


class AllRanks:
    by_node: ClassVar[bool] = False

    def __init__(self, lay: Layout, cfg: ReducerConfig):
        self.layout = lay
        self.sends = REDUCERS[cfg.kind].sends
        self.reducer: Reducer = build_reducer(cfg, None, "grad")

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return self.reducer.hook(bucket)

    def gradient_groups(self) -> list[list[int]] | None:
        # a sending reducer: every replica applies the global mean gradient; none: each its own
        return None if self.sends else [[r] for r in range(self.layout.world)]
