"""`emdr2`: the answer's marginal likelihood over the top-k passages, maximised through the retriever."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragtrain.joint.losses.base import check_shapes


class EMDR2:
    """EMDR2 (Sachan et al. 2021): the answer's marginal likelihood over the top-k passages, maximised through the
    retriever: loss = -mean_b log sum_i p_R,i p(a | q, d_i), p_R = softmax(scores / theta), computed as
    -logsumexp(log p_R + loglik). The generator's likelihoods are a stop-gradient target here, as in EMDR2's
    retriever term (the reader trains on its own loss); d loss / d s_j = (p_R,j - w_j) / (theta B) with the
    posterior w = softmax(log p_R + loglik). No generator-side temperature: the likelihoods enter as they are
    (the config refuses joint.temperature with it)."""

    def __init__(self, temperature: float = 1.0, retriever_temperature: float = 1.0):
        self.theta = retriever_temperature

    def __call__(self, scores: torch.Tensor, loglik: torch.Tensor) -> torch.Tensor:
        check_shapes(scores, loglik)
        log_r = F.log_softmax(scores / self.theta, dim=-1)
        return -torch.logsumexp(log_r + loglik.detach(), dim=-1).mean()
