"""A sync strategy composed of a gradient REDUCER, a parameter MIXER and a SCOPE (ragtrain.config.sync.SyncConfig).

Reducer (every step, a DDP comm hook): a class in reducers/, named in ragtrain.config.sync.REDUCERS.
Mixer (after optimizer steps): a class in mixers/, named in MIXERS.
Consensus (end of training): a class in consensus/, named in CONSENSUS.
Scope: the ranks the reducer spans (scopes/, REDUCER_SCOPES: every rank, inside each Ray node, or two_level),
the ranks the mixer spans (MIXER_SCOPES: every rank, or across nodes), and `reducer_params`, the parameters (by
name) the reducer applies to, the mixer taking all the others.

Layer-wise (`reducer_params`): the reducer averages only the matching parameters' slices of each DDP bucket, in
one all-reduce (2(W-1)/W * 4 * their size, `grad`); the other parameters keep this worker's gradient and the
mixer averages them every `period` steps (2(W-1)/W * 4 * their size, `params`).

The conf/sync/*.yaml presets (ddp, powersgd, local_sgd, hierarchical, hybrid_powersgd, layerwise, ...) are
compositions of these parts. docs/adding-a-variant.md says how to add a reducer, a mixer or a scope.
"""

# no `from __future__ import annotations`: DDP checks the comm hook's GradBucket annotation at run time
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ragtrain.config.sync import CONSENSUS, MIXER_SCOPES, MIXERS, REDUCER_SCOPES, REDUCERS, SyncConfig
from ragtrain.sync.base import SyncStrategy, ddp, world_size
from ragtrain.sync.consensus.base import build_consensus
from ragtrain.sync.mixers.base import build_mixer
from ragtrain.sync.reducers.allreduce import AllReduce
from ragtrain.sync.reducers.base import SliceReducer, done
from ragtrain.sync.scopes.base import (
    MixerScope,
    ReducerScope,
    build_mixer_scope,
    build_reducer_scope,
    layout,
    matching_params,
)


def build_sync(cfg: SyncConfig, node_ids: list[str] | None = None) -> SyncStrategy:
    """The strategy `cfg` composes; node_ids[rank] = that rank's Ray node (node scopes group ranks by it)."""
    return ComposedSync(cfg, node_ids)


class ComposedSync:
    """Reducer + mixer + scope behind the SyncStrategy Protocol (base.py)."""

    def __init__(self, cfg: SyncConfig, node_ids: list[str] | None = None):
        self.cfg = cfg
        self.device = torch.device("cpu")  # wrap() sets the replica's device
        r, m, s = cfg.reducer, cfg.mixer, cfg.scope
        self.gather_negatives = not MIXERS[m.kind].asynchronous  # a gather would make async workers wait
        self.keeps_replicas = CONSENSUS[cfg.consensus].keeps_replicas
        self.end = build_consensus(cfg.consensus)
        self.sends = REDUCERS[r.kind].sends
        reducer_scope: type[ReducerScope] = REDUCER_SCOPES[s.reducer].load()
        mixer_scope: type[MixerScope] = MIXER_SCOPES[s.mixer].load()
        self.by_node = reducer_scope.by_node or mixer_scope.by_node
        # Every rank creates every subgroup (a collective call), in the same order: the node groups, then the scope's
        self.layout = layout(node_ids, self.by_node)
        self.scope = build_reducer_scope(self.layout, r, s.reducer)
        self.mixer = build_mixer(m, build_mixer_scope(self.layout, s.mixer))
        self.warmup = self.mixer.warmup
        self.warmup_reducer = AllReduce(None, None, "grad")  # post-local SGD: DDP's exact all-reduce first
        self.steps_done = 0
        self.reduced: set[int] | None = None  # data_ptrs the reducer covers (None: every parameter)

    # --- set-up
    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        self.device = device  # where a restored residual or PowerSGD memory must live (checkpoints load on the CPU)
        if self.cfg.scope.reducer_params:
            self.reduced = matching_params(model, self.cfg.scope.reducer_params)
        self.mixer.bind(model)
        if world_size() == 1 or (not self.sends and not self.warmup):
            return model  # gradients stay local
        wrapped = ddp(model, device, self.cfg.bucket_cap_mb)
        if self.scope.reducer is not None:
            self.scope.reducer.bind(model)
        wrapped.register_comm_hook(None, self._hook)
        return wrapped

    # --- the reducer (DDP comm hook)
    def _hook(self, _: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self.steps_done < self.warmup:
            return self.warmup_reducer.hook(bucket)
        if self.reduced is not None:
            return self._subset(bucket, self.reduced)
        return self.scope.hook(bucket)

    def _subset(self, bucket: dist.GradBucket, reduced: set[int]) -> torch.futures.Future[torch.Tensor]:
        """Average only the `reduced` parameters' slices of the bucket; the others keep the local gradient."""
        buf, at, slices = bucket.buffer(), 0, []
        for p in bucket.parameters():  # the buffer is these parameters' gradients, in this order
            if p.data_ptr() in reduced:
                slices.append((at, p.numel()))
            at += p.numel()
        # the config checks allow reducer_params only with scope.reducer=all and a reducer that reduces slices
        cast(SliceReducer, self.scope.reducer).reduce_slices(buf, slices)
        return done(buf)

    def gradient_groups(self, step: int) -> list[list[int]] | None:
        """None (the global mean loss) while every replica applies the global mean gradient; the node groups with
        an intra-node reducer; else each replica its own loss (replicas step apart)."""
        if step < self.warmup:
            return None
        if self.cfg.scope.reducer_params:  # the mixer's parameters train apart
            return [[r] for r in range(world_size())]
        return self.scope.gradient_groups()

    def clip_groups(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """Every parameter together, or (scope.reducer_params) the reducer's and the mixer's apart: the reducer's
        gradients are equal on every rank, so their norm, and so their clip coefficient, is too."""
        if self.reduced is None:
            return [params]
        mixed = self._mixed(params)
        return [g for g in ([p for p in params if p.data_ptr() in self.reduced], mixed) if g]

    # --- the mixer
    def _mixed(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters the mixer owns: every one, or those outside scope.reducer_params."""
        return params if self.reduced is None else [p for p in params if p.data_ptr() not in self.reduced]

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        self.steps_done = step + 1
        self.mixer.after_step(self._mixed(params), step)

    def consensus(self, params: list[nn.Parameter]) -> None:
        """The consensus rule's end state where replicas can differ (any mixer, an intra-node or partial reducer,
        none): the parameter mean, or (vectors) every replica kept."""
        if self.cfg.replicas_equal:
            return  # nothing differs
        self.end.form(self.mixer, self._mixed(params))

    # --- figures and checkpoints
    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sync/nodes": self.layout.num_nodes} if self.by_node else {}
        return {**out, **self.mixer.state()}

    def state_dict(self) -> dict[str, Any]:
        """Steps done, the mixer's schedule (async_ps: the server's snapshot) and the reducer's memories."""
        out: dict[str, Any] = {"steps_done": self.steps_done, **self.mixer.state_dict()}
        if self.scope.reducer is not None:
            out.update(self.scope.reducer.state_dict())
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps_done = int(state.get("steps_done", self.steps_done))
        self.mixer.load_state_dict(state)
        if self.scope.reducer is not None:
            self.scope.reducer.load_state_dict(state, self.device)
