"""The one place that imports mlflow: run creation on the driver, metric sinks for rank 0, artifacts."""

from __future__ import annotations

import base64
import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from ragtrain.config.logger import AUTH_ENV, LoggerBackend, LoggerConfig
from ragtrain.runtime.console import get_logger
from ragtrain.runtime.errors import ConfigError

log = get_logger(__name__)

MAX_PARAM_LEN = 6000  # MLflow's param value limit (older servers: 500; we truncate long values explicitly)


def default_tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else a SQLite file under ./mlruns (embedded default for laptops)."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    # Not created here: the checks before a run only read the URI, and a run that fails them leaves no folder behind
    return f"sqlite:///{Path('mlruns').resolve() / 'mlflow.db'}"


def sqlite_file(uri: str) -> Path | None:
    """The database file of a `sqlite:///` tracking URI, else None (a server or a file store)."""
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


def store_folder(uri: str) -> Path | None:
    """The local folder a tracking URI's store lives in: a SQLite file's folder, a file store (`file://` or a bare
    path) itself; None for a server or database URI (and MLflow's bare `databricks`)."""
    if uri == "databricks":
        return None
    scheme = urlsplit(uri).scheme if "://" in uri or uri.startswith("sqlite:") else ""
    if scheme == "sqlite":
        return Path(uri.split(":///", 1)[1]).parent
    if scheme in ("file", ""):
        return Path(uri.removeprefix("file://"))
    return None


def open_client(uri: str, **kwargs: Any):  # -> MlflowClient
    """An MlflowClient for `uri`; a SQLite store's folder is created first (SQLite creates the file, not its folder)."""
    from mlflow.tracking import MlflowClient  # lazy: mlflow is heavy (~1 s); this module imports without it

    db = sqlite_file(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(uri, **kwargs)


def tracking_uri(cfg: LoggerConfig) -> str:
    """The tracking URI this run uses: logger.tracking_uri > $MLFLOW_TRACKING_URI > local SQLite; a file store's
    relative path made absolute here, on the driver. Rank 0 logs through the URI it is handed (MetricSink), from a
    process whose working folder is its raylet's: on a cluster not the driver's, so `sqlite:///mlruns/x.db` would
    name another file there (seen on the emulated cluster: the shared-path check could not find the store's folder
    from the other node, though it was on the shared disk)."""
    return absolute_tracking_uri(cfg.tracking_uri or default_tracking_uri())


# Schemes MLflow's tracking store understands (a local path without a scheme is a file store)
TRACKING_SCHEMES = ("sqlite", "file", "http", "https", "postgresql", "mysql", "mssql", "databricks")
PROBE_TIMEOUT_S = 5.0


def redact_uri(uri: str) -> str:
    """The URI with any user:password@ part replaced, for messages and params."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


def check_tracking_uri(uri: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Fail in seconds, naming the setting, when the tracking store cannot work: an unknown scheme, a SQLite or
    file store whose folder cannot be written, a server that does not answer /health. Before anything starts:
    MLflow itself would retry for minutes, and only after Ray and the data were up."""
    where = "logger.tracking_uri (or MLFLOW_TRACKING_URI)"
    shown = redact_uri(uri)
    scheme = urlsplit(uri).scheme if "://" in uri or uri.startswith("sqlite:") else ""
    if scheme and scheme.split("+")[0] not in TRACKING_SCHEMES:
        raise ConfigError(
            f"{where}={shown!r}: unknown scheme {scheme!r}; valid choices: {list(TRACKING_SCHEMES)} or a local folder"
        )
    folder = store_folder(uri)
    if folder is not None:
        db = sqlite_file(uri)
        if db is not None and db.is_dir():
            raise ConfigError(
                f"{where}={shown!r}: {db} is a folder, not a database file; name a file in it, e.g. "
                f"sqlite:///{db / 'mlflow.db'}"
            )
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent  # the nearest existing folder: MLflow creates the rest
        if not folder.is_dir():  # a file where a folder must go: nothing can be created under it
            raise ConfigError(f"{where}={shown!r}: {folder} is a file, not a folder; choose another path")
        try:  # os.access says yes to root everywhere, /proc included: create (and remove) a file to be sure
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".ragtrain-probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise ConfigError(
                f"{where}={shown!r}: nothing can be created in {folder} ({e.strerror}); choose a writable path"
            ) from None
        if db is not None and db.exists():
            check_sqlite_store(db, f"{where}={shown!r}")
        return
    if scheme in ("http", "https"):
        request = urllib.request.Request(uri.rstrip("/") + "/health")
        user, password = (os.environ.get(k) for k in AUTH_ENV)
        if user or password:  # the server's basic auth, as MLflow's client sends it
            token = base64.b64encode(f"{user or ''}:{password or ''}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                if r.status != 200:
                    raise OSError(f"HTTP {r.status}")
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                raise ConfigError(
                    f"{where}={shown!r} refused the credentials (HTTP {e.code}): check the user and "
                    f"password in the URI or in {' / '.join(AUTH_ENV)}"
                ) from None
            raise ConfigError(
                f"{where}={shown!r} answers /health with HTTP {e.code}: is it an MLflow server?"
            ) from None
        except (OSError, urllib.error.URLError) as e:
            raise ConfigError(
                f"{where}={shown!r} does not answer within {timeout:.0f}s ({e}): start the MLflow "
                "server, fix the URI, or use logger=none"
            ) from None


# Tables of MLflow's SQLite schema that a run writes into: a database without them is not an MLflow store
MLFLOW_TABLES = ("alembic_version", "experiments", "runs", "metrics", "params")


def check_sqlite_store(db: Path, setting: str) -> None:
    """Open an existing SQLite store as MLflow will and write to it (rolled back): a file that is not a database, a
    truncated one, another program's database or one this process cannot write fails now, in one line naming the
    file, not after Ray and the data are up (MLflow would fail there with a long traceback). SQLite itself, not
    MLflow: milliseconds, where importing MLflow takes seconds. An empty file is a new store (MLflow fills it)."""
    import sqlite3  # lazy: only SQLite stores need it

    if db.stat().st_size == 0:
        return
    con = None
    try:
        con = sqlite3.connect(f"file:{db}?mode=rw", uri=True, timeout=10, isolation_level=None)
        damage = con.execute("PRAGMA quick_check").fetchone()[0]
        if damage != "ok":
            raise sqlite3.DatabaseError(f"database disk image is malformed: {damage}")
        tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        missing = [t for t in MLFLOW_TABLES if t not in tables]
        con.execute("BEGIN IMMEDIATE")  # a write lock, then a write (it creates the journal), never committed
        con.execute("CREATE TABLE ragtrain_write_probe (x INTEGER)")
        con.execute("ROLLBACK")
    except sqlite3.Error as e:  # "file is not a database", "malformed", "attempt to write a readonly database"
        raise ConfigError(
            f"{setting}: {db} cannot be used as an MLflow store ({e}); repair or remove the file, or choose "
            "another logger.tracking_uri"
        ) from None
    finally:
        if con is not None:
            con.close()
    if tables and missing:
        raise ConfigError(
            f"{setting}: {db} is a SQLite database but not an MLflow store (it lacks the tables {missing}); "
            "choose another file for logger.tracking_uri"
        )


def mlflow_key(name: str) -> str:
    """The MLflow spelling of a metric name ('@' is not allowed there)."""
    return name.replace("@", "_at_")


_CLIENTS: dict = {}  # per process: MlflowClient by tracking URI
_LAST_LOGGED: dict = {}  # per process: (uri, run id) -> {metric key: last step already in the run}


@dataclass
class MetricSink:
    """Picklable handle that rank 0 of a Ray Train worker group uses to log into the driver's run."""

    uri: str
    run_id: str
    # Resumed runs: skip (key, step) pairs the run already holds, so a restart that replays steps after its
    # checkpoint logs each step exactly once (the replayed values equal the logged ones: training is deterministic).
    skip_logged: bool = False

    def client(self):  # -> MlflowClient
        """The process's client for this URI, created once (the first one imports mlflow and opens the store)."""
        if self.uri not in _CLIENTS:
            _CLIENTS[self.uri] = open_client(self.uri)
        return _CLIENTS[self.uri]

    def warm_up(self) -> None:
        """Pay mlflow's import and store start-up (~2.5 s) now, not inside the first timed window."""
        self.client()

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log a batch of metrics at `step` (one HTTP/SQL round trip)."""
        from mlflow.entities import Metric  # lazy: mlflow is heavy (~1 s); this module imports without it

        ts = int(time.time() * 1000)
        # MLflow metric names may not contain '@': ndcg@10 is logged as ndcg_at_10.
        items = [Metric(mlflow_key(k), float(v), ts, step) for k, v in metrics.items()]
        if self.skip_logged:
            items = [m for m in items if step > self._last_logged(m.key)]
        if items:
            self.client().log_batch(self.run_id, metrics=items)

    def _last_logged(self, key: str) -> int:
        """The highest step the run holds for `key` (-1 if none); read once per key and process."""
        cache = _LAST_LOGGED.setdefault((self.uri, self.run_id), {})
        if key not in cache:
            cache[key] = max((m.step for m in self.client().get_metric_history(self.run_id, key)), default=-1)
        return cache[key]


RESUMED_FROM, RESUMED_AS = "ragtrain.resumed_from", "ragtrain.resumed_as"
MAX_BATCH_METRICS = 1000  # MLflow's log_batch limits
MAX_BATCH_PARAMS = 100


def take_over(client: Any, old_id: str, keep_through: Callable[[str], int | None]) -> str:
    """A new run in `old_id`'s experiment, with its name, params and tags, that holds each of its metrics' points up
    to step `keep_through(key)` (None: every point), steps and timestamps as logged; the old run is tagged
    `ragtrain.resumed_as=<new id>` and KILLED. A resumed run continues from its checkpoint, and the stopped run had
    logged steps past it that MLflow cannot delete: the new run's history is the checkpointed run's, then its own."""
    from mlflow.entities import Param  # lazy: mlflow is heavy (~1 s); this module imports without it

    old = client.get_run(old_id)
    tags = {k: v for k, v in old.data.tags.items() if k not in ("mlflow.runName", RESUMED_AS)}
    tags[RESUMED_FROM] = old_id
    new_id = client.create_run(old.info.experiment_id, run_name=old.info.run_name, tags=tags).info.run_id
    params = [Param(k, v) for k, v in sorted(old.data.params.items())]
    for i in range(0, len(params), MAX_BATCH_PARAMS):
        client.log_batch(new_id, params=params[i : i + MAX_BATCH_PARAMS])
    for key in sorted(old.data.metrics):
        last = keep_through(key)
        points = [m for m in client.get_metric_history(old_id, key) if last is None or m.step <= last]
        for i in range(0, len(points), MAX_BATCH_METRICS):
            client.log_batch(new_id, metrics=points[i : i + MAX_BATCH_METRICS])
    client.set_tag(old_id, RESUMED_AS, new_id)
    client.set_terminated(old_id, "KILLED")
    log.info(f"[mlflow] resume: run {new_id} takes over run {old_id}")
    return new_id


class RunLogger:
    """Driver-side logger for one pipeline run; a no-op when logger.backend=none."""

    def __init__(
        self,
        cfg: LoggerConfig,
        run_name: str,
        artifact_root: str | None = None,
        parent_run_id: str | None = None,
        tags: dict[str, str] | None = None,
        run_id: str | None = None,
        resume_of: str | None = None,
        keep_through: Callable[[str], int | None] | None = None,
    ):
        """`run_id`: attach to that run. `resume_of`: a new run that takes over that one (see `take_over`), keeping
        of each metric the points up to step `keep_through(key)` (None: all of them)."""
        self.enabled = LoggerBackend(cfg.backend) == LoggerBackend.mlflow
        self.run_id: str | None = None
        self.resumed = run_id is not None or resume_of is not None  # a run that already holds its params
        self.uri = tracking_uri(cfg) if self.enabled else ""
        if not self.enabled:
            return
        self.client = open_client(self.uri)
        if resume_of is not None:
            self.run_id = take_over(self.client, resume_of, keep_through or (lambda key: None))
            return
        if run_id is not None:  # attach to an existing run (a resumed sweep's parent) and mark it running again
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        exp = self.client.get_experiment_by_name(cfg.experiment_name)
        if exp is None:
            # Pin artifacts next to the SQLite file; a server URI decides its own artifact store.
            db = sqlite_file(self.uri)
            loc = db.parent.joinpath("artifacts").as_uri() if db is not None else None
            exp_id = self.client.create_experiment(cfg.experiment_name, artifact_location=artifact_root or loc)
        else:
            exp_id = exp.experiment_id
        tags = dict(tags or {})
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id  # a sweep's trial: a child run
        self.run_id = self.client.create_run(exp_id, run_name=cfg.run_name or run_name, tags=tags or None).info.run_id

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Set run tags (values as strings)."""
        if self.enabled:
            for k, v in tags.items():
                self.client.set_tag(self.run_id, k, str(v))

    def sink(self) -> MetricSink | None:
        """A handle for rank 0 to log training metrics into this run."""
        return MetricSink(self.uri, self.run_id) if self.enabled and self.run_id else None

    def log_params(self, params: dict[str, Any]) -> None:
        """Log flattened params (values truncated to MLflow's limit)."""
        if not self.enabled:
            return
        from mlflow.entities import Param  # lazy: mlflow is heavy (~1 s); this module imports without it

        # credentials inside a URI (user:password@host) never reach the store
        items = [
            Param(k, (redact_uri(str(v)) if k.endswith("_uri") else str(v))[:MAX_PARAM_LEN])
            for k, v in sorted(params.items())
        ]
        for i in range(0, len(items), 100):  # log_batch takes at most 100 params per call
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        """Log metrics at a step."""
        sink = self.sink()
        if sink is not None and metrics:
            sink.log(metrics, step)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
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

    def log_retriever_model(self, folder: str | Path, register_as: str | None = None) -> str | None:
        """Log a sentence-transformers folder as this run's MLflow model `retriever` (sentence_transformers flavour,
        under the run's artifacts); `register_as` also registers it in the Model Registry. Returns the model URI."""
        if not self.enabled:
            return None
        with tempfile.TemporaryDirectory() as d:
            # save_model + the run's client, not log_model: log_model works through mlflow's global tracking URI
            # and active run, which would leak into this process (and its MLFLOW_TRACKING_URI) after the call.
            save_retriever_model(folder, Path(d) / "retriever")
            self.client.log_artifacts(self.run_id, str(Path(d) / "retriever"), "retriever")
        uri = f"runs:/{self.run_id}/retriever"
        self.set_tags({"ragtrain.retriever_model": uri})
        if register_as:
            # lazy: mlflow is heavy (~1 s); this module imports without it
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient

            registry = MlflowClient(self.uri, registry_uri=self.uri)  # SQLite stores hold the registry too
            try:
                registry.create_registered_model(register_as)
            except MlflowException as e:  # already registered: add a version; anything else is the real error
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
            version = registry.create_model_version(register_as, uri, run_id=self.run_id)
            self.set_tags({"ragtrain.registered_model": f"models:/{register_as}/{version.version}"})
            log.info(f"[export] registered the retriever as models:/{register_as}/{version.version}")
        return uri

    def log_generator_model(self, folder: str | Path, causal: bool) -> str | None:
        """Log a transformers `save_pretrained` folder (model + tokenizer) as this run's generator; returns its URI.

        Causal LMs: an MLflow model `export/generator` (transformers flavour, task text-generation):
        `mlflow.transformers.load_model(uri)` gives a pipeline, `return_type="components"` the model and
        tokenizer. Seq2seq / BERT2BERT: plain artifacts `export/generator`, not an MLflow model, since the flavour
        needs a pipeline task and transformers 5 removed `text2text-generation` (KeyError); load those with
        `transformers.AutoModel*.from_pretrained` on the downloaded folder."""
        if not self.enabled:
            return None
        # "export/generator" for both kinds: the stage's results (predictions.json, ...) already sit in "generator"
        if not causal:
            self.client.log_artifacts(self.run_id, str(folder), "export/generator")
        else:
            with tempfile.TemporaryDirectory() as d:
                # save_model + the run's client, not log_model: see log_retriever_model
                save_generator_model(folder, Path(d) / "generator")
                self.client.log_artifacts(self.run_id, str(Path(d) / "generator"), "export/generator")
        uri = f"runs:/{self.run_id}/export/generator"
        self.set_tags({"ragtrain.generator_model": uri})
        return uri

    def end(self, status: str = "FINISHED") -> None:
        """Close the run (FINISHED or FAILED)."""
        if self.enabled and self.run_id:
            self.client.set_terminated(self.run_id, status)


def save_retriever_model(folder: str | Path, out: str | Path) -> None:
    """Save a sentence-transformers folder as an MLflow model (sentence_transformers flavour) at `out`.

    With query/passage prefixes the pyfunc takes a `prompt_name` param ("document" by default, "query" for
    queries): MLflow's default signature has no params and would drop it, so no prefix would reach encode().
    """
    # lazy: mlflow and sentence_transformers take seconds to import; this module imports without them
    import mlflow.sentence_transformers
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema, TensorSpec
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    signature = None
    if model.prompts.get("query") or model.prompts.get("document"):
        signature = ModelSignature(
            inputs=Schema([ColSpec("string")]),
            outputs=Schema([TensorSpec(np.dtype("float64"), [-1])]),
            params=ParamSchema([ParamSpec("prompt_name", "string", "document")]),
        )
    mlflow.sentence_transformers.save_model(
        model,
        str(out),
        signature=signature,
        # explicit requirements: inferring them starts a subprocess that re-imports the model (slow)
        pip_requirements=[
            f"sentence-transformers=={_version('sentence-transformers')}",
            f"torch=={_version('torch').split('+')[0]}",
            f"transformers=={_version('transformers')}",
        ],
    )


def save_generator_model(folder: str | Path, out: str | Path) -> None:
    """Save a causal LM's `save_pretrained` folder (with its tokenizer) as an MLflow transformers model at `out`.

    Built from a pipeline: mlflow 3.17's path-to-checkpoint route fails under transformers 5 (its task table
    holds class names where mlflow expects classes)."""
    # lazy: mlflow and transformers take seconds to import; this module imports without them
    import mlflow.transformers
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    model = AutoModelForCausalLM.from_pretrained(str(folder))
    generate = pipeline("text-generation", model=model, tokenizer=AutoTokenizer.from_pretrained(str(folder)))
    card = Path(folder) / "README.md"
    mlflow.transformers.save_model(
        generate,
        str(out),
        # the folder's own card (ragtrain's export writes one): without it mlflow asks the Hub for the card of a
        # local path, and warns twice, offline or not
        model_card=ModelCard.load(card) if card.is_file() else None,
        # explicit requirements: inferring them starts a subprocess that re-imports the model (slow)
        pip_requirements=[f"torch=={_version('torch').split('+')[0]}", f"transformers=={_version('transformers')}"],
    )


def _version(dist: str) -> str:
    return version(dist)


def absolute_tracking_uri(uri: str) -> str:
    """The same store with relative file paths made absolute (Tune trials and Ray workers run in other working
    directories)."""
    for scheme in ("sqlite:///", "file://"):
        if uri.startswith(scheme):
            path = uri[len(scheme) :]
            if path and not path.startswith("/"):
                return scheme + str(Path(path).resolve())
            return uri
    if uri and "://" not in uri and not uri.startswith("sqlite:") and store_folder(uri) is not None:
        return str(Path(uri).resolve())  # a bare path: MLflow's file store
    return uri  # servers (http, databricks, ...) need nothing


@dataclass
class RunRecord:
    """What the comparison reads from one MLflow run."""

    run_id: str
    run_name: str
    status: str
    params: dict[str, str]
    metrics: dict[str, float]  # latest value of each metric
    tags: dict[str, str]


def _record(run) -> RunRecord:
    return RunRecord(
        run.info.run_id,
        run.info.run_name or "",
        run.info.status,
        dict(run.data.params),
        dict(run.data.metrics),
        dict(run.data.tags),
    )


def find_runs(uri: str, experiment: str | None = None, parent_run_id: str | None = None) -> list[RunRecord]:
    """Runs of an experiment (by name) or the child runs of a parent run, oldest first; not the runs that a resumed
    run took over (tagged `ragtrain.resumed_as`)."""
    from mlflow.tracking import MlflowClient  # lazy: mlflow is heavy (~1 s); this module imports without it

    client = MlflowClient(uri)
    if parent_run_id:
        try:
            exp_id = client.get_run(parent_run_id).info.experiment_id
        except Exception as e:  # mlflow raises MlflowException (RESOURCE_DOES_NOT_EXIST) for unknown ids
            raise ValueError(f"no MLflow run {parent_run_id!r} in {uri} ({type(e).__name__})") from None
        flt = f"tags.mlflow.parentRunId = '{parent_run_id}'"
    else:
        exp = client.get_experiment_by_name(experiment or "")
        if exp is None:
            names = sorted(e.name for e in client.search_experiments())
            raise ValueError(f"no MLflow experiment {experiment!r} in {uri}; experiments there: {names}")
        exp_id, flt = exp.experiment_id, ""
    runs = client.search_runs([exp_id], filter_string=flt, max_results=5000, order_by=["attributes.start_time ASC"])
    # a run that a resumed run took over is in its history: counting both would count the run twice
    return [_record(r) for r in runs if RESUMED_AS not in r.data.tags]


def get_run(uri: str, run_id: str) -> RunRecord:
    """One run's params, latest metrics and tags."""
    from mlflow.tracking import MlflowClient  # lazy: mlflow is heavy (~1 s); this module imports without it

    return _record(MlflowClient(uri).get_run(run_id))


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every logged point of a metric, in step order."""
    from mlflow.tracking import MlflowClient  # lazy: mlflow is heavy (~1 s); this module imports without it

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def update_run(uri: str, run_id: str, tags: dict[str, Any] | None = None, status: str | None = None) -> None:
    """Tag a run and optionally close it with `status` (e.g. KILLED for a trial Tune stopped)."""
    from mlflow.tracking import MlflowClient  # lazy: mlflow is heavy (~1 s); this module imports without it

    client = MlflowClient(uri)
    for k, v in (tags or {}).items():
        client.set_tag(run_id, k, str(v))
    if status:
        client.set_terminated(run_id, status)
