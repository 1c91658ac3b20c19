"""answer_recall@k against hand-computed cases, and the SQuAD normalisation it shares with EM / F1."""

from __future__ import annotations

import pytest

from ragtrain.eval.answers import answer_recall, has_answer, normalize_answer
from ragtrain.generator import qa_metrics


def test_normalisation_is_the_one_em_and_f1_use() -> None:
    assert qa_metrics.normalize_answer is normalize_answer
    assert normalize_answer("The  Denver Broncos!") == "denver broncos"


def test_an_answer_must_be_whole_tokens_of_the_passage() -> None:
    text = normalize_answer("In 1990, the Broncos won; an Anna-Maria scored.")
    assert has_answer(text, ["broncos won"])
    assert has_answer(text, ["1990"])
    assert not has_answer(text, ["1"])  # inside "1990": not a token of the passage
    assert not has_answer(text, ["bronco"])
    assert has_answer(text, [normalize_answer("Anna-Maria")])  # punctuation removed on both sides alike


def test_answer_recall_hand_computed() -> None:
    texts = {
        "p1": "Super Bowl 50 was an American football game.",
        "p2": "The Denver Broncos defeated the Carolina Panthers 24-10.",
        "p3": "Levi's Stadium in Santa Clara, California.",
        "p4": "Nothing relevant here.",
    }
    run = {
        "q1": ["p1", "p2", "p3"],  # answer "Denver Broncos" first at rank 2
        "q2": ["p3", "p4"],  # answers: "Santa Clara" at rank 1 (the second gold answer matches)
        "q3": ["p4", "p1", "p2"],  # "Carolina Panthers" at rank 3
        "q4": ["p1", "p4"],  # "Broncos" retrieved nowhere in its top 2
        # q5 is missing from the run: it scores 0
    }
    answers = {
        "q1": ["Denver Broncos"],
        "q2": ["Levi Stadium", "Santa Clara"],
        "q3": ["the Carolina Panthers"],  # the article is dropped by the normalisation
        "q4": ["Broncos"],
        "q5": ["anything"],
        "q6": ["The"],  # normalises to nothing: not evaluable, not counted
    }
    qids = ["q1", "q2", "q3", "q4", "q5", "q6"]
    got = answer_recall(run, answers, texts, qids, ks=(1, 2, 3))
    # rank of first hit: q1 2, q2 1, q3 3, q4 -, q5 -  (5 evaluated questions)
    assert got == pytest.approx({"answer_recall@1": 1 / 5, "answer_recall@2": 2 / 5, "answer_recall@3": 3 / 5})


def test_answer_recall_without_an_answerable_question_is_an_error() -> None:
    with pytest.raises(ValueError, match="no evaluable question"):
        answer_recall({"q": ["p"]}, {"q": ["a"]}, {"p": "a"}, qids=["other"])
