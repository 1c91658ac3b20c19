"""EM / F1 against the SQuAD v1.1 reference definitions (evaluate-v1.1.py, reproduced verbatim below)."""

from __future__ import annotations

import re
import string
from collections import Counter

import pytest

from ragtrain.eval.qa_metrics import exact_match, f1_score, normalize_answer, score


# --- reference: the official SQuAD v1.1 evaluation script's functions, unchanged ---------------------------
def ref_normalize_answer(s):
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


def ref_f1_score(prediction, ground_truth):
    prediction_tokens = ref_normalize_answer(prediction).split()
    ground_truth_tokens = ref_normalize_answer(ground_truth).split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    f1 = (2 * precision * recall) / (precision + recall)
    return f1


def ref_exact_match_score(prediction, ground_truth):
    return ref_normalize_answer(prediction) == ref_normalize_answer(ground_truth)


# -------------------------------------------------------------------------------------------------------------


# (prediction, gold, expected EM, expected F1)
CASES = [
    ("Ziadiaford", "ziadiaford", 1.0, 1.0),  # case
    ("the oboe", "oboe", 1.0, 1.0),  # articles dropped
    ("An Oboe.", "oboe", 1.0, 1.0),  # article + punctuation
    ("hurdy-gurdy", "hurdy-gurdy", 1.0, 1.0),
    ("hurdy - gurdy", "hurdy-gurdy", 0.0, 0.0),  # punctuation removed, not replaced: "hurdy gurdy" vs "hurdygurdy"
    ("Graqui Shipping Company", "the Graqui Shipping Company", 1.0, 1.0),
    ("Graqui Shipping", "Graqui Shipping Company", 0.0, 0.8),  # P=1, R=2/3
    ("Graqui Glassworks Company", "Graqui Shipping Company", 0.0, 2 / 3),
    ("1859", "1859", 1.0, 1.0),
    ("1859.", "in 1859", 0.0, 2 / 3),
    ("", "oboe", 0.0, 0.0),
    ("the", "a", 1.0, 0.0),  # both normalise to "", EM 1; F1 0 (v1.1: no common tokens)
    ("cello cello", "cello", 0.0, 2 / 3),  # multiset overlap: P=1/2, R=1
    ("  tax   assessor ", "tax assessor", 1.0, 1.0),
    ("theatre", "the atre", 0.0, 0.0),  # "the" is only removed as a whole word
    ("Ann's harp", "anns harp", 1.0, 1.0),
]


@pytest.mark.parametrize("pred,gold,em,f1", CASES)
def test_table_matches_expected_and_reference(pred: str, gold: str, em: float, f1: float) -> None:
    assert exact_match(pred, gold) == em == float(ref_exact_match_score(pred, gold))
    assert f1_score(pred, gold) == pytest.approx(f1) and f1_score(pred, gold) == pytest.approx(ref_f1_score(pred, gold))
    assert normalize_answer(pred) == ref_normalize_answer(pred)


def test_score_takes_the_best_gold_and_averages() -> None:
    out = score(["oboe", "Graqui Shipping", "x"], [["viola", "the oboe"], ["Graqui Shipping Company"], ["y"]])
    assert out["em"] == pytest.approx(1 / 3)
    assert out["f1"] == pytest.approx((1.0 + 0.8 + 0.0) / 3)
    assert out["n"] == 3
    with pytest.raises(ValueError, match="2 predictions for 1 questions"):
        score(["a", "b"], [["a"]])
