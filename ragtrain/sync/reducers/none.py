"""`none`: every worker keeps its own gradient and sends nothing (a mixer, if any, pulls replicas together)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ragtrain.config.sync import ReducerConfig
from ragtrain.sync.reducers.base import Stateless, done


class NoReducer(Stateless):
    def __init__(self, cfg: ReducerConfig, group: Any | None, category: str):
        pass

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return done(bucket.buffer())  # local step: keep this worker's own gradient
