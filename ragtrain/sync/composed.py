"""A sync strategy composed of a gradient REDUCER, a parameter MIXER and a SCOPE (ragtrain.config.SyncConfig).

Reducer (every step, a DDP comm hook; reducers.py): none | allreduce | fp16 | bf16 | powersgd | topk.
Mixer (after optimizer steps): none | average every `period` (local SGD, optionally adaptive, after a DDP warm-up)
| gossip | async_ps (a Ray actor parameter server, async_ps.py).
Scope: the reducer over every rank (`all`), inside each Ray node only (`intra_node`, nodes from the workers' Ray
node ids), or `two_level`; the mixer over every rank or across nodes (`inter_node`); and `reducer_params`, the
parameters (by name) the reducer applies to, the mixer taking all the others.

two_level ("hybrid"): each step every bucket is first averaged inside the node with an exact fp32 all-reduce
(2(n-1)/n * 4B bytes, n workers on the node, B entries: category `grad_intra`), then `reducer.kind` runs across
nodes on the node-mean gradient, among the workers of equal local rank (one per node, N nodes): every such
cross-node group holds the same inputs, so all of them compute the same result and every replica applies the
global mean gradient (PowerSGD: 2(N-1)/N * 4 * (r(n+m) per compressed matrix + the vectors), category
`grad_inter`). Every worker sends on the inter-node links once, with N-party rings (N < W).

Layer-wise (`reducer_params`): the reducer averages only the matching parameters' slices of each DDP bucket, in
one all-reduce (2(W-1)/W * 4 * their size, `grad`); the other parameters keep this worker's gradient and the
mixer averages them every `period` steps (2(W-1)/W * 4 * their size, `params`).

The conf/sync/*.yaml presets (ddp, powersgd, local_sgd, hierarchical, hybrid_powersgd, layerwise, ...) are
compositions of these parts; the classes in ddp.py, compressed.py, local_sgd.py, ... are names for presets.
"""

# no `from __future__ import annotations`: DDP checks the comm hook's GradBucket annotation at run time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ragtrain.config import SyncConfig
from ragtrain.sync.base import average_params, ddp, world_size
from ragtrain.sync.comm import all_reduce_bytes, counted_future
from ragtrain.sync.mixers import mix_with_peers, neighbours
from ragtrain.sync.reducers import (
    TopK,
    cast_hook,
    counting_allreduce_hook,
    done,
    load_powersgd_state,
    powersgd_hook,
    powersgd_state,
    powersgd_state_dict,
    reduce_slices,
)
from ragtrain.sync.scope import counterparts, matching_params, node_groups


class ComposedSync:
    """Reducer + mixer + scope behind the SyncStrategy Protocol (base.py)."""

    def __init__(self, cfg: SyncConfig, node_ids: list[str] | None = None):
        self.cfg = cfg
        self.device = torch.device("cpu")  # wrap() sets the replica's device
        r, m, s = cfg.reducer, cfg.mixer, cfg.scope
        self.gather_negatives = m.kind != "async_ps"  # a gather would make async workers wait for each other
        self.keeps_replicas = cfg.consensus == "vectors"
        w = world_size()
        self.rank = dist.get_rank() if w > 1 else 0
        self.groups = node_groups(node_ids or ["local"] * w)
        self.my_group = next(g for g in self.groups if self.rank in g)
        self.local_rank = self.my_group.index(self.rank)
        self.node_group = self.cross_group = None
        by_node = s.reducer in ("intra_node", "two_level") or s.mixer == "inter_node"
        if w > 1 and by_node:
            # Every rank must create every subgroup (collective call), in the same order.
            self.node_group, _ = dist.new_subgroups_by_enumeration(ranks_per_subgroup_list=self.groups)
        if w > 1 and s.reducer == "two_level" and self.num_nodes > 1:
            self.cross_group, _ = dist.new_subgroups_by_enumeration(ranks_per_subgroup_list=counterparts(self.groups))
        self.warmup = m.warmup_steps or 0
        self.period = m.period or 1
        self.next_sync = self.warmup + self.period  # step count (1-based) of the next averaging round
        self.steps_done = 0
        self.last_divergence = 0.0
        self.rounds = 0
        self.reduced: set[int] | None = None  # data_ptrs the reducer covers (None: every parameter)
        self.powersgd = None
        inter = "grad_inter" if s.reducer == "two_level" else "grad"
        self.topk = TopK(r.ratio, r.error_feedback, self.cross_group, inter) if r.kind == "topk" else None
        self.ps = None
        if m.kind == "async_ps":
            # lazy: ragtrain.sync.async_ps imports ray; this module imports without it
            from ragtrain.sync.async_ps import AsyncPSSync

            self.ps = AsyncPSSync(m)  # reads mixer.max_staleness

    @property
    def num_nodes(self) -> int:
        return len(self.groups)

    # --- set-up
    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        r, s = self.cfg.reducer, self.cfg.scope
        self.device = device  # where a restored residual or PowerSGD memory must live (checkpoints load on the CPU)
        if s.reducer_params:
            self.reduced = matching_params(model, s.reducer_params)
        if self.ps is not None:
            return self.ps.wrap(model, device)
        if world_size() == 1 or (r.kind == "none" and not self.warmup):
            return model  # gradients stay local
        wrapped = ddp(model, device, self.cfg.bucket_cap_mb)
        if r.kind == "powersgd" and (s.reducer == "all" or self.cross_group is not None):
            self.powersgd = powersgd_state(
                r.matrix_rank, r.start_iter, r.error_feedback, self.cross_group if s.reducer == "two_level" else None
            )
        if self.topk is not None:
            self.topk.bind(list(model.parameters()))
        wrapped.register_comm_hook(None, self._hook)
        return wrapped

    # --- the reducer (DDP comm hook)
    def _hook(self, _: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self.steps_done < self.warmup:
            return counting_allreduce_hook("grad", bucket)  # post-local SGD: DDP first
        kind, scope = self.cfg.reducer.kind, self.cfg.scope.reducer
        if kind == "none":
            return done(bucket.buffer())  # local step: keep this worker's own gradient, send nothing
        if self.reduced is not None:
            return self._subset(bucket, kind)
        if scope == "all":
            return self._reduce(bucket, kind, None, "grad")
        if scope == "intra_node":
            return self._intra(bucket)
        self._intra(bucket).wait()  # two_level: the node mean first (in place), then across nodes
        if self.cross_group is None:
            return done(bucket.buffer())  # one node: the node mean is the global mean
        return self._reduce(bucket, kind, self.cross_group, "grad_inter")

    def _reduce(self, bucket: dist.GradBucket, kind: str, group: Any, category: str):
        if kind == "allreduce":
            return counting_allreduce_hook(category, bucket, group)
        if kind in ("fp16", "bf16"):
            return cast_hook(torch.float16 if kind == "fp16" else torch.bfloat16, category, bucket, group)
        if kind == "powersgd":
            return powersgd_hook(self.powersgd, bucket, category)
        return self.topk.hook(None, bucket)

    def _intra(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Average the bucket inside this node (category grad_intra)."""
        buf = bucket.buffer()
        n = len(self.my_group)
        if n == 1:
            return done(buf)
        nbytes = all_reduce_bytes(buf.numel() * buf.element_size(), n)
        buf.div_(n)
        fut = dist.all_reduce(buf, group=self.node_group, async_op=True).get_future().then(lambda f: f.value()[0])
        return counted_future(fut, "grad_intra", nbytes)

    def _subset(self, bucket: dist.GradBucket, kind: str) -> torch.futures.Future[torch.Tensor]:
        """Average only the reducer's parameters' slices of the bucket; the others keep the local gradient."""
        buf, at, slices = bucket.buffer(), 0, []
        for p in bucket.parameters():  # the buffer is these parameters' gradients, in this order
            if p.data_ptr() in self.reduced:
                slices.append((at, p.numel()))
            at += p.numel()
        reduce_slices(buf, slices, kind, "grad")
        return done(buf)

    def gradient_groups(self, step: int) -> list[list[int]] | None:
        """None (the global mean loss) while every replica applies the global mean gradient; the node groups with
        an intra-node reducer; else each replica its own loss (replicas step apart)."""
        s = self.cfg.scope
        if step < self.warmup:
            return None
        if self.cfg.reducer.kind != "none" and s.reducer in ("all", "two_level") and not s.reducer_params:
            return None
        if s.reducer == "intra_node":
            return None if self.num_nodes == 1 else [list(g) for g in self.groups]
        return [[r] for r in range(world_size())]

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

    @property
    def _category(self) -> str:
        return "params_inter" if self.cfg.scope.mixer == "inter_node" else "params"

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        self.steps_done = step + 1
        m = self.cfg.mixer
        if self.ps is not None:
            self.ps.after_step(params, step)
        elif m.kind == "average" and self.steps_done >= self.next_sync:
            if self.cfg.scope.mixer == "all" or self.num_nodes > 1:
                self.last_divergence = average_params(self._mixed(params), category=self._category)
                if m.adaptive:
                    if self.last_divergence > 2 * m.target_divergence:
                        self.period = max(1, self.period // 2)
                    elif self.last_divergence < m.target_divergence / 2:
                        self.period = min(m.max_period, self.period * 2)
            self.next_sync = self.steps_done + self.period
        elif m.kind == "gossip" and self.steps_done % m.period == 0:
            self._gossip(self._mixed(params))

    def _gossip(self, params: list[nn.Parameter]) -> None:
        m = self.cfg.mixer
        if self.cfg.scope.mixer == "inter_node":  # the same-local-rank worker on the previous and next node
            nodes = neighbours(self.groups.index(self.my_group), self.num_nodes, "ring", 0)
            peers = [self.groups[n][self.local_rank] for n in nodes if self.local_rank < len(self.groups[n])]
        else:
            w = world_size()
            peers = neighbours(self.rank, w, m.topology, self.rounds)
        self.rounds += 1
        mix_with_peers(params, peers, m.mixing, self._category)

    def consensus(self, params: list[nn.Parameter]) -> None:
        """The parameter mean where replicas can differ (any mixer, an intra-node or partial reducer, none)."""
        s = self.cfg.scope
        if self.ps is not None:
            self.ps.consensus(params)
        elif self.keeps_replicas:
            pass  # the consensus is formed on the vectors, after training
        elif self.cfg.mixer.kind != "none" or self.cfg.reducer.kind == "none" or s.reducer == "intra_node":
            average_params(self._mixed(params), category=self._category)

    # --- figures and checkpoints
    def state(self) -> dict[str, Any]:
        m, s = self.cfg.mixer, self.cfg.scope
        out: dict[str, Any] = {}
        if self.ps is not None:
            return self.ps.state()
        if s.reducer != "all" or s.mixer != "all":
            out["sync/nodes"] = self.num_nodes
        if m.kind == "average":
            out.update({"sync/period": self.period, "sync/divergence_at_sync": self.last_divergence})
        if m.kind == "gossip":
            out["sync/gossip_rounds"] = self.rounds
        return out

    def state_dict(self) -> dict[str, Any]:
        """Mixer schedule, top-k residuals and PowerSGD's memories (async_ps: the server's snapshot)."""
        if self.ps is not None:
            return self.ps.state_dict()
        out: dict[str, Any] = {
            "period": self.period,
            "next_sync": self.next_sync,
            "steps_done": self.steps_done,
            "last_divergence": self.last_divergence,
            "rounds": self.rounds,
        }
        if self.topk is not None:
            out["topk_by_param"] = dict(self.topk.residuals)
        if self.powersgd is not None:
            out["powersgd"] = powersgd_state_dict(self.powersgd)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.ps is not None:
            return self.ps.load_state_dict(state)
        self.period = int(state.get("period", self.period))
        self.next_sync = int(state.get("next_sync", self.next_sync))
        self.steps_done = int(state.get("steps_done", self.steps_done))
        self.last_divergence = float(state.get("last_divergence", 0.0))
        self.rounds = int(state.get("rounds", 0))
        if self.topk is not None:  # older checkpoints keyed residuals by DDP bucket ("topk"): dropped
            self.topk.residuals = {int(i): r.to(self.device) for i, r in state.get("topk_by_param", {}).items()}
        if self.powersgd is not None and "powersgd" in state:  # wrap() has created PowerSGD's state
            load_powersgd_state(self.powersgd, state["powersgd"], self.device)
