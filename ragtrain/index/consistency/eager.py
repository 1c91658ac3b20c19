"""`refresh.consistency=eager`: each shard's new rows are searched as soon as that shard is done, so searches see
several encoder versions at once (the inconsistency of an index distributed over nodes)."""

from __future__ import annotations

from ragtrain.index.consistency.base import ConsistencyPolicy, RefreshRound


class Eager(ConsistencyPolicy):
    def land(self, round_: RefreshRound) -> None:
        for shard in round_.finished_encodes():  # past refresh.timeout_s the shards that landed keep their rows
            round_.call([shard], "live_apply", round_.version)
            round_.advance()
            self.rebuild(round_, shard)
            round_.publish()

    def rebuild(self, round_: RefreshRound, shard: int) -> None:
        """Make shard `shard`'s applied rows searchable: rebuild its live index."""
        round_.call([shard], "live_build", round_.tag, {})
