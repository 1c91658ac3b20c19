"""The RAG answer likelihood's formulas (ragtrain/eval/likelihood.py) on cases worked out by hand."""

from __future__ import annotations

import math

import pytest

from ragtrain.eval.likelihood import mean_nll, question_nll, rag_sequence_nll


def test_two_passages_by_hand() -> None:
    # scores 0.9 and 0.7 at temperature 0.1: p_R = softmax([9, 7]) = [1, e^-2] / (1 + e^-2); the answer's
    # probability given each passage 0.5 and 0.1: -log (0.5 + 0.1 e^-2) / (1 + e^-2) = -log 0.45232 = 0.79337
    nll = rag_sequence_nll([0.9, 0.7], [math.log(0.5), math.log(0.1)], temperature=0.1)
    assert nll == pytest.approx(-math.log((0.5 + 0.1 * math.exp(-2)) / (1 + math.exp(-2))), abs=1e-12)
    assert nll == pytest.approx(0.79337, abs=1e-5)
    # equal scores (or any scores at a temperature far above their spread): the plain mean, -log 0.3 = 1.20397
    assert rag_sequence_nll([0.8, 0.8], [math.log(0.5), math.log(0.1)], 0.1) == pytest.approx(-math.log(0.3))
    assert rag_sequence_nll([0.9, 0.7], [math.log(0.5), math.log(0.1)], 1e6) == pytest.approx(1.20397, abs=1e-5)
    # the marginal lies between the best and the worst passage's NLL, and a sharper retriever moves it to its top one
    sharp = rag_sequence_nll([0.9, 0.7], [math.log(0.5), math.log(0.1)], 1e-3)
    assert sharp == pytest.approx(-math.log(0.5), abs=1e-9) and -math.log(0.5) < nll < -math.log(0.1)


def test_large_scores_over_a_small_temperature_do_not_overflow() -> None:
    # exp(100 / 0.01) overflows a float: the log-sum-exp form stays exact
    nll = rag_sequence_nll([100.0, 90.0], [-3.0, -1.0], temperature=0.01)
    assert nll == pytest.approx(3.0, abs=1e-12)
    assert math.isfinite(rag_sequence_nll([0.5], [-700.0], 0.1)) and rag_sequence_nll([0.5], [-2.0], 0.1) == 2.0


def test_question_figures_and_their_means() -> None:
    one = question_nll([0.9, 0.7], [math.log(0.5), math.log(0.1)], math.log(0.8), 0.1)
    assert one["rag_nll_top1"] == pytest.approx(-math.log(0.5)) and one["oracle_nll"] == pytest.approx(-math.log(0.8))
    none = question_nll([0.9], [math.log(0.25)], None, 0.1)  # no gold passage: no oracle figure
    assert none["oracle_nll"] is None and none["rag_nll"] == pytest.approx(-math.log(0.25))
    m = mean_nll([one, none])
    assert m["n"] == 2 and m["oracle_nll"] == pytest.approx(-math.log(0.8))  # over the question that has it
    assert m["rag_nll_top1"] == pytest.approx((-math.log(0.5) - math.log(0.25)) / 2)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="one score per passage"):
        rag_sequence_nll([0.9, 0.7], [-1.0], 0.1)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        rag_sequence_nll([0.9], [-1.0], 0.0)
