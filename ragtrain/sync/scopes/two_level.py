"""Reducer scope `two_level` ("hybrid"): each bucket averaged inside the node with an exact fp32 all-reduce, then
`reducer.kind` across nodes on the node-mean gradient.

Inside the node: 2(n-1)/n * 4B bytes (n workers on the node, B entries), category `grad_intra`. Across nodes the
reducer runs among the workers of equal local rank (one per node, N nodes): every such cross-node group holds the
same inputs, so all of them compute the same result and every replica applies the global mean gradient
(PowerSGD: 2(N-1)/N * 4 * (r(n+m) per compressed matrix + the vectors), category `grad_inter`). Every worker sends
on the inter-node links once, with N-party rings (N < W).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from ragtrain.config.sync import ReducerConfig
from ragtrain.sync.reducers.base import Reducer, build_reducer, done
from ragtrain.sync.scopes.base import Layout
from ragtrain.sync.scopes.intra_node import node_mean


class TwoLevel:
    by_node: ClassVar[bool] = True

    def __init__(self, lay: Layout, cfg: ReducerConfig):
        self.layout = lay
        self.reducer: Reducer | None = None  # one node: the node mean is the global mean, nothing crosses nodes
        if lay.world > 1 and lay.num_nodes > 1:
            cross, _ = dist.new_subgroups_by_enumeration(ranks_per_subgroup_list=counterparts(lay.groups))
            self.reducer = build_reducer(cfg, cross, "grad_inter")

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        node_mean(bucket, self.layout).wait()  # the node mean first (in place), then across nodes
        if self.reducer is None:
            return done(bucket.buffer())
        return self.reducer.hook(bucket)

    def gradient_groups(self) -> list[list[int]] | None:
        return None  # every replica applies the global mean gradient


def counterparts(groups: list[list[int]]) -> list[list[int]]:
    """Cross-node groups: the workers of equal local rank, one per node (every node must hold as many workers)."""
    sizes = sorted({len(g) for g in groups})
    if len(sizes) != 1:
        raise ValueError(
            f"sync.scope.reducer=two_level needs as many workers on every node, got {sizes} "
            f"(nodes: {groups}); use scope.reducer=all or resources that place workers evenly"
        )
    return [[g[i] for g in groups] for i in range(sizes[0])]
