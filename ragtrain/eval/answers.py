"""Answers in retrieved passages: SQuAD v1.1's answer normalisation and answer recall@k (as DPR reports it).

* ``normalize_answer``: lower case, punctuation removed, the articles a/an/the removed, whitespace collapsed: the
  official evaluate-v1.1.py definition, used by exact match / F1 (ragtrain/eval/qa_metrics.py).
* ``match_tokens``: the same normalisation for finding an answer in a passage, except that punctuation (and any
  other character that is not a letter or digit) separates tokens instead of being deleted, as DPR's tokenizer
  splits them. Deleting it glues a passage's words together: "graduating in 1873.:33" reads "187333", "to
  Paris.[citation needed]" "parisciation", "Rollo's" "rollos". Measured on the shared SQuAD file's 7,894 questions,
  the answer is found as whole tokens in its own gold paragraph for all but 64 with deletion, all but 1 with
  separation (that one a span inside a word).
* ``answer_recall@k`` of one question is 1 when one of its gold answers occurs, as a whole run of match tokens, in
  the text of one of its top-k retrieved passages (the passage body; the title is not searched), else 0; the
  reported value is the mean over the evaluated questions that have at least one gold answer with a token. A
  question missing from the run scores 0, as in the other retrieval metrics (ragtrain/eval/metrics.py).

Token runs, not substrings: the gold answer "1" must not be found inside "1990". Match tokens are single-space
separated, so padding both sides with a space makes a substring test exactly a contiguous-token test.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Mapping, Sequence

from ragtrain.eval.metrics import DEFAULT_KS, Run, _check_ks

__all__ = ["answer_recall", "has_answer", "match_tokens", "normalize_answer"]

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NOT_ALNUM = re.compile(r"[\W_]+")  # Unicode-aware: en dashes, curly quotes and ASCII punctuation alike


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace (SQuAD order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def match_tokens(s: str) -> str:
    """`s` as space-separated match tokens: lower case, every run of non-alphanumeric characters a separator, the
    articles a/an/the dropped (see the module doc for why this differs from `normalize_answer`)."""
    s = _NOT_ALNUM.sub(" ", s.lower())
    return " ".join(_ARTICLES.sub(" ", s).split())


def has_answer(normalized_text: str, normalized_answers: Sequence[str]) -> bool:
    """Whether one of the (already `match_tokens`, non-empty) answers is a run of whole tokens of the text."""
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
        golds = [n for n in (match_tokens(a) for a in answers.get(qid, ())) if n]
        if not golds:
            continue  # an answer with no token (e.g. "the") can be found in no passage
        first = math.inf  # 1-based rank of the first passage holding an answer
        for rank, pid in enumerate(run.get(qid, ())[:depth], start=1):
            if pid not in norm_cache:
                norm_cache[pid] = match_tokens(texts[pid])
            if has_answer(norm_cache[pid], golds):
                first = rank
                break
        for k in ks_:
            hits[k].append(1.0 if first <= k else 0.0)
    n = len(hits[ks_[0]])
    if not n:
        raise ValueError("no evaluable question: none of the evaluated questions has a non-empty gold answer")
    return {f"answer_recall@{k}": math.fsum(hits[k]) / n for k in ks_}
