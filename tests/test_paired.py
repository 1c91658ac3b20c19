"""Paired bootstrap comparison of finished runs (python -m ragtrain.paired)."""

from __future__ import annotations

import numpy as np
import pytest

from ragtrain.paired import Scored, bootstrap, main, run_per_query


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
