"""Mixer scope `inter_node`: the mixer joins the nodes (replicas inside a node are equal: scope.reducer=intra_node).

Gossip's ring is the nodes' ring: each worker exchanges with the worker of its local rank on the previous and
next node. Averaging runs over every rank (the mean of equal replicas per node), and only with several nodes.
"""

from __future__ import annotations

from typing import ClassVar

from ragtrain.sync.scopes.base import Layout


class InterNode:
    by_node: ClassVar[bool] = True
    category = "params_inter"

    def __init__(self, lay: Layout):
        self.layout = lay
        self.mixes = lay.num_nodes > 1

    def position(self) -> tuple[int, int]:
        return self.layout.groups.index(self.layout.my_group), self.layout.num_nodes

    def ranks(self, positions: list[int]) -> list[int]:
        local, groups = self.layout.local_rank, self.layout.groups
        return [groups[n][local] for n in positions if local < len(groups[n])]
