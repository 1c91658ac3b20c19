"""Tracking URI precedence and the rank-0 metric sink against a real MLflow SQLite store."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from ragtrain.config import LoggerConfig
from ragtrain.track.mlflow import MetricSink, RunLogger, tracking_uri


def test_uri_precedence(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri(LoggerConfig()) == f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"  # embedded default
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///env.db")
    assert tracking_uri(LoggerConfig()) == "sqlite:///env.db"
    assert tracking_uri(LoggerConfig(tracking_uri="sqlite:///cfg.db")) == "sqlite:///cfg.db"  # config wins


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
