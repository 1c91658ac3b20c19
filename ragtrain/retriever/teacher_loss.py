"""The distillation term of a cross-encoder teacher: KL(teacher || student) over each query's candidate list, or
MarginMSE over its (positive, negative) pairs (`retriever.teacher.loss`).

A query's candidates in a local batch are its positive and its sampled hard negatives (`local_batch` lays
passages out as B positives, then H negatives per query). The teacher scored every mined candidate once
(ragtrain/reranker/score.py); a passage it did not score (a random top-up of a query with too few candidates) is
left out of that query's softmax on both sides. The student's scores are its training logits (cosine / the
retriever's temperature), the teacher's are its logits / `retriever.teacher.temperature`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ragtrain.config.retriever import DistillLoss
from ragtrain.retriever.batching import query_candidates


def teacher_matrix(
    table: dict[int, dict[int, float]], qidx: Sequence[int], pids: Sequence[int], num_negatives: int
) -> torch.Tensor:
    """[B, 1 + H] teacher scores of each local query's positive and hard negatives; NaN where unscored."""
    out = torch.full((len(qidx), 1 + num_negatives), float("nan"))
    for j, (q, cand) in enumerate(zip(qidx, query_candidates(pids, len(qidx), num_negatives))):
        row = table.get(int(q), {})
        for c, p in enumerate(cand):
            if int(p) in row:
                out[j, c] = row[int(p)]
    return out


def _student_logits(q_emb: torch.Tensor, p_emb: torch.Tensor, h: int, temperature: float) -> torch.Tensor:
    """[B, 1 + H] student logits of each local query's positive and hard negatives (cosine / temperature)."""
    b = q_emb.shape[0]
    cand = torch.cat([p_emb[:b].unsqueeze(1), p_emb[b : b + b * h].view(b, h, -1)], dim=1)  # [B, 1 + H, d]
    return torch.einsum("bd,bkd->bk", q_emb, cand) / temperature


def teacher_margin_mse(
    q_emb: torch.Tensor, p_emb: torch.Tensor, teacher: torch.Tensor, temperature: float, teacher_temperature: float
) -> torch.Tensor:
    """Mean over (query, negative) pairs with both ends scored of ((s_pos - s_neg) - (t_pos - t_neg))^2.

    Scores on both sides are the KL term's logits (student cosine / T, teacher logit / T_t), so the teacher's
    temperature sets the scale of the margins the student is asked to match. 0 when no pair is scored."""
    student = _student_logits(q_emb, p_emb, teacher.shape[1] - 1, temperature)
    t = teacher.to(q_emb.device, q_emb.dtype) / teacher_temperature
    pairs = ~torch.isnan(t[:, :1]) & ~torch.isnan(t[:, 1:])  # [B, H]: the positive and this negative scored
    if not bool(pairs.any()):
        return student.sum() * 0.0  # keeps the graph (DDP expects every step's gradients)
    diff = (student[:, :1] - student[:, 1:]) - torch.nan_to_num(t[:, :1] - t[:, 1:], nan=0.0)
    return diff.pow(2)[pairs].mean()


def teacher_kl(
    q_emb: torch.Tensor, p_emb: torch.Tensor, teacher: torch.Tensor, temperature: float, teacher_temperature: float
) -> torch.Tensor:
    """Mean over local queries of KL(softmax(teacher / T_t) || softmax(q . candidates / T)), scored candidates only.

    `p_emb` holds the local batch's passages (B positives, then H per query); `teacher` is `teacher_matrix`'s."""
    student = _student_logits(q_emb, p_emb, teacher.shape[1] - 1, temperature)
    scored = ~torch.isnan(teacher).to(q_emb.device)
    t = torch.nan_to_num(teacher.to(q_emb.device, q_emb.dtype), nan=0.0) / teacher_temperature
    neg_inf = torch.finfo(student.dtype).min
    log_p_t = F.log_softmax(t.masked_fill(~scored, neg_inf), dim=1)
    log_p_s = F.log_softmax(student.masked_fill(~scored, neg_inf), dim=1)
    kl = (log_p_t.exp() * (log_p_t - log_p_s)).masked_fill(~scored, 0.0).sum(1)
    return kl.mean()


def distill_term(loss: DistillLoss | str) -> Callable[..., torch.Tensor]:
    """The distillation function of retriever.teacher.loss."""
    return {DistillLoss.kl: teacher_kl, DistillLoss.margin_mse: teacher_margin_mse}[DistillLoss(loss)]
