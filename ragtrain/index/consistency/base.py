"""What a consistency policy is: when a refresh round's new rows become searchable, shard by shard.

A policy gets one `RefreshRound` from the refresh service (`ragtrain/index/refresh_service.py`) and lands it
through that object alone: it waits for the shards' encodes (`finished_encodes`), applies and rebuilds them
(`call`), moves what searches see (`commit` at a barrier, or `advance` shard by shard) and publishes every state
searches can see (`publish`). The round records what happened (the encodes' stats, the states published, whether
it committed); the service reads it back. A policy imports nothing of the service and holds none of its state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from ragtrain.config.index import RefreshConfig


class RefreshRound(Protocol):
    """One refresh round as the service hands it to its policy: encoder version `version` of every shard's rows."""

    version: int  # the round's encoder version (a new number for every round, even after a failed one)
    shards: list[int]  # every shard of the live index
    kill_before_apply: int  # fault.kill_shard_before_apply: the shard that dies before its apply (-1: none)

    @property
    def tag(self) -> str:
        """The build every search reads now."""
        ...

    def finished_encodes(self) -> Iterator[int]:
        """Each shard as its re-encode finishes (its stats recorded in the round); a shard that does not answer
        within refresh.timeout_s raises ShardUnavailableError naming it (the shards that landed keep their rows)."""
        ...

    def call(self, shards: list[int], method: str, *args: Any) -> list[Any]:
        """One IndexShard call per shard (a shard restarted meanwhile gets its live rows back first)."""
        ...

    def barrier(self) -> AbstractContextManager[None]:
        """Held from staging to `commit`: a shard restarted meanwhile resolves its journal after the outcome."""
        ...

    def discard(self, tag: str) -> None:
        """Forget the staged build `tag` and every shard's journal (a round that failed before its barrier)."""
        ...

    def commit(self, tag: str) -> None:
        """The commit point: this round's version is persisted as committed, then every search reads `tag`. The
        build searches left is dropped when the round ends. After this the round counts as landed, even if what
        follows fails (committed late)."""
        ...

    def advance(self) -> None:
        """Rows of this round's version are searched from now on (a shard that landed without a barrier)."""
        ...

    def align(self) -> dict[int, np.ndarray]:
        """Fit (and use from now on) the map of every older encoder version onto this round's, on the anchors."""
        ...

    def publish(self) -> None:
        """Publish the state searches see now (negatives mined, metrics measured); the round keeps its figures.
        From `commit` or `advance` to here pinned searches wait (they read a state with its version number), so a
        policy publishes every state it makes searchable."""
        ...


class ConsistencyPolicy(Protocol):
    """One `refresh.consistency` value (registered by name in `ragtrain.index.consistency.POLICIES`)."""

    # True: every encoder version also encodes `refresh.anchors` passages (a map between versions is fitted on them)
    needs_anchors: bool = False
    # True: the round switches every search at one barrier, then applies (fault.kill_shard_before_apply acts there)
    has_barrier: bool = False

    def land(self, round_: RefreshRound) -> None:
        """Make the round's new rows searchable as the policy says (what happened is recorded in `round_`)."""
        ...

    def check(self, refresh: RefreshConfig, dim: int, rows: int) -> None:
        """Refuse (ConfigError naming the key) settings this policy cannot run with, before any work."""
        return None  # the default for subclasses: every setting runs (a body, so the method is not abstract)
