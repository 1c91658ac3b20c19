"""`ddp`: gradient all-reduce every step, the strongly consistent baseline (conf/sync/ddp.yaml: reducer allreduce,
no mixer). A name for that preset of ComposedSync; the hook lives in reducers.py."""

from __future__ import annotations

from ragtrain.config import SyncConfig, sync_preset
from ragtrain.sync.composed import ComposedSync
from ragtrain.sync.reducers import counting_allreduce_hook

__all__ = ["DDPSync", "counting_allreduce_hook"]


class DDPSync(ComposedSync):
    """ComposedSync with conf/sync/ddp.yaml (or the given config)."""

    def __init__(self, cfg: SyncConfig | None = None, node_ids: list[str] | None = None):
        super().__init__(cfg if cfg is not None else sync_preset("ddp"), node_ids)
