"""The Protocol every parameter mixer implements.

A mixer pulls replicas that stepped apart back together, after optimizer steps (local SGD's averaging, gossip, an
asynchronous parameter server). It gets the parameters it owns (every trainable one, or those outside
scope.reducer_params) and a mixer scope (ragtrain/sync/scopes/) that says among which ranks it mixes and under
which category its bytes are counted.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from ragtrain.config.sync import MIXERS, MixerConfig
from ragtrain.sync.scopes.base import MixerScope


class Mixer(Protocol):
    """Built as `cls(cfg, scope)`."""

    warmup: int  # steps of exact gradient all-reduce (DDP) before the mixer takes over (0: none)

    def bind(self, model: nn.Module) -> None:
        """Called once with the replica before training (async_ps starts its server here)."""
        ...

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        """After optimizer step `step` (0-based): mix if it is time to."""
        ...

    def consensus(self, params: list[nn.Parameter]) -> None:
        """End of training: make every replica's `params` the consensus (their mean)."""
        ...

    def state(self) -> dict[str, Any]:
        """Figures to log (e.g. the current averaging period)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to continue exactly; keys unique to this mixer."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output (after `bind` and after the replica's weights are restored)."""
        ...


def build_mixer(cfg: MixerConfig, scope: MixerScope) -> Mixer:
    """The mixer `cfg.kind` names in the MIXERS registry."""
    return MIXERS[cfg.kind].load()(cfg, scope)
