"""Builds the sync strategy a SyncConfig composes (reducer + mixer + scope; conf/sync/*.yaml are presets)."""

from __future__ import annotations

from ragtrain.config import SyncConfig
from ragtrain.sync.base import SyncStrategy
from ragtrain.sync.composed import ComposedSync


def build_sync(cfg: SyncConfig, node_ids: list[str] | None = None) -> SyncStrategy:
    """The composed strategy; node_ids[rank] = that rank's Ray node (node scopes group ranks by it)."""
    return ComposedSync(cfg, node_ids)
