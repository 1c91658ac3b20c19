"""Answers in retrieved passages: SQuAD v1.1's answer normalisation and answer recall@k (as DPR reports it).

* ``normalize_answer``: lower case, punctuation removed, the articles a/an/the removed, whitespace collapsed: the
  official evaluate-v1.1.py definition, used by exact match / F1 (ragtrain/generator/qa_metrics.py) and here.
* ``answer_recall@k`` of one question is 1 when a normalised gold answer occurs, as a whole run of normalised
  tokens, in the text of one of its top-k retrieved passages (the passage body; the title is not searched), else
  0; the reported value is the mean over the evaluated questions that have at least one non-empty gold answer. A
  question missing from the run scores 0, as in the other retrieval metrics (ragtrain/eval/metrics.py).

Token runs, not substrings: the gold answer "1" must not be found inside "1990". Normalised text is single-space
separated, so padding both sides with a space makes a substring test exactly a contiguous-token test.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Mapping, Sequence

from ragtrain.eval.metrics import DEFAULT_KS, Run, _check_ks

__all__ = ["answer_recall", "has_answer", "normalize_answer"]

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace (SQuAD order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def has_answer(normalized_text: str, normalized_answers: Sequence[str]) -> bool:
    """Whether one of the (already normalised, non-empty) answers is a run of whole tokens of the normalised text."""
    padded = f" {normalized_text} "
    return any(f" {a} " in padded for a in normalized_answers)


def answer_recall(
    run: Run,
    answers: Mapping[str, Sequence[str]],
    texts: Mapping[str, str],
    qids: Sequence[str],
    ks: Sequence[int] = DEFAULT_KS,
) -> dict[str, float]:
    """Mean ``answer_recall@k`` over the questions `qids` that have a non-empty gold answer (see module doc).

    `run`: question id -> passage ids, best first; `texts`: passage id -> passage body for every passage the run
    names within max(ks); `answers`: question id -> gold answer texts. Raises ValueError when no question of `qids`
    has an answer (the metric is undefined there)."""
    ks_ = _check_ks(ks)
    depth = max(ks_)
    norm_cache: dict[str, str] = {}  # a passage is normalised once, however many questions retrieve it
    hits: dict[int, list[float]] = {k: [] for k in ks_}
    for qid in qids:
        golds = [n for n in (normalize_answer(a) for a in answers.get(qid, ())) if n]
        if not golds:
            continue  # an answer that normalises to nothing (e.g. "the") can be found in no passage
        first = math.inf  # 1-based rank of the first passage holding an answer
        for rank, pid in enumerate(run.get(qid, ())[:depth], start=1):
            if pid not in norm_cache:
                norm_cache[pid] = normalize_answer(texts[pid])
            if has_answer(norm_cache[pid], golds):
                first = rank
                break
        for k in ks_:
            hits[k].append(1.0 if first <= k else 0.0)
    n = len(hits[ks_[0]])
    if not n:
        raise ValueError("no evaluable question: none of the evaluated questions has a non-empty gold answer")
    return {f"answer_recall@{k}": math.fsum(hits[k]) / n for k in ks_}
