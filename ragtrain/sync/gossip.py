"""`gossip`: every `period` steps each worker mixes its parameters with its neighbours' (no global barrier).

Round t: neighbours N(i) are the ring neighbours {i-1, i+1} or, with topology=random, one peer from a pairing
drawn with a seed shared by all workers (so pairs agree; an odd worker out skips the round). Each worker sends
its flat parameters to its neighbours (point-to-point) and sets
    theta_i <- (1 - mixing) * theta_i + mixing * mean_{j in N(i)} theta_j.
With a doubly stochastic mixing (ring, or pairs) the mean is preserved and replicas contract to it.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ragtrain.config import SyncConfig
from ragtrain.sync.base import average_params, flat_params, set_flat_params, world_size
from ragtrain.sync.comm import STATS


def neighbours(rank: int, world: int, topology: str, round_: int, seed: int = 0) -> list[int]:
    """Peers of `rank` in gossip round `round_` (the same answer on every worker)."""
    if world == 1:
        return []
    if topology == "ring":
        return sorted({(rank - 1) % world, (rank + 1) % world} - {rank})
    perm = np.random.default_rng([seed, round_]).permutation(world)
    pos = int(np.where(perm == rank)[0][0])
    peer = pos + 1 if pos % 2 == 0 else pos - 1
    return [int(perm[peer])] if peer < world else []


def mix_with_peers(params: list[nn.Parameter], peers: list[int], mixing: float, category: str) -> None:
    """Send my flat parameters to each peer, receive theirs, and move `mixing` of the way to their mean."""
    if not peers:
        return
    flat = flat_params(params)
    bufs = [torch.empty_like(flat) for _ in peers]
    with STATS.timed(category, flat.numel() * flat.element_size() * len(peers)):
        # post every send and receive before waiting on any: no ordering deadlock between peers
        reqs = [dist.isend(flat, p) for p in peers] + [dist.irecv(b, p) for b, p in zip(bufs, peers)]
        for r in reqs:
            r.wait()
    set_flat_params(params, (1 - mixing) * flat + mixing * torch.stack(bufs).mean(0))


class GossipSync:
    """Neighbour averaging every `period` steps; no gradient all-reduce."""

    gather_negatives = True
    keeps_replicas = False

    def __init__(self, cfg: SyncConfig):
        self.cfg = cfg
        self.rounds = 0

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model  # gradients stay local

    def gossip_round(self, params: list[nn.Parameter]) -> None:
        """One exchange with this round's neighbours."""
        w = world_size()
        peers = neighbours(dist.get_rank() if w > 1 else 0, w, self.cfg.topology, self.rounds)
        self.rounds += 1
        mix_with_peers(params, peers, self.cfg.mixing, "params")

    def gradient_groups(self, step: int) -> Optional[list[list[int]]]:
        return [[r] for r in range(world_size())]  # replicas train apart between rounds: each its own loss

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        if (step + 1) % self.cfg.period == 0:
            self.gossip_round(params)

    def consensus(self, params: list[nn.Parameter]) -> None:
        average_params(params)

    def state(self) -> dict[str, Any]:
        return {"sync/gossip_rounds": self.rounds}

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds}  # the random topology's pairing is keyed by the round

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds = int(state.get("rounds", 0))
