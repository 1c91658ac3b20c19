"""The live index's commit point: what a restarted refresh service resumes from.

The refresh service (index/refresh_service.py) persists it in the run folder (`<output_dir>/shards/live-commit.pkl`,
written atomically) before any search sees a new encoder version (a global barrier, an eager landing), when a round
takes its version number (never reused) and with every version it publishes to the trainers. Ray restarts a
crashed service (`SERVICE_RESTARTS`); the restarted one reads the commit point back, so searches keep the committed
build and trainers the newest published version, and every shard's live rows are restarted from disk against the
committed version (a journaled round of that version is finished, any other dropped).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ragtrain.index.live_client import LiveVersion

COMMIT_POINT = "live-commit.pkl"  # under the shard group's root, beside the shards' own live rows


@dataclass
class CommitPoint:
    """The committed state of the live index, and what the service needs to go on serving it."""

    tag: str  # the shards' build every search reads
    encoder_version: int  # the newest encoder version searches see
    last_version: int  # the newest version number a round took (a restarted service numbers on from it)
    vector_folder: str  # the vector set the shards' live rows started from
    dim: int
    first: int  # the number of the first version published (a resumed run's)
    published: LiveVersion | None  # the newest version published to the trainers
    encoder_steps: dict[int, int] = field(default_factory=dict)  # encoder version -> training step of its snapshot
    anchors: dict[int, np.ndarray] = field(default_factory=dict)  # aligned: each version's anchor vectors
    maps: dict[int, np.ndarray] = field(default_factory=dict)  # aligned: older version -> map onto the newest

    def save(self, folder: str | Path) -> None:
        """Write atomically into `folder`: a crash leaves the previous commit point whole."""
        path = Path(folder) / COMMIT_POINT
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{COMMIT_POINT}.{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(tmp, path)

    @staticmethod
    def load(folder: str | Path) -> CommitPoint | None:
        """The commit point persisted in `folder`, or None where none was."""
        path = Path(folder) / COMMIT_POINT
        return pickle.loads(path.read_bytes()) if path.exists() else None

    @staticmethod
    def remove(folder: str | Path) -> None:
        """Forget it: the live index ended, or a new one starts in this folder."""
        (Path(folder) / COMMIT_POINT).unlink(missing_ok=True)
