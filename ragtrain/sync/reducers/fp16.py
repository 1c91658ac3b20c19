"""`fp16`: torch's fp16 compress hook: the bucket crosses the wire in 2 bytes per entry (half of allreduce's)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ragtrain.config.sync import ReducerConfig
from ragtrain.sync.comm import all_reduce_bytes, counted_future
from ragtrain.sync.reducers.base import Stateless, group_size, reduce_slices


class Fp16(Stateless):
    dtype = torch.float16  # on the wire
    torch_hook = "fp16_compress_hook"  # in torch.distributed.algorithms.ddp_comm_hooks.default_hooks

    def __init__(self, cfg: ReducerConfig, group: Any | None, category: str):
        self.group, self.category = group, category

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # lazy: torch.distributed's submodules import only where torch.distributed is built
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        n = bucket.buffer().numel()
        fut = getattr(default_hooks, self.torch_hook)(self.group, bucket)
        return counted_future(fut, self.category, all_reduce_bytes(2 * n, group_size(self.group)))

    def reduce_slices(self, buf: torch.Tensor, slices: list[tuple[int, int]]) -> None:
        reduce_slices(buf, slices, self.dtype, self.category, self.group)
