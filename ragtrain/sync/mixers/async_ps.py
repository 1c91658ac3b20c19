"""Mixer `async_ps`: an asynchronous parameter server as a Ray actor, with bounded staleness.

Each worker steps its own replica, pushes the change (delta since its last push) to the server and keeps going:
it waits only for the server's acknowledgement, never for the other workers. Staleness of a push = the number of
OTHER workers' updates the server applied since this worker last pulled. The server refuses a push whose
staleness would exceed `max_staleness` (counted as `rejected`; the worker then pulls and carries on), and a worker
pulls fresh weights as soon as its staleness reaches the bound, so no applied update is ever staler than
`max_staleness`. In-batch negatives stay on the worker: gathering them across workers would be a barrier.
Bytes of a worker = its pushes (fp32 deltas, category `params`) and its pulls (the full fp32 parameters the
server sends it, category `params_pull`), each timed from the call to the answer.

Restart: the server is part of the checkpoint. Rank 0's `state_dict` holds the server's parameters and version;
`load_state_dict` (after the replicas are restored) puts them back into the server started by `bind`, and every
worker's anchor becomes its restored replica, so the first push after a restart carries only the new progress.
"""

import uuid
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist
from ray.actor import ActorHandle
from torch import nn

from ragtrain.config.sync import MixerConfig
from ragtrain.runtime.errors import filled
from ragtrain.sync.base import flat_params, set_flat_params, world_size
from ragtrain.sync.comm import STATS
from ragtrain.sync.scopes.base import MixerScope


@ray.remote(num_cpus=0)
class ParameterServer:
    """Holds the global parameters; applies pushes in arrival order."""

    def __init__(self, params: np.ndarray, world: int, max_staleness: int):
        self.params = params.copy()
        self.version = 0
        self.max_staleness = max_staleness
        self.others_since_pull = [0] * world
        self.applied_staleness: list[int] = []
        self.rejected = 0

    def push(self, rank: int, delta: np.ndarray) -> tuple[bool, int]:
        """Apply `delta` unless too stale; returns (accepted, this worker's staleness after the push)."""
        staleness = self.others_since_pull[rank]
        if staleness > self.max_staleness:
            self.rejected += 1
            return False, staleness
        self.params += delta
        self.version += 1
        self.applied_staleness.append(staleness)
        for r in range(len(self.others_since_pull)):
            if r != rank:
                self.others_since_pull[r] += 1
        return True, staleness

    def pull(self, rank: int) -> np.ndarray:
        """Fresh global parameters for `rank` (its staleness resets to 0)."""
        self.others_since_pull[rank] = 0
        return self.params

    def snapshot(self) -> tuple[np.ndarray, int]:
        """(parameters, version) without touching anyone's staleness: what a checkpoint stores."""
        return self.params.copy(), self.version

    def restore(self, params: np.ndarray, version: int) -> None:
        """Continue from a checkpoint's snapshot: its parameters and version, nobody stale."""
        self.params, self.version = params.copy(), version
        self.others_since_pull = [0] * len(self.others_since_pull)

    def stats(self) -> dict[str, float]:
        """Server-side figures: versions applied, rejected pushes, the largest applied staleness."""
        return {
            "ps/version": self.version,
            "ps/rejected": self.rejected,
            "ps/max_applied_staleness": max(self.applied_staleness, default=0),
            "ps/mean_applied_staleness": float(np.mean(self.applied_staleness)) if self.applied_staleness else 0.0,
        }


class AsyncPS:
    """Mixer `async_ps`: workers push deltas to / pull weights from a ParameterServer actor; no collective in the
    training step (the config checks require reducer.kind=none, and no negatives are gathered across workers)."""

    warmup = 0

    def __init__(self, cfg: MixerConfig, scope: MixerScope | None = None):  # reads max_staleness; every rank
        self.cfg = cfg
        self.max_staleness = filled(cfg.max_staleness, "sync.mixer.max_staleness")
        self.server: ActorHandle | None = None  # the ParameterServer actor: bind starts it (rank 0) or finds it
        self.anchor: torch.Tensor | None = None  # the parameters at the last push or pull: set by bind
        self.rank = dist.get_rank() if world_size() > 1 else 0
        self.pulls = 0
        self.params: list[nn.Parameter] = []

    def bind(self, model: nn.Module) -> None:
        # Rank 0 starts the server from the (identical) initial weights; the others look it up by name.
        flat = flat_params([p for p in model.parameters() if p.requires_grad])  # LoRA: the adapters only
        name = [f"ragtrain-ps-{uuid.uuid4().hex[:12]}" if self.rank == 0 else None]
        if self.rank == 0:
            # @ray.remote made the class an actor class: mypy does not apply class decorators
            self.server = ParameterServer.options(name=name[0]).remote(  # type: ignore[attr-defined]
                flat.cpu().numpy(), world_size(), self.max_staleness
            )
        if world_size() > 1:
            dist.broadcast_object_list(name, src=0)
            dist.barrier()  # the named actor exists before anyone looks it up
            if self.rank != 0:
                self.server = ray.get_actor(name[0])
        self.anchor = flat
        self.params = [
            p for p in model.parameters() if p.requires_grad
        ]  # load_state_dict re-anchors on the restored replica

    def _server(self) -> ActorHandle:
        if self.server is None:
            raise RuntimeError("async_ps: bind(model) starts the parameter server before any step")
        return self.server

    def _pull(self, params: list[nn.Parameter]) -> None:
        start = STATS.clock()
        # The server holds numpy arrays: the replica (on a GPU, too) gets them back on its own device
        fresh = torch.from_numpy(np.array(ray.get(self._server().pull.remote(self.rank)))).to(params[0].device)
        # The server sends the full parameters on this worker's behalf: counted here, like a push.
        STATS.add("params_pull", fresh.numel() * fresh.element_size(), start=start)
        set_flat_params(params, fresh)
        self.anchor = fresh
        self.pulls += 1

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        if self.anchor is None:
            raise RuntimeError("async_ps: bind(model) sets the anchor before any step")
        flat = flat_params(params)
        delta = flat - self.anchor
        start = STATS.clock()
        accepted, staleness = ray.get(self._server().push.remote(self.rank, delta.cpu().numpy()))
        STATS.add("params", delta.numel() * delta.element_size(), start=start)
        self.anchor = flat
        if not accepted or staleness + 1 > self.max_staleness:
            self._pull(params)  # the next push could exceed the bound: refresh now

    def consensus(self, params: list[nn.Parameter]) -> None:
        if world_size() > 1:
            dist.barrier()  # every push is in before anyone reads the final weights
        self._pull(params)
        if world_size() > 1:
            dist.barrier()  # everyone has read them before rank 0 may stop the server

    def state(self) -> dict[str, Any]:
        return {"sync/pulls": self.pulls, **ray.get(self._server().stats.remote())}

    def state_dict(self) -> dict[str, Any]:
        """Rank 0: the server's parameters and version (pushes in flight at a failure are lost); others: nothing."""
        if self.rank != 0:
            return {}
        params, version = ray.get(self._server().snapshot.remote())
        return {"server_params": torch.from_numpy(np.array(params)), "server_version": version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the replicas are restored: the server continues from the checkpoint, each anchor from its replica.

        `bind` started the server from the initial weights; without this every worker's first push would carry
        theta_ckpt - theta_init, and the progress before the checkpoint would be applied once per worker.
        """
        if self.rank == 0:
            saved = state.get("server_params")
            # A checkpoint without a server snapshot: rank 0's restored replica is the best estimate.
            params = saved if saved is not None else flat_params(self.params)
            ray.get(self._server().restore.remote(params.cpu().numpy(), int(state.get("server_version", 0))))
        if world_size() > 1:
            dist.barrier()  # nobody pushes before the server holds the checkpoint's parameters
        self.anchor = flat_params(self.params)
