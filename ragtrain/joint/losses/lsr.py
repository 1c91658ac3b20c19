"""`lsr`: REPLUG's LM-supervised retrieval, KL(retriever || LM) in the paper's direction."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragtrain.joint.losses.base import check_shapes


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

    def __init__(self, temperature: float = 1.0, retriever_temperature: float = 1.0):
        self.beta, self.gamma = temperature, retriever_temperature

    def __call__(self, scores: torch.Tensor, loglik: torch.Tensor) -> torch.Tensor:
        check_shapes(scores, loglik)
        log_q = F.log_softmax(loglik.detach() / self.beta, dim=-1)
        log_r = F.log_softmax(scores / self.gamma, dim=-1)
        return (log_r.exp() * (log_r - log_q)).sum(dim=-1).mean()
