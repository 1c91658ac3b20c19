"""`refresh.consistency=global`: every shard builds the round's index under a new tag; the service switches every
search to that tag at once, after the last shard is done. Searches never mix the versions of a round.

A shard that restarts before the barrier lost its new rows: the round fails, and searches keep the old tag, which
the restarted shard rebuilt from its persisted (older) rows: still one version everywhere. Every shard journals its
staged round before the barrier (`LiveRows.journal`): one that dies between the barrier and its apply finishes the
journaled round when the service restarts its rows (the apply retried on the restarted actor), so every shard
ends on the new version, and no search mixes the two."""

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
        with service._barrier:  # a shard restarted meanwhile (by a search) waits for the barrier's outcome
            try:  # each shard journals its staged round, then builds it (not yet searched)
                service.call_shards(shards, "live_build", tag, {}, v)
            except Exception:
                for i in shards:  # free the new builds and journals that were made; the old tag stays searched
                    service.actors[i].live_discard.remote(tag)
                raise
            # the barrier, the commit point: every search from now on sees version v everywhere, and a shard
            # restarted from here on finishes its journaled round of v (service._start passes encoder_version)
            old, service.tag = service.tag, tag
            service.encoder_version = v
        service.call_shards(shards, "live_apply", v, service.spec.fault.kill_shard_before_apply)
        states = [service.publish_state(step, qvecs, fresh, {})]
        service.call_shards(shards, "drop", old)
        return encoded, states
