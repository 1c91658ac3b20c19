"""`refresh.priority=hot`: the rows retrieved or mined most since the last round first, the rest by age."""

from __future__ import annotations

import numpy as np

from ragtrain.index.priority.base import Choice, RoundRows, by_score


class Hot:
    moves_cursor = False

    def choose(self, r: RoundRows) -> Choice:
        return Choice(by_score(np.zeros(r.rows) if r.hot is None else r.hot, r, r.budget))
