"""`none`: no mixing during training; at the end, where replicas differ, their parameter mean (consensus)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ragtrain.config.sync import MixerConfig
from ragtrain.sync.base import average_params
from ragtrain.sync.scopes.base import MixerScope


class NoMixer:
    warmup = 0

    def __init__(self, cfg: MixerConfig, scope: MixerScope):
        self.scope = scope

    def bind(self, model: nn.Module) -> None:
        pass

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        pass

    def consensus(self, params: list[nn.Parameter]) -> None:
        average_params(params, category=self.scope.category)

    def state(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
