"""ragtrain.commands.compare against a real MLflow SQLite store: runs logged the way the pipeline logs them, read back.

The end-to-end version (runs made by a real sweep) is in tests/tune/test_sweep.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from ragtrain.commands.compare import compare_runs, main, sync_label
from ragtrain.config import Config, to_flat_dict
from ragtrain.config.logger import LoggerConfig
from ragtrain.config.sync import SyncConfig
from ragtrain.track.mlflow import RunLogger
from tests.conftest import sync_config

RUNS = {  # name -> (sync config, final metrics, loss curve)
    "ddp": (
        sync_config("ddp"),
        {"trained/ndcg_at_10": 0.91, "run/comm/bytes_per_step": 8e6, "run/drift/replica_cosine_mean": 0.0},
        [(5, 2.0), (10, 1.5)],
    ),
    "topk": (
        sync_config("topk"),
        {"trained/ndcg_at_10": 0.88, "run/comm/bytes_per_step": 2e5, "run/drift/replica_cosine_mean": 0.02},
        [(5, 2.1), (10, 1.7)],
    ),
    "adaptive": (
        sync_config("local_sgd_adaptive", mixer={"period": 4}),
        {"trained/ndcg_at_10": 0.9, "run/comm/bytes_per_step": 1e6, "run/drift/replica_cosine_mean": 0.05},
        [(5, 2.2), (10, 1.6)],
    ),
}


def _log(uri: str, exp: str, name: str, sync: SyncConfig, metrics: dict, curve: list, parent: str | None = None) -> str:
    cfg = replace(Config(), sync=sync, experiment_name=name)
    logger = RunLogger(LoggerConfig(tracking_uri=uri, experiment_name=exp), run_name=name, parent_run_id=parent)
    logger.log_params(to_flat_dict(cfg))
    for step, loss in curve:
        logger.log_metrics({"train/loss": loss}, step=step)
    logger.log_metrics(metrics, step=curve[-1][0])
    logger.end()
    return logger.run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    ids = {name: _log(uri, "cmp", name, *spec) for name, spec in RUNS.items()}
    summary = RunLogger(LoggerConfig(tracking_uri=uri, experiment_name="cmp"), run_name="cmp/comparison")
    summary.end()  # no metrics (like sync_compare's summary run): left out of the comparison
    parent = RunLogger(
        LoggerConfig(tracking_uri=uri, experiment_name="cmp"), "cmp/sweep", tags={"ragtrain.role": "sweep"}
    )
    parent.log_metrics({"best/trained/ndcg@10": 0.9})
    children = {
        n: _log(uri, "cmp", f"cmp/t{i} {n}", RUNS[n][0], RUNS[n][1], RUNS[n][2], parent.run_id)
        for i, n in enumerate(["ddp", "topk"])
    }
    parent.end()
    return uri, tmp, ids, parent.run_id, children


def test_experiment_table_matches_logged_values(store) -> None:
    uri, tmp, ids, _, _ = store
    df, files = compare_runs(uri, experiment="cmp", out_dir=tmp / "rep")
    assert len(df) == 5  # 3 plain runs + 2 sweep children; no parent, no metric-less summary
    client = MlflowClient(uri)
    for _, row in df.iterrows():
        logged = client.get_run(row["run_id"]).data.metrics
        for key in ("trained/ndcg_at_10", "run/comm/bytes_per_step", "run/drift/replica_cosine_mean", "train/loss"):
            assert row[key] == pytest.approx(logged[key])
    csv = pd.read_csv(tmp / "rep" / "comparison.csv")
    assert list(csv["run_id"]) == list(df["run_id"])
    assert csv["trained/ndcg_at_10"].tolist() == pytest.approx(df["trained/ndcg_at_10"].tolist())
    by = df.set_index("run_id")
    assert by.loc[ids["topk"], "sync"] == "topk" and by.loc[ids["adaptive"], "sync"] == "local_sgd_adaptive"
    for name, (_, final, curve) in RUNS.items():  # against what was logged, not MLflow's own summary of it
        row = by.loc[ids[name]]
        assert {k: row[k] for k in final} == pytest.approx(final) and row["train/loss"] == curve[-1][1]
        # runs of different ragtrain experiments in one MLflow experiment say so
        assert row["experiment_name"] == name
    assert {"sync.strategy", "sync.label", "sync.mixer.period"} <= set(df.columns)  # params that differ between runs
    assert "output_dir" not in df.columns  # ... but not the ones that always differ
    names = {f.name: f for f in files}
    assert set(names) == {"comparison.csv", "comparison.md", "comparison.png", "learning_curves.png"}
    for png in ("comparison.png", "learning_curves.png"):
        assert names[png].stat().st_size > 5000
        assert names[png].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| topk" in names["comparison.md"].read_text()


def test_parent_run_gives_its_trials(store) -> None:
    uri, tmp, _, parent, children = store
    df, _ = compare_runs(uri, parent_run_id=parent, out_dir=tmp / "rep_parent")
    assert sorted(df["run_id"]) == sorted(children.values())
    assert set(df["run"]) == {"t0 ddp", "t1 topk"}


def test_duplicate_run_names_get_ids(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    a = _log(uri, "dup", "quickstart", *RUNS["ddp"])
    b = _log(uri, "dup", "quickstart", *RUNS["topk"])
    df, _ = compare_runs(uri, experiment="dup", out_dir=tmp_path / "rep")
    assert list(df["run"]) == [f"quickstart ({a[:6]})", f"quickstart ({b[:6]})"]


def test_cli(store, tmp_path: Path, capsys) -> None:
    uri, _, ids, _, _ = store
    assert (
        main(
            [
                "--experiment",
                "cmp",
                "--tracking-uri",
                uri,
                "--out",
                str(tmp_path / "cli"),
                "--metric",
                "trained/ndcg@10",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "trained/ndcg_at_10" in out and "local_sgd_adaptive" in out
    assert (tmp_path / "cli" / "comparison.png").stat().st_size > 5000
    assert main(["--experiment", "nope", "--tracking-uri", uri, "--out", str(tmp_path / "x")]) == 2
    assert "no MLflow experiment 'nope'" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["--parent-run-id", "0" * 32, "--tracking-uri", uri, "--out", str(tmp_path / "x")]) == 2
    assert "no MLflow run" in capsys.readouterr().err
    missing = f"sqlite:///{tmp_path / 'none' / 'mlflow.db'}"
    assert main(["--experiment", "cmp", "--tracking-uri", missing, "--out", str(tmp_path / "x")]) == 2
    assert "no MLflow store at" in capsys.readouterr().err and not (tmp_path / "none").exists()
    with pytest.raises(SystemExit):
        main(["--tracking-uri", uri])  # argparse: one of --experiment / --parent-run-id is required
    # a metric asked for by name that no run logged: exit 2 naming it and what was logged, nothing written
    for flag in ("--metric", "--curve"):
        assert (
            main(
                [
                    "--experiment",
                    "cmp",
                    "--tracking-uri",
                    uri,
                    "--out",
                    str(tmp_path / "typo"),
                    flag,
                    "trained/ndcg_at_1O",
                ]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert "logged ['trained/ndcg_at_1O']; metrics there: [" in err and "'trained/ndcg_at_10'" in err
        assert not (tmp_path / "typo").exists()
    assert main(["--experiment", "cmp", "--tracking-uri", "foo://x", "--out", str(tmp_path / "x")]) == 2
    assert "unknown scheme 'foo'" in capsys.readouterr().err


def test_sync_label_inference() -> None:
    assert sync_label({"sync.label": "hybrid_powersgd", "sync.strategy": "hybrid"}, {}) == "hybrid_powersgd"
    # runs logged before the composed sync config (flat sync.compression / sync.adaptive)
    assert sync_label({"sync.strategy": "compressed", "sync.compression": "powersgd"}, {}) == "powersgd"
    assert sync_label({"sync.strategy": "local_sgd", "sync.adaptive": "False"}, {}) == "local_sgd"
    assert sync_label({"sync.strategy": "ddp"}, {"ragtrain.sync": "fp16"}) == "fp16"  # a sweep's tag wins
    assert sync_label({}, {}) == "?"


@pytest.mark.slow(
    reason="two pipeline runs of its own; the table built from logged values runs by default "
    "(test_experiment_table_matches_logged_values)"
)
def test_cli_on_plain_experiment_runs(ray_session, tmp_path: Path) -> None:
    """Two real pipeline runs (tiny encoder), then `python -m ragtrain compare`: the table is what they logged."""
    import subprocess
    import sys

    from ragtrain.config import to_typed
    from ragtrain.pipeline.stages import run
    from tests.conftest import REPO, compose, tiny_overrides

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for sync in ("ddp", "topk"):
        cfg = to_typed(
            compose(
                [
                    "experiment=quickstart",
                    *tiny_overrides(tmp_path),
                    f"sync={sync}",
                    f"output_dir={tmp_path / sync}",
                    "logger.experiment_name=plain",
                    "zeroshot_eval=false",
                ]
            )
        )
        run(cfg)
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ragtrain",
            "compare",
            "--experiment",
            "plain",
            "--tracking-uri",
            uri,
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "topk" in proc.stdout and "trained/ndcg_at_10" in proc.stdout
    csv = pd.read_csv(out / "comparison.csv")
    assert sorted(csv["sync"]) == ["ddp", "topk"]
    client = MlflowClient(uri)
    for _, row in csv.iterrows():
        logged = client.get_run(row["run_id"]).data.metrics
        assert row["trained/ndcg_at_10"] == pytest.approx(logged["trained/ndcg_at_10"])
        assert row["run/comm/bytes_per_step"] == pytest.approx(logged["run/comm/bytes_per_step"])
    for png in ("comparison.png", "learning_curves.png"):
        assert (out / png).stat().st_size > 5000
