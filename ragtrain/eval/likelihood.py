"""The RAG answer likelihood of one question, from the retriever's scores of its top-k passages and the generator's
log-likelihood of the answer given each passage alone (RAG-sequence scoring, Lewis et al. 2020):

    rag_nll      = -log sum_k p_R(k | q) p_G(a | q, k),   p_R = softmax(scores / temperature) over the top k
    rag_nll_top1 = -log p_G(a | q, k_1)                    the retriever's first passage alone
    oracle_nll   = -log p_G(a | q, gold)                   the gold passage alone

in nats, teacher-forced (the answer's tokens and EOS). Unlike exact match it moves with every question: a retriever
that puts the answer's passage higher lowers rag_nll, and oracle_nll, which no retriever can change, tells a
better generator apart from better retrieval. Math only (float64 log-sum-exp); the generator's side is
ragtrain/generator/likelihood.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

LIKELIHOOD_METRICS = ("rag_nll", "rag_nll_top1", "oracle_nll")


def logsumexp(xs: Sequence[float]) -> float:
    """log sum exp(x), shifted by the largest term (no overflow at large scores / temperature)."""
    top = max(xs)
    if top == -math.inf:
        return -math.inf
    return top + math.log(math.fsum(math.exp(x - top) for x in xs))


def rag_sequence_nll(scores: Sequence[float], logliks: Sequence[float], temperature: float) -> float:
    """-log sum_k softmax(scores / temperature)_k exp(logliks_k): the answer's marginal over the passages."""
    if len(scores) != len(logliks) or not scores:
        raise ValueError(f"{len(scores)} scores for {len(logliks)} likelihoods: give one score per passage (>= 1)")
    if temperature <= 0:
        raise ValueError(f"the retriever's temperature must be > 0, got {temperature}")
    z = [s / temperature for s in scores]
    log_norm = logsumexp(z)
    return -logsumexp([zi - log_norm + li for zi, li in zip(z, logliks)])


def question_nll(
    scores: Sequence[float], logliks: Sequence[float], gold_loglik: float | None, temperature: float
) -> dict[str, float | None]:
    """One question's three figures (module doc); oracle_nll is None for a question without a gold passage."""
    return {
        "rag_nll": rag_sequence_nll(scores, logliks, temperature),
        "rag_nll_top1": -logliks[0],
        "oracle_nll": None if gold_loglik is None else -gold_loglik,
    }


def mean_nll(rows: Sequence[Mapping[str, float | None]]) -> dict[str, float]:
    """Each figure's mean over the questions that have it, and `n` (the questions scored)."""
    out: dict[str, float] = {"n": float(len(rows))}
    for key in LIKELIHOOD_METRICS:
        values = [float(v) for r in rows if (v := r.get(key)) is not None]
        if values:
            out[key] = math.fsum(values) / len(values)
    return out
