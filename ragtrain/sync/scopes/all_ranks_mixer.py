"""Mixer scope `all`: the mixer spans every rank (gossip's ring is the ranks' ring)."""

from __future__ import annotations

from typing import ClassVar

from ragtrain.sync.scopes.base import Layout


class AllRanksMixer:
    by_node: ClassVar[bool] = False
    category = "params"
    mixes = True

    def __init__(self, lay: Layout):
        self.layout = lay

    def position(self) -> tuple[int, int]:
        return self.layout.rank, self.layout.world

    def ranks(self, positions: list[int]) -> list[int]:
        return positions
