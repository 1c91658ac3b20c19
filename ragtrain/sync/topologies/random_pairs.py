"""`random`: each round the workers pair up at random (a seeded permutation every worker draws alike); with an odd
count, the one left over skips the round."""

from __future__ import annotations

import numpy as np


class RandomPairs:
    def __init__(self, seed: int = 0):
        self.seed = seed

    def neighbours(self, position: int, size: int, round_: int) -> list[int]:
        if size == 1:
            return []
        perm = np.random.default_rng([self.seed, round_]).permutation(size)
        pos = int(np.where(perm == position)[0][0])
        peer = pos + 1 if pos % 2 == 0 else pos - 1
        return [int(perm[peer])] if peer < size else []
