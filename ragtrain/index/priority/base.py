"""What a refresh priority is: which of an index shard's rows a partial refresh round re-encodes first.

A priority sees one shard's round (`RoundRows`: its stored vectors, each row's encoder version, the round-robin
cursor, the hot counts, the budget) and returns a `Choice`: rows it already encoded itself to decide (drift's
sample) and the rows still to encode. `by_score` is the shared tie rule: ties go to the oldest vectors, then round
robin from the cursor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass
class RoundRows:
    """One shard's rows as a round starts."""

    vectors: np.ndarray  # [rows, dim] stored vectors
    versions: np.ndarray  # [rows] encoder version of each stored vector
    cursor: int  # round-robin position: the next row in turn
    budget: int  # rows this round may re-encode
    version: int  # the round's encoder version
    seed: int
    hot: np.ndarray | None  # per row: times retrieved or mined since the last round (None: no counts)
    encode: Callable[[np.ndarray], np.ndarray]  # local rows -> their vectors under the round's snapshot

    @property
    def rows(self) -> int:
        return len(self.versions)

    def round_robin(self) -> np.ndarray:
        """Every row in turn from the cursor."""
        return (np.arange(self.rows) + self.cursor) % self.rows


@dataclass
class Choice:
    """A priority's answer: `rows` still to encode (at most what the budget leaves), and rows it encoded already."""

    rows: np.ndarray
    encoded_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    encoded_vectors: np.ndarray | None = None


class RefreshPriority(Protocol):
    """One `refresh.priority` value (registered by name in `ragtrain.index.priority.PRIORITIES`)."""

    # True: the chosen rows are the ones in turn, so the shard's cursor moves past them once the round is applied
    moves_cursor: bool

    def choose(self, r: RoundRows) -> Choice:
        """The rows this round re-encodes."""
        ...


def by_score(score: np.ndarray, r: RoundRows, budget: int) -> np.ndarray:
    """The `budget` rows of highest `score`; ties go to the oldest encoder version, then round robin."""
    turn = np.empty(r.rows, dtype=np.int64)
    turn[r.round_robin()] = np.arange(r.rows)
    return np.lexsort((turn, r.versions, -np.asarray(score, dtype=np.float64)))[: max(0, budget)]
