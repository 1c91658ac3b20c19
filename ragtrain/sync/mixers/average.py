"""`average` (local SGD): the parameters all-reduced to their mean every `period` steps.

Optionally after `warmup_steps` of exact gradient all-reduce (post-local SGD). The period can move: with
`adaptive`, it halves when the divergence measured at a round exceeds 2 x target_divergence and doubles (up to
max_period) below half of it; with `comm_share`, it is set after each round from the measured round and step
seconds so that communication stays under that share of the step time (ragtrain/sync/network.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ragtrain.config.sync import MixerConfig
from ragtrain.runtime.errors import filled
from ragtrain.sync.base import average_params, world_size
from ragtrain.sync.comm import all_reduce_bytes
from ragtrain.sync.network import NetworkPeriod
from ragtrain.sync.scopes.base import MixerScope


class Average:
    def __init__(self, cfg: MixerConfig, scope: MixerScope):
        self.cfg, self.scope = cfg, scope
        self.warmup = filled(cfg.warmup_steps, "sync.mixer.warmup_steps")
        self.period = filled(cfg.period, "sync.mixer.period")
        self.next_sync = self.warmup + self.period  # step count (1-based) of the next averaging round
        self.last_divergence = 0.0
        share = filled(cfg.comm_share, "sync.mixer.comm_share")
        self.network = NetworkPeriod(share, filled(cfg.max_period, "sync.mixer.max_period")) if share else None

    def bind(self, model: nn.Module) -> None:
        pass

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        m, done = self.cfg, step + 1
        if self.network is not None and done >= self.warmup:  # the local steps' compute (a warm-up step all-reduces)
            self.network.tick()
        if done < self.next_sync:
            return
        if self.scope.mixes:
            timer = self.network.collective(params[0].is_cuda) if self.network is not None else None
            self.last_divergence = average_params(params, category=self.scope.category, timer=timer)
            if m.adaptive:
                target = filled(m.target_divergence, "sync.mixer.target_divergence")
                if self.last_divergence > 2 * target:
                    self.period = max(1, self.period // 2)
                elif self.last_divergence < target / 2:
                    self.period = min(filled(m.max_period, "sync.mixer.max_period"), self.period * 2)
            elif self.network is not None:
                nbytes = all_reduce_bytes(4 * sum(p.numel() for p in params), world_size())  # the fp32 mean's
                self.period = self.network.next_period(self.period, nbytes, params[0].device)
        self.next_sync = done + self.period

    def consensus(self, params: list[nn.Parameter]) -> None:
        average_params(params, category=self.scope.category)

    def state(self) -> dict[str, Any]:
        figures = self.network.state() if self.network is not None else {}
        return {"sync/period": self.period, "sync/divergence_at_sync": self.last_divergence, **figures}

    def state_dict(self) -> dict[str, Any]:
        return {"period": self.period, "next_sync": self.next_sync, "last_divergence": self.last_divergence}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.period = int(state.get("period", self.period))
        self.next_sync = int(state.get("next_sync", self.next_sync))
        self.last_divergence = float(state.get("last_divergence", 0.0))
