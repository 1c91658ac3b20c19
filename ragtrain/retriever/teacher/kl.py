"""`retriever.teacher.loss=kl`: the listwise distillation term."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragtrain.retriever.teacher.base import student_logits


class KL:
    """`kl`: KL(teacher || student) over each query's candidate list."""

    def __call__(
        self,
        q_emb: torch.Tensor,
        p_emb: torch.Tensor,
        teacher: torch.Tensor,
        temperature: float,
        teacher_temperature: float,
    ) -> torch.Tensor:
        """Mean over local queries of KL(softmax(teacher / T_t) || softmax(q . candidates / T)), scored candidates only.

        `p_emb` holds the local batch's passages (B positives, then H per query); `teacher` is `teacher_matrix`'s."""
        student = student_logits(q_emb, p_emb, teacher.shape[1] - 1, temperature)
        scored = ~torch.isnan(teacher).to(q_emb.device)
        t = torch.nan_to_num(teacher.to(q_emb.device, q_emb.dtype), nan=0.0) / teacher_temperature
        neg_inf = torch.finfo(student.dtype).min
        log_p_t = F.log_softmax(t.masked_fill(~scored, neg_inf), dim=1)
        log_p_s = F.log_softmax(student.masked_fill(~scored, neg_inf), dim=1)
        kl = (log_p_t.exp() * (log_p_t - log_p_s)).masked_fill(~scored, 0.0).sum(1)
        return kl.mean()
