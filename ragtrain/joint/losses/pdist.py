"""`pdist`: Atlas' perplexity distillation, the retriever pulled towards the generator's posterior."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragtrain.joint.losses.base import check_shapes


class PerplexityDistillation:
    """Atlas' perplexity distillation (Izacard et al. 2022): KL(p_LM || p_R), the retriever's distribution pulled
    towards the generator's posterior over the passages.

    p_LM = softmax(loglik / tau) (detached target), p_R = softmax(scores / theta);
    loss = mean_b sum_i p_LM,i (log p_LM,i - log p_R,i); d loss / d s_i = (p_R,i - p_LM,i) / (theta B).
    """

    def __init__(self, temperature: float = 1.0, retriever_temperature: float = 1.0):
        self.tau, self.theta = temperature, retriever_temperature

    def __call__(self, scores: torch.Tensor, loglik: torch.Tensor) -> torch.Tensor:
        check_shapes(scores, loglik)
        target = F.log_softmax(loglik.detach() / self.tau, dim=-1)
        log_r = F.log_softmax(scores / self.theta, dim=-1)
        return F.kl_div(log_r, target, reduction="batchmean", log_target=True)
