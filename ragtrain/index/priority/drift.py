"""`refresh.priority=drift`: a seeded sample of the rows is re-encoded first; every other row's drift (1 - cos
between its stored and its new vector) is predicted as its nearest sampled row's (in the stored space), and the
rows predicted to move most take the rest of the budget."""

from __future__ import annotations

import numpy as np

from ragtrain.index.priority.base import Choice, RoundRows, by_score

SAMPLE_SHARE = 0.1  # of a round's budget: the rows encoded first to estimate the drift of the others


def predict_drift(stored: np.ndarray, sample_rows: np.ndarray, sample_drift: np.ndarray) -> np.ndarray:
    """Every row's drift, predicted as that of its most similar sampled row in the stored space (1-NN)."""
    out = np.empty(len(stored), dtype=np.float64)
    anchors = stored[sample_rows]
    for a in range(0, len(stored), 8192):  # bounded memory: 8192 x sample scores at a time
        nearest = np.argmax(stored[a : a + 8192] @ anchors.T, axis=1)
        out[a : a + 8192] = sample_drift[nearest]
    out[sample_rows] = sample_drift
    return out


class Drift:
    moves_cursor = False

    def choose(self, r: RoundRows) -> Choice:
        if r.budget >= r.rows:  # every row is re-encoded: nothing to predict
            return Choice(r.round_robin())
        rng = np.random.default_rng([r.seed, r.version])
        sample = np.sort(rng.choice(r.rows, size=max(1, int(r.budget * SAMPLE_SHARE)), replace=False))
        fresh = r.encode(sample)
        predicted = predict_drift(r.vectors, sample, 1.0 - np.sum(fresh * r.vectors[sample], axis=1))
        predicted[sample] = -np.inf  # encoded already: the rest of the budget goes to the others
        return Choice(by_score(predicted, r, r.budget - len(sample)), sample, fresh)
