"""Paired comparisons question by question (ragtrain/eval/bootstrap.py) on hand-made per-question values with
known answers, and each run's per-question file (ragtrain/eval/per_question.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ragtrain.eval.bootstrap import paired_arrays, paired_bootstrap, paired_markdown, paired_table
from ragtrain.eval.per_question import per_question_rows, run_per_question, write_per_question

EM = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0] * 4  # 40 questions


def test_identical_runs_differ_by_exactly_zero_and_are_not_significant() -> None:
    d = paired_bootstrap(EM, list(EM), resamples=2000, seed=3)
    assert (d.diff, d.low, d.high) == (0.0, 0.0, 0.0) and not d.significant
    assert (d.n, d.better, d.worse) == (40, 0, 0) and d.mean == d.base_mean == pytest.approx(0.4)


def test_a_shifted_run_is_significant_in_its_direction() -> None:
    base = np.linspace(1.0, 3.0, 40)  # e.g. NLLs in nats: the questions differ a lot, the pairs by 0.1 each
    lower = paired_bootstrap(base, base - 0.1, resamples=1000, higher_is_better=False)
    assert lower.diff == pytest.approx(-0.1) and lower.low == pytest.approx(-0.1) and lower.high == pytest.approx(-0.1)
    assert lower.significant and (lower.better, lower.worse) == (40, 0)  # lower NLL: better on every pair
    higher = paired_bootstrap(base, base + 0.1, resamples=1000)
    assert higher.significant and higher.low > 0 and (higher.better, higher.worse) == (40, 0)


def test_unpaired_noise_is_not_significant_and_the_interval_holds_the_mean() -> None:
    rng = np.random.default_rng(0)
    base = rng.normal(2.0, 1.0, 200)
    other = base + rng.normal(0.0, 1.0, 200)  # no shift, only noise per question
    d = paired_bootstrap(base, other, seed=1)
    assert d.low < d.diff < d.high and d.low < 0 < d.high and not d.significant
    # one flipped answer of 40 is within noise: [0, +0.075] or so, never excluding 0
    flipped = list(EM)
    flipped[1] = 1.0
    one = paired_bootstrap(EM, flipped)
    assert one.diff == pytest.approx(0.025) and one.low == 0.0 and not one.significant and one.better == 1
    assert paired_bootstrap(base, other, seed=1) == d  # seeded: the same interval on every rerun


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="resamples must be >= 1000"):
        paired_bootstrap(EM, EM, resamples=999)
    with pytest.raises(ValueError, match="two 1-D arrays of one non-zero length"):
        paired_bootstrap(EM, EM[:-1])
    with pytest.raises(ValueError, match="other questions than the base at seed 1"):
        paired_arrays({0: {"a": 1.0}, 1: {"a": 1.0}}, {0: {"a": 0.0}, 1: {"b": 0.0}}, "joint_query")
    with pytest.raises(ValueError, match="ran at seeds \\[0\\], the base at \\[0, 1\\]"):
        paired_arrays({0: {"a": 1.0}, 1: {"a": 1.0}}, {0: {"a": 0.0}})


def test_pairs_are_the_same_question_at_the_same_seed() -> None:
    x, y = paired_arrays({1: {"b": 2.0, "a": 1.0}, 0: {"a": 5.0}}, {0: {"a": 6.0}, 1: {"a": 0.0, "b": 4.0}})
    assert x.tolist() == [5.0, 1.0, 2.0] and y.tolist() == [6.0, 0.0, 4.0]  # seed 0's a; seed 1's a, b


def _rows(em: list[float], nll: list[float]) -> dict[str, dict]:
    """One run's per-question rows: EM on the first 4 questions (EM's sample), the NLL on all of them."""
    rows = {f"q{i}": {"qid": f"q{i}", "likelihood/rag_nll": v} for i, v in enumerate(nll)}
    for i, v in enumerate(em):
        rows[f"q{i}"]["rag/em"] = v
    return rows


def test_the_table_pairs_each_variant_with_the_base_and_says_which_differences_are_significant() -> None:
    nll = [2.0, 1.5, 3.0, 2.5, 1.0, 4.0]
    runs = {
        "frozen": {0: _rows([1, 0, 0, 1], nll), 1: _rows([0, 0, 1, 1], nll)},
        "joint_query": {0: _rows([1, 0, 0, 1], [v - 0.25 for v in nll]), 1: _rows([0, 0, 1, 1], nll)},
    }
    rows = paired_table(runs, "frozen", ["rag/em", "likelihood/rag_nll"], lower_is_better=["likelihood/rag_nll"])
    by = {(r["variant"], r["metric"]): r for r in rows}
    em, lik = by[("joint_query", "rag/em")], by[("joint_query", "likelihood/rag_nll")]
    assert (em["n"], em["diff"], em["significant"]) == (8, 0.0, False)  # 2 seeds x 4 questions, the same answers
    assert lik["n"] == 12 and lik["diff"] == pytest.approx(-0.125) and (lik["better"], lik["worse"]) == (6, 0)
    assert lik["high"] < 0 and lik["significant"]  # lower at seed 0, equal at seed 1: every resample below 0
    # a run saved before the likelihood existed gets no likelihood row; one scored on other questions, no table
    old = {s: {q: {"qid": q, "rag/em": r["rag/em"]} for q, r in rows_.items() if "rag/em" in r}
           for s, rows_ in runs["frozen"].items()}  # fmt: skip
    kept = paired_table({**runs, "old": old}, "frozen", ["rag/em", "likelihood/rag_nll"])
    assert [(r["variant"], r["metric"]) for r in kept if r["variant"] == "old"] == [("old", "rag/em")]
    other = {0: runs["frozen"][0], 1: {**runs["frozen"][1], "q9": {"qid": "q9", "rag/em": 1.0}}}
    with pytest.raises(ValueError, match="other evaluates other questions than the base at seed 1"):
        paired_table({**runs, "other": other}, "frozen", ["rag/em"])
    table = paired_markdown(rows[:2], "frozen")
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()]
    assert cells[0] == ["variant", "metric", "pairs", "frozen", "variant's", "Δ", "95 % interval", "significant",
                        "better / worse"]  # fmt: skip
    assert cells[2] == [
        "joint_query",
        "rag/em",
        "8",
        "0.5000",
        "0.5000",
        "+0.0000",
        "[+0.0000, +0.0000]",
        "no",
        "0 / 0",
    ]
    assert cells[3] == ["joint_query", "likelihood/rag_nll", "12", "2.3333", "2.2083", "-0.1250",
                        f"[{lik['low']:+.4f}, {lik['high']:+.4f}]", "yes", "6 / 0"]  # fmt: skip


def test_a_runs_per_question_file_holds_em_f1_and_the_likelihood(tmp_path) -> None:
    predictions = {
        "rag": [{"qid": "b", "prediction": "The Broncos!", "answers": ["Denver Broncos", "broncos"]},
                {"qid": "a", "prediction": "Paris", "answers": ["Rome"]}],
        "oracle": [{"qid": "a", "prediction": "rome", "answers": ["Rome"]},
                   {"qid": "b", "prediction": "Denver", "answers": ["Denver Broncos"]}],
        "likelihood": [{"qid": "a", "rag_nll": 2.5, "rag_nll_top1": 3.0, "oracle_nll": 1.0},
                       {"qid": "b", "rag_nll": 0.5, "rag_nll_top1": 0.5, "oracle_nll": None},
                       {"qid": "c", "rag_nll": 1.5, "rag_nll_top1": 1.75, "oracle_nll": 1.25}],
    }  # fmt: skip
    rows = per_question_rows(predictions)
    assert [r["qid"] for r in rows] == ["a", "b", "c"]  # c: in the likelihood's larger set only
    assert rows[1] == {"qid": "b", "rag/em": 1.0, "rag/f1": 1.0, "oracle/em": 0.0, "oracle/f1": pytest.approx(2 / 3),
                       "likelihood/rag_nll": 0.5, "likelihood/rag_nll_top1": 0.5}  # fmt: skip
    assert rows[2] == {"qid": "c", "likelihood/rag_nll": 1.5, "likelihood/rag_nll_top1": 1.75,
                       "likelihood/oracle_nll": 1.25}  # fmt: skip
    (tmp_path / "run" / "joint").mkdir(parents=True)
    path = write_per_question(tmp_path / "run" / "joint", predictions)
    assert [json.loads(line)["qid"] for line in path.read_text().splitlines()] == ["a", "b", "c"]
    assert run_per_question(tmp_path / "run") == {r["qid"]: r for r in rows}
    # a run saved before the file existed: its predictions.json's EM / F1
    (tmp_path / "old" / "generator").mkdir(parents=True)
    (tmp_path / "old" / "generator" / "predictions.json").write_text(json.dumps({"rag": predictions["rag"]}))
    assert run_per_question(tmp_path / "old")["b"] == {"qid": "b", "rag/em": 1.0, "rag/f1": 1.0}
    assert run_per_question(tmp_path / "none") == {}
