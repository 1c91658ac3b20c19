"""`refresh.consistency=eager`: each shard's new rows are searched as soon as that shard is done, so searches see
several encoder versions at once (the inconsistency of an index distributed over nodes)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ragtrain.index.consistency.base import ConsistencyPolicy, Landed

if TYPE_CHECKING:
    from ragtrain.index.refresh_service import RefreshService


class Eager(ConsistencyPolicy):
    def land(
        self,
        service: RefreshService,
        v: int,
        step: int,
        qvecs: np.ndarray,
        fresh: np.ndarray,
        encoding: dict[Any, tuple],
    ) -> Landed:
        import ray  # lazy: the registry is read by the CLI's checks, which start without Ray

        from ragtrain.index.sharded import ShardUnavailableError  # lazy: it imports faiss and ray, as above

        encoded, states, pending = {}, [], list(encoding)
        deadline = time.monotonic() + service.spec.refresh.timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:  # the shards that landed keep their rows, as eager always allows
                late = sorted(encoding[r][0] for r in pending)
                raise ShardUnavailableError(
                    f"index shard{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not answer a live "
                    f"encode within "
                    f"{service.spec.refresh.timeout_s:g} s (refresh.timeout_s): it is stopped or its node is lost"
                )
            i, args = encoding[done[0]]
            encoded[i] = service.encoded(done[0], i, args)
            service.call_shards([i], "live_apply", v)
            service.encoder_version = v
            self.rebuild(service, i, v)
            states.append(service.publish_state(step, qvecs, fresh, {}))
        return encoded, states

    def rebuild(self, service: RefreshService, shard: int, v: int) -> None:
        """Make shard `shard`'s applied rows searchable: rebuild its live index."""
        service.call_shards([shard], "live_build", service.tag, {})
