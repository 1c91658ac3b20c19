"""`vector_avg`: keep the replicas apart while training and synchronise their VECTORS instead of their weights.

Training: every worker steps its own replica (no gradient or parameter exchange; in-batch negatives are still
gathered across workers, as constants: each replica optimises its own loss). At index time every replica encodes the same passages (and queries) and the index is
built from the re-normalised mean vector per passage — the "consensus vectors". The pipeline also evaluates the
parameter-averaged model (`param_avg`) on the same split, so the two kinds of consensus compare side by side.
"""

from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from ragtrain.config import SyncConfig
from ragtrain.sync.base import world_size


def consensus_vectors(per_replica: list[np.ndarray]) -> np.ndarray:
    """The re-normalised mean of the replicas' vectors (one replica: its vectors unchanged)."""
    if len(per_replica) == 1:
        return per_replica[0]
    total = np.sum(per_replica, axis=0)
    return total / np.linalg.norm(total, axis=1, keepdims=True).clip(min=1e-12)


class VectorAvgSync:
    """Independent replicas; all of them are returned for vector averaging at index time."""

    gather_negatives = True
    keeps_replicas = True

    def __init__(self, cfg: SyncConfig):
        self.cfg = cfg

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model  # gradients stay local

    def gradient_groups(self, step: int) -> Optional[list[list[int]]]:
        return [[r] for r in range(world_size())]  # replicas never exchange gradients: each its own loss

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        pass

    def consensus(self, params: list[nn.Parameter]) -> None:
        pass  # the consensus is formed on the vectors, after training

    def state(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing beyond the model and optimizer

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
