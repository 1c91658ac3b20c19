"""`average` (local SGD): the parameters all-reduced to their mean every `period` steps.

Optionally after `warmup_steps` of exact gradient all-reduce (post-local SGD), and with `adaptive`, the period
halves when the divergence measured at a round exceeds 2 x target_divergence and doubles (up to max_period)
below half of it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ragtrain.config.sync import MixerConfig
from ragtrain.runtime.errors import filled
from ragtrain.sync.base import average_params
from ragtrain.sync.scopes.base import MixerScope


class Average:
    def __init__(self, cfg: MixerConfig, scope: MixerScope):
        self.cfg, self.scope = cfg, scope
        self.warmup = filled(cfg.warmup_steps, "sync.mixer.warmup_steps")
        self.period = filled(cfg.period, "sync.mixer.period")
        self.next_sync = self.warmup + self.period  # step count (1-based) of the next averaging round
        self.last_divergence = 0.0

    def bind(self, model: nn.Module) -> None:
        pass

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        m, done = self.cfg, step + 1
        if done < self.next_sync:
            return
        if self.scope.mixes:
            self.last_divergence = average_params(params, category=self.scope.category)
            if m.adaptive:
                target = filled(m.target_divergence, "sync.mixer.target_divergence")
                if self.last_divergence > 2 * target:
                    self.period = max(1, self.period // 2)
                elif self.last_divergence < target / 2:
                    self.period = min(filled(m.max_period, "sync.mixer.max_period"), self.period * 2)
        self.next_sync = done + self.period

    def consensus(self, params: list[nn.Parameter]) -> None:
        average_params(params, category=self.scope.category)

    def state(self) -> dict[str, Any]:
        return {"sync/period": self.period, "sync/divergence_at_sync": self.last_divergence}

    def state_dict(self) -> dict[str, Any]:
        return {"period": self.period, "next_sync": self.next_sync, "last_divergence": self.last_divergence}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.period = int(state.get("period", self.period))
        self.next_sync = int(state.get("next_sync", self.next_sync))
        self.last_divergence = float(state.get("last_divergence", 0.0))
