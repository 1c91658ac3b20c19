"""`retriever.teacher.loss=margin_mse`: the pairwise distillation term."""

from __future__ import annotations

import torch

from ragtrain.retriever.teacher.base import student_logits


class MarginMSE:
    """`margin_mse`: MarginMSE (Hofstätter et al., 2020) over each query's (positive, negative) pairs."""

    def __call__(
        self,
        q_emb: torch.Tensor,
        p_emb: torch.Tensor,
        teacher: torch.Tensor,
        temperature: float,
        teacher_temperature: float,
    ) -> torch.Tensor:
        """Mean over (query, negative) pairs with both ends scored of ((s_pos - s_neg) - (t_pos - t_neg))^2.

        Scores on both sides are the KL term's logits (student cosine / T, teacher logit / T_t), so the teacher's
        temperature sets the scale of the margins the student is asked to match. 0 when no pair is scored."""
        student = student_logits(q_emb, p_emb, teacher.shape[1] - 1, temperature)
        t = teacher.to(q_emb.device, q_emb.dtype) / teacher_temperature
        pairs = ~torch.isnan(t[:, :1]) & ~torch.isnan(t[:, 1:])  # [B, H]: the positive and this negative scored
        if not bool(pairs.any()):
            return student.sum() * 0.0  # keeps the graph (DDP expects every step's gradients)
        diff = (student[:, :1] - student[:, 1:]) - torch.nan_to_num(t[:, :1] - t[:, 1:], nan=0.0)
        return diff.pow(2)[pairs].mean()
