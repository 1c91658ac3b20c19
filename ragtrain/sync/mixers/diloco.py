"""`diloco` (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models").

Each replica runs the training loop's own optimizer (the inner one, AdamW) alone for `period` steps from a shared
anchor theta; then the outer step, in fp32:
    delta   = mean over the mixer's ranks of (theta - theta_i)     one all-reduce, in `pseudo_grad_dtype`
    m       = outer_momentum * m + delta                           SGD with Nesterov momentum on the anchor
    theta  <- theta - outer_lr * (delta + outer_momentum * m)
and every replica restarts from the new theta. With outer_lr 1 and no momentum it is local SGD (`average`):
theta - mean(theta - theta_i) = mean(theta_i). The inner optimizer's state carries on across rounds, as in the
paper. Optionally after `warmup_steps` of exact gradient all-reduce (the anchor is then the warmed-up replica),
and with `comm_share` the period follows the measured network (ragtrain/sync/network.py).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ragtrain.config.sync import MixerConfig
from ragtrain.runtime.errors import filled
from ragtrain.sync.base import average_params, flat_params, set_flat_params, world_size
from ragtrain.sync.comm import STATS, all_reduce_bytes
from ragtrain.sync.network import NetworkPeriod
from ragtrain.sync.scopes.base import MixerScope

WIRE = {"fp16": torch.float16, "fp32": torch.float32}  # sync.mixer.pseudo_grad_dtype (PSEUDO_GRAD_DTYPES)


class Diloco:
    def __init__(self, cfg: MixerConfig, scope: MixerScope):
        self.cfg, self.scope = cfg, scope
        self.warmup = filled(cfg.warmup_steps, "sync.mixer.warmup_steps")
        self.period = filled(cfg.period, "sync.mixer.period")
        self.outer_lr = filled(cfg.outer_lr, "sync.mixer.outer_lr")
        self.momentum = filled(cfg.outer_momentum, "sync.mixer.outer_momentum")
        self.wire = WIRE[filled(cfg.pseudo_grad_dtype, "sync.mixer.pseudo_grad_dtype")]
        share = filled(cfg.comm_share, "sync.mixer.comm_share")
        self.network = NetworkPeriod(share, filled(cfg.max_period, "sync.mixer.max_period")) if share else None
        self.next_sync = self.warmup + self.period  # step count (1-based) of the next outer step
        self.rounds = 0
        self.last_norm = 0.0  # the averaged pseudo-gradient's norm at the last outer step
        # fp32, flat over the replica's trainable parameters (bind): the anchor and the outer momentum. Flat over all
        # of them, not only the ones after_step gets, since the mixer learns which it owns (scope.reducer_params)
        # only then, and a checkpoint taken before the first round must already hold the anchor.
        self.anchor = torch.zeros(0)
        self.buf = torch.zeros(0)
        # id(parameter) -> (offset, numel) in the flat vectors: the object, not its storage, which `.data =` swaps
        self.slots: dict[int, tuple[int, int]] = {}

    def bind(self, model: nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        self.anchor = flat_params(params)
        if world_size() > 1:
            # One anchor for every rank, and every replica starts from it: rank 0's weights, as DDP's construction
            # does (replicas may start apart: retriever.lora's adapters draw their init from a per-rank seed).
            # Set-up traffic, before the training loop counts (it resets the counts after wrap): not counted.
            dist.broadcast(self.anchor, src=0)
            set_flat_params(params, self.anchor)
        self.buf = torch.zeros_like(self.anchor)
        offset = 0
        for p in params:
            self.slots[id(p)] = (offset, p.numel())
            offset += p.numel()

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        done = step + 1
        if self.warmup and done == self.warmup:  # the warm-up's exact all-reduce kept replicas equal: start here
            self._scatter(self.anchor, params, flat_params(params))
        if self.network is not None and done >= self.warmup:  # the local steps' compute (a warm-up step all-reduces)
            self.network.tick()
        if done < self.next_sync:
            return
        if self.scope.mixes:
            nbytes = self.outer_step(params)
            if self.network is not None:
                self.period = self.network.next_period(self.period, nbytes, params[0].device)
        self.next_sync = done + self.period

    def outer_step(self, params: list[nn.Parameter]) -> int:
        """Average the pseudo-gradient, step the anchor, restart every replica from it; returns the bytes sent."""
        anchor, buf = self._gather(self.anchor, params), self._gather(self.buf, params)
        delta, nbytes = self._mean_delta(anchor - flat_params(params), params[0].is_cuda)
        buf.mul_(self.momentum).add_(delta)
        anchor.sub_(delta.add(buf, alpha=self.momentum), alpha=self.outer_lr)  # Nesterov: delta + momentum * m
        self._scatter(self.anchor, params, anchor)
        self._scatter(self.buf, params, buf)
        set_flat_params(params, anchor)
        self.rounds += 1
        self.last_norm = float(delta.norm())
        return nbytes

    def _mean_delta(self, delta: torch.Tensor, cuda: bool) -> tuple[torch.Tensor, int]:
        """The ranks' mean pseudo-gradient, back in fp32, and the bytes this worker sent for it. Each rank divides
        before the sum (as torch's fp16 gradient hook does): the fp16 sum never grows past the largest delta."""
        w = world_size()
        if w == 1:
            return delta, 0
        sent = delta.div(w).to(self.wire)
        nbytes = all_reduce_bytes(sent.numel() * sent.element_size(), w)  # in the type actually sent
        timer = self.network.collective(cuda) if self.network is not None else None
        with STATS.timed(self.scope.category, nbytes), timer or nullcontext():
            dist.all_reduce(sent)
        return sent.float(), nbytes

    def _gather(self, flat: torch.Tensor, params: list[nn.Parameter]) -> torch.Tensor:
        """`flat`'s entries for `params`, in their order (a copy)."""
        return torch.cat([flat[o : o + n] for o, n in (self.slots[id(p)] for p in params)])

    def _scatter(self, flat: torch.Tensor, params: list[nn.Parameter], values: torch.Tensor) -> None:
        """Write `values` (in `params`' order) into `flat`'s entries for `params`."""
        at = 0
        for p in params:
            o, n = self.slots[id(p)]
            flat[o : o + n].copy_(values[at : at + n])
            at += n

    def consensus(self, params: list[nn.Parameter]) -> None:
        average_params(params, category=self.scope.category)

    def state(self) -> dict[str, Any]:
        figures = self.network.state() if self.network is not None else {}
        rounds = {"sync/outer_rounds": self.rounds, "sync/pseudo_grad_norm": self.last_norm}
        return {"sync/period": self.period, **rounds, **figures}

    def state_dict(self) -> dict[str, Any]:
        return {
            "period": self.period,
            "next_sync": self.next_sync,
            "outer_rounds": self.rounds,
            "diloco_anchor": self.anchor.clone(),
            "diloco_momentum": self.buf.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After bind (the vectors' size and device) and the replica's weights (they differ from the anchor)."""
        self.period = int(state.get("period", self.period))
        self.next_sync = int(state.get("next_sync", self.next_sync))
        self.rounds = int(state.get("outer_rounds", 0))
        for key, own in (("diloco_anchor", self.anchor), ("diloco_momentum", self.buf)):
            saved = state.get(key)
            if saved is None:  # the replicas may differ here: no anchor of their own would make them meet again
                raise ValueError(f"the checkpoint holds no {key}: it was not saved by sync.mixer.kind=diloco")
            if saved.shape != own.shape:
                raise ValueError(f"{key} holds {saved.numel()} values, this replica trains {own.numel()} parameters")
            own.copy_(saved)  # onto the replica's device: checkpoints load on the CPU
