"""Paired bootstrap comparison of finished runs (python -m ragtrain paired)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ragtrain.commands.paired import Scored, answer_scores, bootstrap, main, paired_over_seeds, run_per_query
from ragtrain.commands.search import SearchError


def test_a_constant_gain_has_a_zero_width_interval_and_no_doubt():
    a = {f"q{i}": v for i, v in enumerate(np.linspace(0.0, 1.0, 50))}
    b = {q: v + 0.1 for q, v in a.items()}
    rows = bootstrap([Scored("a", a), Scored("b", b)], resamples=500)
    assert rows[0]["mean"] == pytest.approx(0.5) and "diff" not in rows[0]
    assert rows[1]["diff"] == pytest.approx(0.1) and rows[1]["p_not_better"] == 0.0
    assert rows[1]["diff_low"] == pytest.approx(0.1) and rows[1]["diff_high"] == pytest.approx(0.1)
    assert rows[0]["ci_low"] < 0.5 < rows[0]["ci_high"]  # the mean itself varies with the resampled queries


def test_one_query_flipped_out_of_a_hundred_is_within_the_noise():
    a = {f"q{i}": float(i % 2) for i in range(100)}
    b = dict(a, q0=1.0)  # one query better: +0.01
    row = bootstrap([Scored("a", a), Scored("b", b)], resamples=2000)[1]
    assert row["diff"] == pytest.approx(0.01) and row["diff_low"] == 0.0  # many resamples miss q0 entirely
    assert row["p_not_better"] > 0.2


def test_runs_of_other_queries_are_refused():
    with pytest.raises(ValueError, match="other queries"):
        bootstrap([Scored("a", {"q1": 1.0}), Scored("b", {"q2": 1.0})])


@pytest.mark.integration
def test_rescoring_a_run_reproduces_its_own_figure(quickstart_run, capsys):
    cfg, results, _ = quickstart_run
    values = run_per_query(cfg.output_dir)
    assert np.mean(list(values.values())) == pytest.approx(results["trained"]["ndcg@10"], abs=1e-9)
    assert main([cfg.output_dir, cfg.output_dir, "--resamples", "200"]) == 0
    out = capsys.readouterr().out
    assert "+0.0000" in out and "paired bootstrap" in out and "(same)" in out  # the second run changes no key


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "at least two" in capsys.readouterr().err
    assert main([str(tmp_path), str(tmp_path), "--metric", "ndcg@7"]) == 2
    assert "valid choices" in capsys.readouterr().err
    assert main([str(tmp_path), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a ragtrain run folder" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "config.yaml").write_text("seed: 0\n")  # a run folder that never built an index
    assert main([str(tmp_path), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no index" in err and len(err.strip().splitlines()) == 1


def test_better_and_worse_count_the_queries_each_way():
    a = {"q0": 0.0, "q1": 1.0, "q2": 0.5, "q3": 0.5}
    b = {"q0": 1.0, "q1": 0.0, "q2": 1.0, "q3": 0.5}
    row = bootstrap([Scored("a", a), Scored("b", b)], resamples=200)[1]
    assert (row["better"], row["worse"]) == (2.0, 1.0)


def _answers_run(folder: Path, stage: str, rag: list[str], seed: int = 0) -> Path:
    """A run folder with a config.yaml and `stage`/predictions.json: rag answers to 3 fixed questions."""
    golds = [["Paris", "the city of Paris"], ["1889"], ["Gustave Eiffel"]]
    rows = [
        {"qid": f"q{i}", "question": "?", "prediction": p, "answers": g, "passages": []}
        for i, (p, g) in enumerate(zip(rag, golds))
    ]
    (folder / stage).mkdir(parents=True)
    (folder / stage / "predictions.json").write_text(json.dumps({"rag": rows, "closed_book": rows[:1]}))
    (folder / "config.yaml").write_text(f"seed: {seed}\nstages: [index, {stage}]\n")
    return folder


def test_answer_metrics_score_each_saved_answer_as_squad_does(tmp_path, capsys):
    a = _answers_run(tmp_path / "a", "generator", ["The Paris.", "in 1889", "Eiffel"])
    b = _answers_run(tmp_path / "b", "joint", ["the city of paris", "1889", "Eiffel"])
    assert answer_scores(a, "rag/em") == {"q0": 1.0, "q1": 0.0, "q2": 0.0}  # articles and punctuation normalised
    assert answer_scores(a, "rag/f1")["q2"] == pytest.approx(2 * 1 * 0.5 / 1.5)  # best over the gold answers
    (b / "generator").mkdir()  # both stages ran: the joint stage's answers are the run's figures
    (b / "generator" / "predictions.json").write_text(json.dumps({"rag": []}))
    assert answer_scores(b, "rag/em") == {"q0": 1.0, "q1": 1.0, "q2": 0.0}
    assert main([str(a), str(b), "--metric", "rag/em", "--resamples", "200"]) == 0
    out = capsys.readouterr().out
    assert "+0.3333" in out and "1 / 0" in out and "(3 questions, paired bootstrap)" in out
    with pytest.raises(SearchError, match="evaluated modes are"):
        answer_scores(a, "oracle/em")
    assert main([str(a), str(tmp_path)]) == 2  # not a run folder
    assert "not a ragtrain run folder" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    assert main([str(a), str(tmp_path), "--metric", "rag/em"]) == 2
    err = capsys.readouterr().err
    assert "holds no generator answers" in err and len(err.strip().splitlines()) == 1


def test_variants_over_seeds_pair_each_question_with_the_first_variant_at_the_same_seed(tmp_path):
    runs = {
        "frozen": {s: _answers_run(tmp_path / f"f{s}", "generator", ["Paris", "no", "no"], s) for s in (0, 1)},
        "joint": {
            0: _answers_run(tmp_path / "j0", "joint", ["Paris", "1889", "no"]),
            1: _answers_run(tmp_path / "j1", "joint", ["no", "no", "no"], 1),
        },
    }
    rows = paired_over_seeds(runs, "rag/em", resamples=200)
    assert rows[0]["queries"] == 6.0 and rows[0]["mean"] == pytest.approx(2 / 6)
    assert rows[1]["diff"] == pytest.approx(0.0) and (rows[1]["better"], rows[1]["worse"]) == (1.0, 1.0)


def test_the_cli_pools_a_compare_seeds_experiment_per_variant_folder(tmp_path, capsys):
    for s, (f, j) in enumerate([(["Paris", "no", "no"], ["Paris", "1889", "no"]), (["no"] * 3, ["no", "1889", "no"])]):
        _answers_run(tmp_path / "frozen" / f"seed{s}", "generator", f, s)
        _answers_run(tmp_path / "joint" / f"seed{s}", "joint", j, s)
    argv = [str(tmp_path / "frozen"), str(tmp_path / "joint"), "--over-seeds", "--metric", "rag/em"]
    assert main([*argv, "--json", "--resamples", "200"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["run"] for r in rows] == ["frozen", "joint"] and rows[0]["queries"] == 6
    assert rows[1]["diff"] == pytest.approx(2 / 6) and (rows[1]["better"], rows[1]["worse"]) == (2, 0)
    assert main([str(tmp_path / "frozen"), str(tmp_path), "--over-seeds", "--metric", "rag/em"]) == 2
    err = capsys.readouterr().err
    assert "holds no seed<k>/ run folders" in err and len(err.strip().splitlines()) == 1
