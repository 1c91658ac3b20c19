"""Exact match and token F1 with SQuAD v1.1's answer normalisation (the official evaluate-v1.1.py definitions)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ragtrain.eval.answers import normalize_answer  # the one normalisation (answer recall@k uses it too)

__all__ = ["best_over_golds", "exact_match", "f1_score", "normalize_answer", "score"]


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when the normalised strings are equal."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Token-level F1 over normalised whitespace tokens (multiset overlap)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = Counter(pred) & Counter(ref)
    same = sum(common.values())
    if same == 0:  # also covers an empty prediction or gold (SQuAD v1.1 behaviour: 0)
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_over_golds(metric, prediction: str, golds: Sequence[str]) -> float:
    """Max of `metric` over the gold answers (SQuAD's metric_max_over_ground_truths)."""
    return max(metric(prediction, g) for g in golds)


def score(predictions: Sequence[str], golds: Sequence[Sequence[str]]) -> dict[str, float]:
    """Mean EM and F1 over questions (each with one or more gold answers)."""
    if len(predictions) != len(golds):
        raise ValueError(f"{len(predictions)} predictions for {len(golds)} questions")
    if not predictions:
        return {"em": 0.0, "f1": 0.0, "n": 0.0}
    em = sum(best_over_golds(exact_match, p, g) for p, g in zip(predictions, golds))
    f1 = sum(best_over_golds(f1_score, p, g) for p, g in zip(predictions, golds))
    n = len(predictions)
    return {"em": em / n, "f1": f1 / n, "n": float(n)}
