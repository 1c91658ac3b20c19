"""The Protocol every consensus rule implements: what the replicas become when training ends."""

from __future__ import annotations

from typing import Protocol

from torch import nn

from ragtrain.config.sync import CONSENSUS
from ragtrain.sync.mixers.base import Mixer


class Consensus(Protocol):
    """Built as `cls()`. Its registry entry says whether training hands every replica on (`keeps_replicas`)."""

    def form(self, mixer: Mixer, params: list[nn.Parameter]) -> None:
        """End of training, where replicas may differ: `params` are the ones the mixer owns."""
        ...


def build_consensus(name: str) -> Consensus:
    """The rule `name` names in the CONSENSUS registry."""
    return CONSENSUS[name].load()()
