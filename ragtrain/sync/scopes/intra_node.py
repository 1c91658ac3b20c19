"""Reducer scope `intra_node`: an exact fp32 all-reduce inside each Ray node only; nothing crosses nodes (a mixer
with scope.mixer=inter_node joins the nodes: conf/sync/hierarchical.yaml)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from ragtrain.config.sync import ReducerConfig
from ragtrain.sync.comm import all_reduce_bytes, counted_future
from ragtrain.sync.reducers.base import done
from ragtrain.sync.scopes.base import Layout


class IntraNode:
    by_node: ClassVar[bool] = True

    def __init__(self, lay: Layout, cfg: ReducerConfig):
        self.layout = lay
        self.reducer = None  # its own exact all-reduce (the config checks require reducer.kind=allreduce)

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return node_mean(bucket, self.layout)

    def gradient_groups(self) -> list[list[int]] | None:
        return None if self.layout.num_nodes == 1 else [list(g) for g in self.layout.groups]


def node_mean(bucket: dist.GradBucket, lay: Layout) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket inside this node, in place (category grad_intra)."""
    buf = bucket.buffer()
    n = len(lay.my_group)
    if n == 1:
        return done(buf)
    nbytes = all_reduce_bytes(buf.numel() * buf.element_size(), n)
    buf.div_(n)
    fut = dist.all_reduce(buf, group=lay.node_group, async_op=True).get_future().then(lambda f: f.value()[0])
    return counted_future(fut, "grad_intra", nbytes)
