"""The generator's answer log-likelihood log p(a | q, d_i) for each question and each of its passages: the target
of the joint losses (ragtrain/joint/losses/)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch

from ragtrain.generator.model import GenModel
from ragtrain.generator.prompt import PromptBuilder


def answer_loglik(
    model: GenModel,
    builder: PromptBuilder,
    questions: Sequence[str],
    passages: Sequence[Sequence[str]],
    answers: Sequence[str],
    max_target_length: int,
    grad: bool = False,
) -> torch.Tensor:
    """[B, k]: entry (b, i) = sum of the log-probabilities of answer b's tokens (and EOS) given the prompt of
    question b with passage i alone, `passages[b][i]` (prompt text). Every question has the same k passages. The
    B*k prompts run as one batch; `grad=False` runs without autograd (a target for the losses)."""
    k = len(passages[0]) if passages else 0
    if any(len(p) != k for p in passages) or len(passages) != len(questions) or len(answers) != len(questions):
        raise ValueError("answer_loglik needs one answer and the same number of passages per question")
    src = [builder.source(q, [d]) for q, ps in zip(questions, passages) for d in ps]
    tgt = [builder.target(a, max_target_length) for a in answers for _ in range(k)]
    device = next(model.parameters()).device
    batch = {name: t.to(device) for name, t in model.arch.collate(src, tgt, model.pad_id).items()}
    with nullcontext() if grad else torch.no_grad():
        return model.target_logprobs(**batch).view(len(questions), k)
