"""`gossip`: every `period` steps each worker mixes with its neighbours, point to point.

Round t: neighbours N(i) come from the topology (ragtrain/sync/topologies/: the ring neighbours {i-1, i+1}, or
with topology=random one peer from a pairing drawn with a seed shared by all workers), on the mixer scope's ring
(the ranks, or the nodes). Each worker sends its flat parameters to its neighbours and sets
    theta_i <- (1 - mixing) * theta_i + mixing * mean_{j in N(i)} theta_j.
With a doubly stochastic mixing (ring, or pairs) the mean is preserved and replicas contract to it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ragtrain.config.sync import MixerConfig
from ragtrain.runtime.errors import filled
from ragtrain.sync.base import average_params, flat_params, set_flat_params
from ragtrain.sync.comm import STATS
from ragtrain.sync.scopes.base import MixerScope
from ragtrain.sync.topologies.base import build_topology


class Gossip:
    warmup = 0

    def __init__(self, cfg: MixerConfig, scope: MixerScope):
        self.cfg, self.scope = cfg, scope
        self.topology = build_topology(filled(cfg.topology, "sync.mixer.topology"))
        self.period = filled(cfg.period, "sync.mixer.period")
        self.mixing = filled(cfg.mixing, "sync.mixer.mixing")
        self.rounds = 0

    def bind(self, model: nn.Module) -> None:
        pass

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        if (step + 1) % self.period:
            return
        position, size = self.scope.position()
        peers = self.scope.ranks(self.topology.neighbours(position, size, self.rounds))
        self.rounds += 1
        mix_with_peers(params, peers, self.mixing, self.scope.category)

    def consensus(self, params: list[nn.Parameter]) -> None:
        average_params(params, category=self.scope.category)

    def state(self) -> dict[str, Any]:
        return {"sync/gossip_rounds": self.rounds}

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds = int(state.get("rounds", 0))


def mix_with_peers(params: list[nn.Parameter], peers: list[int], mixing: float, category: str) -> None:
    """Send my flat parameters to each peer, receive theirs, and move `mixing` of the way to their mean."""
    if not peers:
        return
    flat = flat_params(params)
    bufs = [torch.empty_like(flat) for _ in peers]
    with STATS.timed(category, flat.numel() * flat.element_size() * len(peers)):
        # Every send and receive posted as one batch before waiting on any: separate isend/irecv calls deadlock
        # under NCCL once a message outgrows its buffers (both peers' sends queue ahead of their receives)
        ops = [dist.P2POp(dist.isend, flat, p) for p in peers] + [
            dist.P2POp(dist.irecv, b, p) for b, p in zip(bufs, peers)
        ]
        reqs = dist.batch_isend_irecv(ops)
        for r in reqs:
            r.wait()
    set_flat_params(params, (1 - mixing) * flat + mixing * torch.stack(bufs).mean(0))
