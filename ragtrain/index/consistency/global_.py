"""`refresh.consistency=global`: every shard builds the round's index under a new tag; the service switches every
search to that tag at once, after the last shard is done. Searches never mix the versions of a round.

A shard that restarts before the barrier lost its new rows: the round fails, and searches keep the old tag, which
the restarted shard rebuilt from its persisted (older) rows: still one version everywhere. Every shard journals its
staged round before the barrier (`LiveRows.journal`): one that dies between the barrier and its apply finishes the
journaled round when the service restarts its rows (the apply retried on the restarted actor), so every shard
ends on the new version, and no search mixes the two. An apply that fails or times out after the barrier leaves
the round committed late, not failed: searches did switch, and the shards finish the journaled round."""

from __future__ import annotations

from ragtrain.index.consistency.base import ConsistencyPolicy, RefreshRound


class Global(ConsistencyPolicy):
    has_barrier = True

    def land(self, round_: RefreshRound) -> None:
        for _ in round_.finished_encodes():  # every shard's re-encode first: nothing lands before the last one
            pass
        tag, v = f"live{round_.version}", round_.version
        with round_.barrier():  # a shard restarted meanwhile (by a search) waits for the barrier's outcome
            try:  # each shard journals its staged round, then builds it (not yet searched)
                round_.call(round_.shards, "live_build", tag, {}, v)
            except Exception:
                round_.discard(tag)  # the old tag stays searched
                raise
            # the barrier: every search from now on sees version v everywhere, and a shard restarted from here on
            # finishes its journaled round of v
            round_.commit(tag)
        round_.call(round_.shards, "live_apply", v, round_.kill_before_apply)
        round_.publish()
