"""`vectors` (sync=vector_avg): every replica is kept as it trained; the consensus is formed on their vectors when
the index is built (the re-normalised mean per passage, ragtrain/embed/encoders.py: consensus_vectors)."""

from __future__ import annotations

from torch import nn

from ragtrain.sync.mixers.base import Mixer


class KeepReplicas:
    def form(self, mixer: Mixer, params: list[nn.Parameter]) -> None:
        pass  # the replicas stay apart: rank 0 collects them after training
