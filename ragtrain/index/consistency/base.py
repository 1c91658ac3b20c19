"""What a consistency policy is: when a refresh round's new rows become searchable, shard by shard.

A policy gets the round in flight (every shard re-encoding its share: `encoding`, {ObjectRef: (shard, its call's
arguments)}) and lands it through the refresh service (`ragtrain/index/refresh_service.py`): it waits for the
shards' encodes (`service.encoded`), applies and rebuilds them (`service.call_shards`), moves the searched build
(`service.tag`, `service.encoder_version`) and publishes every state searches can see (`service.publish_state`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from ragtrain.config import RefreshConfig
    from ragtrain.index.refresh_service import RefreshService

# {shard: its encode's stats}, and the states published (one per state searches could see)
Landed = tuple[dict[int, dict], list[dict]]


class ConsistencyPolicy(Protocol):
    """One `refresh.consistency` value (registered by name in `ragtrain.index.consistency.POLICIES`)."""

    # True: every encoder version also encodes `refresh.anchors` passages (a map between versions is fitted on them)
    needs_anchors: bool = False

    def land(
        self,
        service: RefreshService,
        v: int,
        step: int,
        qvecs: np.ndarray,
        fresh: np.ndarray,
        encoding: dict[Any, tuple],
    ) -> Landed:
        """Make round `v`'s new rows searchable as the policy says; returns what `Landed` says."""
        ...

    def check(self, refresh: RefreshConfig, dim: int, rows: int) -> None:
        """Refuse (ConfigError naming the key) settings this policy cannot run with, before any work."""
        return None  # the default for subclasses: every setting runs (a body, so the method is not abstract)
