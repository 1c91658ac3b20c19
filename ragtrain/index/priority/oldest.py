"""`refresh.priority=oldest`: round robin, so the rows whose vectors are oldest come first."""

from __future__ import annotations

from ragtrain.index.priority.base import Choice, RoundRows


class Oldest:
    moves_cursor = True

    def choose(self, r: RoundRows) -> Choice:
        return Choice(r.round_robin()[: r.budget])
