"""Losses that train the retriever from the generator (`joint.loss`): pdist, emdr2, lsr.

Every loss takes, for a batch of B questions and their top-k retrieved passages,
  scores  [B, k]  the retriever's similarity s(q, d_i) (requires grad: the loss trains the retriever through it)
  loglik  [B, k]  the generator's answer log-likelihood log p(a | q, d_i) with passage d_i in the prompt
and returns the mean over the batch of a per-question loss. `loglik` is a target: it is detached, so these losses
never move the generator, which trains on its own loss beside them. Formulas, with the papers, in
docs/joint-training.md.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from ragtrain.errors import ConfigError


class JointLoss(Protocol):
    """A retriever loss from the generator's answer likelihoods (scores, loglik: [B, k] -> scalar)."""

    name: ClassVar[str]

    def __call__(self, scores: torch.Tensor, loglik: torch.Tensor) -> torch.Tensor: ...


def _check_shapes(scores: torch.Tensor, loglik: torch.Tensor) -> None:
    if scores.dim() != 2 or scores.shape != loglik.shape:
        raise ValueError(
            f"scores and loglik must both be [batch, k], got {tuple(scores.shape)} and {tuple(loglik.shape)}"
        )


class PerplexityDistillation:
    """Atlas' perplexity distillation (Izacard et al. 2022): KL(p_LM || p_R), the retriever's distribution pulled
    towards the generator's posterior over the passages.

    p_LM = softmax(loglik / tau) (detached target), p_R = softmax(scores / theta);
    loss = mean_b sum_i p_LM,i (log p_LM,i - log p_R,i); d loss / d s_i = (p_R,i - p_LM,i) / (theta B).
    """

    name: ClassVar[str] = "pdist"

    def __init__(self, temperature: float = 1.0, retriever_temperature: float = 1.0):
        self.tau, self.theta = temperature, retriever_temperature

    def __call__(self, scores: torch.Tensor, loglik: torch.Tensor) -> torch.Tensor:
        _check_shapes(scores, loglik)
        target = F.log_softmax(loglik.detach() / self.tau, dim=-1)
        log_r = F.log_softmax(scores / self.theta, dim=-1)
        return F.kl_div(log_r, target, reduction="batchmean", log_target=True)


class ReplugLSR:
    """REPLUG LSR (Shi et al. 2023, eq. 5): KL(P_R || Q_LM), in the paper's direction, the retriever's distribution
    FIRST (the reverse of pdist: mode-seeking, it puts the retriever's mass where the LM likes a passage).

    P_R = softmax(scores / gamma), Q_LM = softmax(loglik / beta) (detached: REPLUG's LM is frozen);
    loss = mean_b sum_i P_R,i (log P_R,i - log Q_LM,i);
    d loss / d s_j = P_R,j (log P_R,j - log Q_LM,j - KL_b) / (gamma B).
    The paper's eq. 4 writes the LM's likelihood P_LM(y | d, x) itself in the exponent of Q_LM; we use its log, as
    the other two losses do: an answer's probability is ~1e-3..1e-9, so exp(P/beta) would make Q_LM uniform for any
    usable beta.
    """

    name: ClassVar[str] = "lsr"

    def __init__(self, temperature: float = 1.0, retriever_temperature: float = 1.0):
        self.beta, self.gamma = temperature, retriever_temperature

    def __call__(self, scores: torch.Tensor, loglik: torch.Tensor) -> torch.Tensor:
        _check_shapes(scores, loglik)
        log_q = F.log_softmax(loglik.detach() / self.beta, dim=-1)
        log_r = F.log_softmax(scores / self.gamma, dim=-1)
        return (log_r.exp() * (log_r - log_q)).sum(dim=-1).mean()


class EMDR2:
    """EMDR2 (Sachan et al. 2021): the answer's marginal likelihood over the top-k passages, maximised through the
    retriever: loss = -mean_b log sum_i p_R,i p(a | q, d_i), p_R = softmax(scores / theta), computed as
    -logsumexp(log p_R + loglik). The generator's likelihoods are a stop-gradient target here, as in EMDR2's
    retriever term (the reader trains on its own loss); d loss / d s_j = (p_R,j - w_j) / (theta B) with the
    posterior w = softmax(log p_R + loglik). No generator-side temperature: the likelihoods enter as they are
    (`build_loss` refuses one)."""

    name: ClassVar[str] = "emdr2"

    def __init__(self, temperature: float = 1.0, retriever_temperature: float = 1.0):
        self.theta = retriever_temperature

    def __call__(self, scores: torch.Tensor, loglik: torch.Tensor) -> torch.Tensor:
        _check_shapes(scores, loglik)
        log_r = F.log_softmax(scores / self.theta, dim=-1)
        return -torch.logsumexp(log_r + loglik.detach(), dim=-1).mean()


LOSSES: dict[str, type] = {c.name: c for c in (PerplexityDistillation, EMDR2, ReplugLSR)}


def build_loss(name: str, temperature: float = 1.0, retriever_temperature: float = 1.0) -> JointLoss:
    """The `joint.loss` named `name` with its temperatures (generator side, retriever side)."""
    if name not in LOSSES:
        raise ConfigError(f"joint.loss must be one of {sorted(LOSSES)}, got {name!r}")
    if name == EMDR2.name and temperature != 1.0:  # it would be silently ignored
        raise ConfigError(f"joint.temperature applies to pdist and lsr only (emdr2 has none), got {temperature!r}")
    if temperature <= 0 or retriever_temperature <= 0:
        raise ConfigError(f"joint temperatures must be > 0, got {temperature!r} and {retriever_temperature!r}")
    return LOSSES[name](temperature, retriever_temperature)
