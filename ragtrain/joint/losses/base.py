"""Losses that train the retriever from the generator (`joint.loss`): one class per file, named in
ragtrain.config.joint.JOINT_LOSSES (docs/adding-a-variant.md).

Every loss takes, for a batch of B questions and their top-k retrieved passages,
  scores  [B, k]  the retriever's similarity s(q, d_i) (requires grad: the loss trains the retriever through it)
  loglik  [B, k]  the generator's answer log-likelihood log p(a | q, d_i) with passage d_i in the prompt
and returns the mean over the batch of a per-question loss. `loglik` is a target: it is detached, so these losses
never move the generator, which trains on its own loss beside them. Formulas, with the papers, in
docs/joint-training.md.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ragtrain.config.joint import JOINT_LOSSES, JointConfig


class JointLoss(Protocol):
    """A retriever loss from the generator's answer likelihoods (scores, loglik: [B, k] -> scalar); built as
    `cls(temperature, retriever_temperature)` (joint.temperature: the generator side, where the loss has one)."""

    def __call__(self, scores: torch.Tensor, loglik: torch.Tensor) -> torch.Tensor: ...


def check_shapes(scores: torch.Tensor, loglik: torch.Tensor) -> None:
    if scores.dim() != 2 or scores.shape != loglik.shape:
        raise ValueError(
            f"scores and loglik must both be [batch, k], got {tuple(scores.shape)} and {tuple(loglik.shape)}"
        )


def build_loss(j: JointConfig) -> JointLoss:
    """The `joint.loss` of a checked JointConfig, with its temperatures (generator side, retriever side)."""
    return JOINT_LOSSES[j.loss].load()(j.temperature, j.retriever_temperature)
