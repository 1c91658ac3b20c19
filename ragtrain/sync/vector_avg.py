"""`vector_avg` (conf/sync/vector_avg.yaml: no reducer, no mixer, consensus: vectors): the replicas train apart and
their VECTORS are synchronised instead of their weights.

Training: every worker steps its own replica (in-batch negatives are still gathered across workers, as constants:
each replica optimises its own loss). At index time every replica encodes the same passages (and queries) and the
index is built from the re-normalised mean vector per passage — the "consensus vectors". The pipeline also
evaluates the parameter-averaged model (`param_avg`) on the same split, so the two kinds of consensus compare.
"""

import numpy as np


def consensus_vectors(per_replica: list[np.ndarray]) -> np.ndarray:
    """The re-normalised mean of the replicas' vectors (one replica: its vectors unchanged)."""
    if len(per_replica) == 1:
        return per_replica[0]
    total = np.sum(per_replica, axis=0)
    return total / np.linalg.norm(total, axis=1, keepdims=True).clip(min=1e-12)
