"""`params`: one model, the replicas' parameter mean (the mixer forms it: over its scope, or its server's copy)."""

from __future__ import annotations

from torch import nn

from ragtrain.sync.mixers.base import Mixer


class ParamMean:
    def form(self, mixer: Mixer, params: list[nn.Parameter]) -> None:
        mixer.consensus(params)
