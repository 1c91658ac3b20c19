"""The Protocol every gossip topology implements: which peers a worker mixes with in a round."""

from __future__ import annotations

from typing import Protocol

from ragtrain.config.sync import GOSSIP_TOPOLOGIES


class Topology(Protocol):
    """Built as `cls(seed)`; every worker builds its own and must get the same answer as the others."""

    def neighbours(self, position: int, size: int, round_: int) -> list[int]:
        """The positions (on the mixer scope's ring of `size`) that `position` mixes with in gossip round
        `round_`; [] to skip the round. Symmetric: b is a's neighbour when a is b's."""
        ...


def build_topology(name: str, seed: int = 0) -> Topology:
    """The topology `name` names in the GOSSIP_TOPOLOGIES registry."""
    return GOSSIP_TOPOLOGIES[name].load()(seed)
