"""`hierarchical`: gradient all-reduce inside each node every step; across nodes only every `period` steps.

Node membership comes from the caller (the Ray Train worker's node id, gathered from all ranks). Intra-node
traffic rides the fast local links (shared memory / NVLink) every step; the slow inter-node links carry a
parameter exchange every `period` steps: `inter_node: average` (global parameter mean; with identical replicas
inside a node this is the mean over nodes) or `gossip` (mix with the same-local-rank worker of the neighbouring
nodes on a ring of nodes). Bytes are counted separately as `grad_intra` and `params_inter`.
"""

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ragtrain.config import SyncConfig
from ragtrain.sync.base import average_params, ddp, world_size
from ragtrain.sync.comm import all_reduce_bytes, counted_future
from ragtrain.sync.gossip import mix_with_peers, neighbours


def node_groups(node_ids: list[str]) -> list[list[int]]:
    """Ranks grouped by node, nodes ordered by their lowest rank."""
    groups: dict[str, list[int]] = {}
    for rank, node in enumerate(node_ids):
        groups.setdefault(node, []).append(rank)
    return list(groups.values())


class HierarchicalSync:
    """Intra-node DDP every step + inter-node averaging or gossip every `period` steps."""

    gather_negatives = True
    keeps_replicas = False

    def __init__(self, cfg: SyncConfig, node_ids: list[str] | None = None):
        self.cfg = cfg
        w = world_size()
        self.groups = node_groups(node_ids or ["local"] * w)
        rank = dist.get_rank() if w > 1 else 0
        self.my_group = next(g for g in self.groups if rank in g)
        self.local_rank = self.my_group.index(rank)
        self.subgroup = None
        if w > 1:
            # Every rank must create every subgroup (collective call), in the same order.
            self.subgroup, _ = dist.new_subgroups_by_enumeration(ranks_per_subgroup_list=self.groups)

    @property
    def num_nodes(self) -> int:
        return len(self.groups)

    def _intra_hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        n = len(self.my_group)
        if n == 1:
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(buf)
            return fut
        nbytes = all_reduce_bytes(buf.numel() * buf.element_size(), n)
        buf.div_(n)
        fut = dist.all_reduce(buf, group=self.subgroup, async_op=True).get_future().then(lambda f: f.value()[0])
        return counted_future(fut, "grad_intra", nbytes)

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        if world_size() == 1:
            return model
        wrapped = ddp(model, device, self.cfg.bucket_cap_mb)
        wrapped.register_comm_hook(None, self._intra_hook)
        return wrapped

    def _gossip_nodes(self, params: list[nn.Parameter]) -> None:
        """Mix with the same-local-rank worker on the previous and next node of the node ring."""
        nodes = neighbours(self.groups.index(self.my_group), self.num_nodes, "ring", 0)
        peers = [self.groups[n][self.local_rank] for n in nodes if self.local_rank < len(self.groups[n])]
        mix_with_peers(params, peers, self.cfg.mixing, "params_inter")

    def gradient_groups(self, step: int) -> Optional[list[list[int]]]:
        # Gradients are averaged inside a node only: each node optimises the mean loss of its own ranks.
        return None if self.num_nodes == 1 else [list(g) for g in self.groups]

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        if self.num_nodes == 1 or (step + 1) % self.cfg.period:
            return
        if self.cfg.inter_node == "gossip":
            self._gossip_nodes(params)
        else:
            average_params(params, category="params_inter")

    def consensus(self, params: list[nn.Parameter]) -> None:
        average_params(params, category="params_inter")

    def state(self) -> dict[str, Any]:
        return {"sync/nodes": self.num_nodes}

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing beyond the model and optimizer

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
