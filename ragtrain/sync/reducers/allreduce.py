"""`allreduce`: the exact fp32 mean of every gradient, torch's allreduce_hook (what plain DDP does), bytes counted."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ragtrain.config.sync import ReducerConfig
from ragtrain.sync.comm import all_reduce_bytes, counted_future
from ragtrain.sync.reducers.base import Stateless, group_size, reduce_slices


class AllReduce(Stateless):
    def __init__(self, cfg: ReducerConfig | None, group: Any | None, category: str):
        self.group, self.category = group, category

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # lazy: torch.distributed's submodules import only where torch.distributed is built
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        buf = bucket.buffer()
        nbytes = all_reduce_bytes(buf.numel() * buf.element_size(), group_size(self.group))
        # torch annotates process_group as ProcessGroup, yet reads None as the default group (what self.group is here)
        hook = allreduce_hook(self.group, bucket)  # type: ignore[arg-type]
        return counted_future(hook, self.category, nbytes)

    def reduce_slices(self, buf: torch.Tensor, slices: list[tuple[int, int]]) -> None:
        reduce_slices(buf, slices, None, self.category, self.group)
