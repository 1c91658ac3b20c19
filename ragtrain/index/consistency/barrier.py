"""`refresh.consistency=global`: every shard builds the round's index under a new tag; the service switches every
search to that tag at once, after the last shard is done. Searches never mix the versions of a round.

A shard that restarts before the barrier lost its new rows: the round fails, and searches keep the old tag, which
the restarted shard rebuilt from its persisted (older) rows: still one version everywhere."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ragtrain.index.consistency.base import ConsistencyPolicy, Landed

if TYPE_CHECKING:
    from ragtrain.index.refresh_service import RefreshService


class Global(ConsistencyPolicy):
    def land(
        self,
        service: RefreshService,
        v: int,
        step: int,
        qvecs: np.ndarray,
        fresh: np.ndarray,
        encoding: dict[Any, tuple],
    ) -> Landed:
        encoded = {i: service.encoded(ref, i, args) for ref, (i, args) in encoding.items()}
        shards = list(range(len(service.actors)))
        tag = f"live{v}"
        try:
            service.call_shards(shards, "live_build", tag, {}, v)
        except Exception:
            for i in shards:  # free the new builds that were made; the old tag stays searched
                service.actors[i].drop.remote(tag)
            raise
        old, service.tag = service.tag, tag  # the barrier: every search from now on sees version v everywhere
        service.encoder_version = v
        service.call_shards(shards, "live_apply", v)
        states = [service.publish_state(step, qvecs, fresh, {})]
        service.call_shards(shards, "drop", old)
        return encoded, states
