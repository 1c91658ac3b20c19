"""Tracking URI precedence and the rank-0 metric sink against a real MLflow SQLite store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ragtrain.config.logger import LoggerConfig
from ragtrain.runtime.errors import ConfigError
from ragtrain.track.mlflow import MetricSink, RunLogger, check_tracking_uri, tracking_uri


def test_uri_precedence(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri(LoggerConfig()) == f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"  # embedded default
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///env.db")
    assert tracking_uri(LoggerConfig()) == f"sqlite:///{tmp_path / 'env.db'}"
    assert tracking_uri(LoggerConfig(tracking_uri="sqlite:////abs/cfg.db")) == "sqlite:////abs/cfg.db"  # config wins


def test_a_relative_file_store_is_made_absolute_where_the_run_starts(tmp_path: Path, monkeypatch) -> None:
    """Rank 0 logs through the URI the driver hands it, from a working folder of its own (its raylet's, on a
    cluster): a relative path must mean the driver's folder before it leaves the driver."""
    monkeypatch.chdir(tmp_path)
    assert tracking_uri(LoggerConfig(tracking_uri="sqlite:///mlflow/m.db")) == f"sqlite:///{tmp_path}/mlflow/m.db"
    assert tracking_uri(LoggerConfig(tracking_uri="file://runs")) == f"file://{tmp_path}/runs"
    assert tracking_uri(LoggerConfig(tracking_uri="runs")) == str(tmp_path / "runs")  # a bare path: a file store
    for kept in ("http://mlflow:5000", "databricks", "postgresql://db/mlflow", "sqlite:////abs/m.db"):
        assert tracking_uri(LoggerConfig(tracking_uri=kept)) == kept


def test_sink_logs_steps_and_sanitises_names(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    logger = RunLogger(LoggerConfig(tracking_uri=uri, experiment_name="sink-test"), run_name="r")
    sink = logger.sink()
    assert isinstance(sink, MetricSink)
    sink.warm_up()
    sink.log({"train/loss": 1.5, "eval/ndcg@10": 0.5}, step=3)
    sink.log({"train/loss": 1.0}, step=6)
    logger.end()
    client = MlflowClient(uri)
    assert [(m.step, m.value) for m in client.get_metric_history(logger.run_id, "train/loss")] == [(3, 1.5), (6, 1.0)]
    assert client.get_metric_history(logger.run_id, "eval/ndcg_at_10")[0].value == 0.5
    assert client.get_run(logger.run_id).info.status == "FINISHED"


def test_backend_none_logs_nothing(tmp_path: Path) -> None:
    logger = RunLogger(LoggerConfig(backend="none"), run_name="r")
    assert logger.sink() is None and not logger.enabled
    logger.log_metrics({"a": 1.0})
    logger.end()


def test_the_default_store_folder_is_made_by_the_run_not_by_its_checks(tmp_path: Path, monkeypatch) -> None:
    """Reading the default URI (what the checks before a run do) creates nothing; the run's logger creates ./mlruns."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = tracking_uri(LoggerConfig())
    assert uri == f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}" and not (tmp_path / "mlruns").exists()
    run = RunLogger(LoggerConfig(experiment_name="default-store"), "r")
    assert (tmp_path / "mlruns" / "mlflow.db").is_file()
    assert MlflowClient(uri).get_run(run.run_id).info.run_name == "r"


def _broken_store(folder: Path, how: str) -> Path:
    """A SQLite store as a careless user leaves it: random bytes, a copy cut short, another program's database."""
    import sqlite3

    from tests.conftest import mlflow_db

    db = folder / f"{how}.db"
    if how == "garbage":
        db.write_bytes(bytes(range(256)) * 40)
    elif how == "truncated":
        mlflow_db(folder / "whole.db")
        whole = (folder / "whole.db").read_bytes()
        db.write_bytes(whole[: len(whole) // 3])
        (folder / "whole.db").unlink()
    elif how == "foreign":
        con = sqlite3.connect(db)
        con.execute("CREATE TABLE notes (text TEXT)")
        con.commit()
        con.close()
    return db


@pytest.mark.parametrize(
    ("how", "match"),
    [
        ("garbage", r"cannot be used as an MLflow store \(file is not a database\)"),
        ("truncated", r"cannot be used as an MLflow store \(database disk image is malformed"),
        ("foreign", r"is a SQLite database but not an MLflow store \(it lacks the tables \['alembic_version'"),
    ],
)
def test_a_broken_sqlite_store_fails_its_check_naming_the_file(tmp_path: Path, how: str, match: str) -> None:
    """It passed the check (its folder is writable) and failed after Ray and the data were up, 85 lines long."""
    db = _broken_store(tmp_path, how)
    with pytest.raises(ConfigError, match=rf"logger.tracking_uri .*: {db} {match}"):
        check_tracking_uri(f"sqlite:///{db}")


def test_a_store_this_user_cannot_write_fails_its_check(tmp_path: Path) -> None:
    """A read-only store: MLflow reads it and fails at the run's first write. Root writes whatever the mode bits say,
    so as root the check runs in a child without the capabilities that override file modes (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH): still the owner of the clone and the venv wherever they sit, yet bound by the file's 0444."""
    import shutil
    import subprocess
    import sys

    from tests.conftest import REPO, mlflow_db

    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and setpriv is None:
        pytest.skip("no setpriv to drop root's file-mode override")
    prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"] if os.geteuid() == 0 else []
    db = tmp_path / "mlflow.db"
    uri = mlflow_db(db)
    db.chmod(0o444)
    code = f"from ragtrain.track.mlflow import check_tracking_uri; check_tracking_uri({uri!r})"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode != 0 and "attempt to write a readonly database" in r.stderr, r.stderr[-2000:]
    assert f"{db} cannot be used as an MLflow store" in r.stderr


def test_a_good_store_passes_and_is_not_changed(tmp_path: Path) -> None:
    from tests.conftest import mlflow_db

    uri = mlflow_db(tmp_path / "m.db")
    before = (tmp_path / "m.db").read_bytes()
    check_tracking_uri(uri)
    assert (tmp_path / "m.db").read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["m.db"]
    (tmp_path / "empty.db").touch()  # an empty file: a new store, MLflow fills it
    check_tracking_uri(f"sqlite:///{tmp_path / 'empty.db'}")
