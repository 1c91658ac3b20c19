"""`refresh.consistency=aligned`: eager, and rows still at an older encoder version are searched through a linear
map into the newest version's space (orthogonal Procrustes, `ragtrain/embed/align.py`), fitted on
`refresh.anchors` passages that every version encodes; so every shard's index changes with each landing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ragtrain.index.consistency.base import RefreshRound
from ragtrain.index.consistency.eager import Eager
from ragtrain.runtime.errors import ConfigError

if TYPE_CHECKING:
    from ragtrain.config.index import RefreshConfig


class Aligned(Eager):
    needs_anchors = True

    def rebuild(self, round_: RefreshRound, shard: int) -> None:
        round_.call(round_.shards, "live_build", round_.tag, round_.align())

    def check(self, refresh: RefreshConfig, dim: int, rows: int) -> None:
        if refresh.anchors < dim or refresh.anchors > rows:
            raise ConfigError(
                f"refresh.anchors={refresh.anchors}: refresh.consistency=aligned fits a {dim} x {dim} map between "
                f"encoder versions and needs at least {dim} anchor passages (the encoder's dimension) and at most the "
                f"corpus's {rows}"
            )
