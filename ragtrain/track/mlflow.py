"""The one place that imports mlflow: run creation on the driver, metric sinks for rank 0, artifacts."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ragtrain.config import LoggerBackend, LoggerConfig

MAX_PARAM_LEN = 6000  # MLflow's param value limit (older servers: 500; we truncate long values explicitly)


def default_tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else a SQLite file under ./mlruns (embedded default for laptops)."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    root = Path("mlruns").resolve()
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def tracking_uri(cfg: LoggerConfig) -> str:
    """The tracking URI this run uses: logger.tracking_uri > $MLFLOW_TRACKING_URI > local SQLite."""
    return cfg.tracking_uri or default_tracking_uri()


def mlflow_key(name: str) -> str:
    """The MLflow spelling of a metric name ('@' is not allowed there)."""
    return name.replace("@", "_at_")


_CLIENTS: dict = {}  # per process: MlflowClient by tracking URI


@dataclass
class MetricSink:
    """Picklable handle that rank 0 of a Ray Train worker group uses to log into the driver's run."""

    uri: str
    run_id: str

    def client(self):  # -> MlflowClient
        """The process's client for this URI, created once (the first one imports mlflow and opens the store)."""
        from mlflow.tracking import MlflowClient

        if self.uri not in _CLIENTS:
            _CLIENTS[self.uri] = MlflowClient(self.uri)
        return _CLIENTS[self.uri]

    def warm_up(self) -> None:
        """Pay mlflow's import and store start-up (~2.5 s) now, not inside the first timed window."""
        self.client()

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log a batch of metrics at `step` (one HTTP/SQL round trip)."""
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        # MLflow metric names may not contain '@': ndcg@10 is logged as ndcg_at_10.
        items = [Metric(mlflow_key(k), float(v), ts, step) for k, v in metrics.items()]
        self.client().log_batch(self.run_id, metrics=items)


class RunLogger:
    """Driver-side logger for one pipeline run; a no-op when logger.backend=none."""

    def __init__(
        self, cfg: LoggerConfig, run_name: str, artifact_root: Optional[str] = None, parent_run_id: Optional[str] = None
    ):
        self.enabled = LoggerBackend(cfg.backend) == LoggerBackend.mlflow
        self.run_id: Optional[str] = None
        self.uri = tracking_uri(cfg) if self.enabled else ""
        if not self.enabled:
            return
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(self.uri)
        exp = self.client.get_experiment_by_name(cfg.experiment_name)
        if exp is None:
            # Pin artifacts next to the SQLite file; a server URI decides its own artifact store.
            loc = None
            if self.uri.startswith("sqlite:///"):
                loc = Path(self.uri[len("sqlite:///") :]).parent.joinpath("artifacts").as_uri()
            exp_id = self.client.create_experiment(cfg.experiment_name, artifact_location=artifact_root or loc)
        else:
            exp_id = exp.experiment_id
        tags = {"mlflow.parentRunId": parent_run_id} if parent_run_id else None  # a sweep's trial: a child run
        self.run_id = self.client.create_run(exp_id, run_name=cfg.run_name or run_name, tags=tags).info.run_id

    def sink(self) -> Optional[MetricSink]:
        """A handle for rank 0 to log training metrics into this run."""
        return MetricSink(self.uri, self.run_id) if self.enabled and self.run_id else None

    def log_params(self, params: dict[str, Any]) -> None:
        """Log flattened params (values truncated to MLflow's limit)."""
        if not self.enabled:
            return
        from mlflow.entities import Param

        items = [Param(k, str(v)[:MAX_PARAM_LEN]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):  # log_batch takes at most 100 params per call
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        """Log metrics at a step."""
        if self.enabled and metrics:
            MetricSink(self.uri, self.run_id).log(metrics, step)

    def log_artifact(self, path: str | Path, artifact_path: Optional[str] = None) -> None:
        """Upload a file or folder."""
        if not self.enabled:
            return
        p = Path(path)
        if p.is_dir():
            self.client.log_artifacts(self.run_id, str(p), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(p), artifact_path)

    def log_json(self, obj: Any, name: str) -> None:
        """Write `obj` as JSON and upload it as artifact `name`."""
        if not self.enabled:
            return
        with tempfile.TemporaryDirectory() as d:
            f = Path(d) / name
            f.write_text(json.dumps(obj, indent=2, sort_keys=True))
            self.client.log_artifact(self.run_id, str(f))

    def end(self, status: str = "FINISHED") -> None:
        """Close the run (FINISHED or FAILED)."""
        if self.enabled and self.run_id:
            self.client.set_terminated(self.run_id, status)
