"""The explicit registry that selects a sync strategy (a dict, no registry magic)."""

from __future__ import annotations

from ragtrain.config import SyncConfig
from ragtrain.sync.async_ps import AsyncPSSync
from ragtrain.sync.base import SyncStrategy
from ragtrain.sync.compressed import CompressedSync
from ragtrain.sync.ddp import DDPSync
from ragtrain.sync.gossip import GossipSync
from ragtrain.sync.hierarchical import HierarchicalSync
from ragtrain.sync.local_sgd import LocalSGDSync
from ragtrain.sync.vector_avg import VectorAvgSync


def build_sync(cfg: SyncConfig, node_ids: list[str] | None = None) -> SyncStrategy:
    """The strategy named by sync.strategy; node_ids[rank] = that rank's node (hierarchical groups by node)."""
    strategies = {
        "ddp": DDPSync,
        "local_sgd": LocalSGDSync,
        "compressed": CompressedSync,
        "gossip": GossipSync,
        "hierarchical": lambda c: HierarchicalSync(c, node_ids),
        "async_ps": AsyncPSSync,
        "vector_avg": VectorAvgSync,
    }
    if cfg.strategy not in strategies:
        raise ValueError(f"sync.strategy={cfg.strategy!r} is unknown; valid choices: {sorted(strategies)}")
    return strategies[cfg.strategy](cfg)
