"""The distillation term of a cross-encoder teacher (`retriever.teacher.loss`): one class per file (kl.py,
margin_mse.py), named in ragtrain.config.retriever.TEACHER_LOSSES (docs/adding-a-variant.md).

A query's candidates in a local batch are its positive and its sampled hard negatives (`local_batch` lays
passages out as B positives, then H negatives per query). The teacher scored every mined candidate once
(ragtrain/reranker/score.py); a passage it did not score (a random top-up of a query with too few candidates) is
left out of that query's softmax on both sides. The student's scores are its training logits (cosine / the
retriever's temperature), the teacher's are its logits / `retriever.teacher.temperature`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ragtrain.config.retriever import TEACHER_LOSSES
from ragtrain.retriever.batching import query_candidates


class TeacherLoss(Protocol):
    """A distillation term: (q_emb [B, d], p_emb [B + B*H, d], teacher [B, 1 + H] (`teacher_matrix`, NaN where
    unscored), the student's temperature, the teacher's) -> a scalar; built as `cls()`."""

    def __call__(
        self,
        q_emb: torch.Tensor,
        p_emb: torch.Tensor,
        teacher: torch.Tensor,
        temperature: float,
        teacher_temperature: float,
    ) -> torch.Tensor: ...


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


def student_logits(q_emb: torch.Tensor, p_emb: torch.Tensor, h: int, temperature: float) -> torch.Tensor:
    """[B, 1 + H] student logits of each local query's positive and hard negatives (cosine / temperature)."""
    b = q_emb.shape[0]
    cand = torch.cat([p_emb[:b].unsqueeze(1), p_emb[b : b + b * h].view(b, h, -1)], dim=1)  # [B, 1 + H, d]
    return torch.einsum("bd,bkd->bk", q_emb, cand) / temperature


def build_teacher_loss(name: str) -> TeacherLoss:
    """The distillation term of retriever.teacher.loss (checked by the config against TEACHER_LOSSES)."""
    return TEACHER_LOSSES[name].load()()
