"""Shared fixtures: one real local Ray cluster per test session, configs composed the way users compose them."""

from __future__ import annotations

import atexit
import functools
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

# Keep Ray on 127.0.0.1 (not the machine's interface address); must be set before Ray starts.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray Train's controller polls its workers every 2 s and starts a preemption-watcher actor per run: a finished run is
# noticed up to 2 s late and each fit pays one more actor start. Tests fit ~30 trainers, so poll often and skip the
# watcher (tests never drain nodes). Set before Ray starts: the controller reads them from its inherited environment.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

import pytest

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
SCIFACT = REPO.parent / "shared" / "data" / "scifact"
# The SQuAD file where ${ragtrain.data_root:} finds it ($RAGTRAIN_DATA, else ../shared/data): tests skip without it
SQUAD = (REPO / os.environ.get("RAGTRAIN_DATA", "../shared/data")).resolve() / "squad"
RAY_CPUS = 4  # logical CPUs: light tasks may exceed the 2 physical cores

# Multi-process gloo tests start their ranks from a fork server that has imported torch once: a fresh interpreter per
# rank (mp.spawn's default) costs ~2 s of imports, and the suite starts ~40 ranks. The server holds no threads, so
# forking it is safe; each rank still sets up its own process group.
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "transformers", "ragtrain.embed.model"])


SHARED_RUN = "quickstart_run"  # the session fixture below: one finished run that many modules read
# Session fixtures whose start costs seconds of CPU: the files using one of them run in one xdist process, so that it
# starts once (the quickstart run, ~60 s of CPU; the MLflow tracking server, ~9 s)
SHARED_FIXTURES = (SHARED_RUN, "mlflow_server")


def shared_units(files: dict[str, str]) -> dict[str, str]:
    """{file: work unit} for the files (path -> text) that use a SHARED_FIXTURES fixture: files using the same one
    share a unit, and a file using two joins their units."""
    unit = {name: name for name in SHARED_FIXTURES}

    def root(name: str) -> str:
        while unit[name] != name:
            name = unit[name]
        return name

    uses = {f: [n for n in SHARED_FIXTURES if n in text] for f, text in files.items()}
    for names in uses.values():
        for other in names[1:]:
            unit[root(other)] = root(names[0])
    return {f: root(names[0]) for f, names in uses.items() if names}


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it installed, nothing to schedule
def pytest_xdist_make_scheduler(config, log):
    """Under `--dist loadfile` (the Makefile's): each test file is one pytest-xdist work unit (its module fixtures
    run once), except that the files using one shared session fixture (SHARED_FIXTURES) are one unit together. A
    session fixture runs once per xdist process, so with those files on both processes the quickstart would run
    twice. (xdist's own `--dist loadgroup` cannot do this here: its group suffix never reaches the node ids under
    this pytest.)"""
    if config.getoption("dist") != "loadfile":
        return None  # xdist's own scheduler for any other mode
    from xdist.scheduler import LoadFileScheduling  # lazy: only a distributed run needs it

    tests = Path(config.rootpath) / "tests"
    sharing = shared_units(
        {str(f.relative_to(config.rootpath)): f.read_text(encoding="utf-8") for f in tests.rglob("test_*.py")}
    )

    class SharedRunScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return sharing.get(path, path)

    return SharedRunScheduling(config, log)


def spawn(fn, args: tuple, nprocs: int, start_method: str = "forkserver") -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)` from the fork server: `fn(rank, *args)` on each rank, joined;
    a rank's exception is raised here. The ranks get the environment the server started with: a rank that needs
    this process's current one (e.g. to join the tests' Ray cluster) takes start_method="spawn"."""
    import torch.multiprocessing as mp

    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method=start_method)


@functools.cache
def _mlflow_template() -> Path:
    """An empty SQLite tracking store with MLflow's schema, built once per test run (removed at exit)."""
    from mlflow.tracking import MlflowClient

    folder = Path(tempfile.mkdtemp(prefix="ragtrain-mlflow-template-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments()  # creates the schema
    return folder / "mlflow.db"


def mlflow_db(path: Path) -> str:
    """`sqlite:///<path>`, a SQLite tracking store with MLflow's schema already in it: building the schema of a new
    store (MLflow's migrations) takes ~2 s, and most tests open a new store; a copy of one built once takes ms.
    (A store created from nothing is still tested: tests/track/test_mlflow.py, tests/commands/test_compare.py.)"""
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_mlflow_template(), path)
    return f"sqlite:///{path}"


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """One intra-op thread for torch in the test process (as tests/index/test_faiss_index.py does for faiss): its
    tensors are tiny, and on 2 cores shared with Ray workers a second OpenMP thread spins instead of helping (the
    150-step distillation test took 58 s of CPU with 2 threads on a loaded box, 4 s with one). Ray workers and
    gloo ranks set their own thread counts from their CPUs."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_session():
    """A real local Ray cluster, started once for the whole test session."""
    import ray

    if not ray.is_initialized():
        # PYTHONPATH: Ray workers must import functions defined in test modules (tests.sync.test_async_ps, ...).
        env = {
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(REPO),
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300",
        }  # a loaded CI box starts workers slowly
        # never join another Ray; no dashboard, as a run starts Ray by default (resources.dashboard=false): its two
        # processes cost CPU on a 2-core box that the tests need
        ray.init(address="local", num_cpus=RAY_CPUS, runtime_env={"env_vars": env}, include_dashboard=False)
    yield ray
    ray.shutdown()


def compose(overrides: list[str] | None = None):
    """Compose conf/config.yaml with overrides exactly as `python -m ragtrain` does (returns the DictConfig)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from ragtrain.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides or [])


def typed(overrides: list[str] | None = None):
    """The typed config `python -m ragtrain <overrides>` runs with: `compose`, then `to_typed`'s checks."""
    from ragtrain.config import to_typed

    return to_typed(compose(overrides))


def override(key: str, value) -> str:
    """One command-line override `key=value`, the value written as a user types it (strings quoted: a regex's
    backslashes and brackets stay as they are)."""
    if isinstance(value, dict):
        raise TypeError(f"{key}: give nested keys as their own overrides")
    if isinstance(value, (list, tuple)):
        text = "[" + ",".join(override("v", v).partition("=")[2] for v in value) + "]"
    elif value is None:
        text = "null"
    elif isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, str):
        text = "'" + value.replace("'", "\\'") + "'"  # Hydra keeps a quoted value's backslashes
    else:
        text = repr(value)
    return f"{key}={text}"


def sync_config(preset: str, **keys):
    """`sync=<preset>` with `keys` set under it (e.g. mixer={'period': 4}), composed and typed as a user's run is:
    returns the run's SyncConfig (output_dir set: the composed default names Hydra's run folder, and nothing is
    written)."""

    def flat(prefix: str, node: dict) -> list[str]:
        out = []
        for k, v in node.items():
            out += flat(f"{prefix}.{k}", v) if isinstance(v, dict) else [override(f"{prefix}.{k}", v)]
        return out

    return typed([f"sync={preset}", *flat("sync", keys), "output_dir=outputs/sync"]).sync


def in_process_index(cfg, data, folder: Path):
    """The run's index (its shard group) of an untrained encoder seeded with `cfg.seed`, built from vectors encoded
    in-process (the Ray Data encode is tested in tests/corpus). Returns (Retrieval, BuiltIndex, weights)."""
    import torch

    from ragtrain.embed.encoders import QueryEncoder
    from ragtrain.embed.model import build_encoder
    from ragtrain.pipeline.retrieval import BuiltIndex, Retrieval
    from tests.index.test_vector_files import _write_vectors

    torch.manual_seed(cfg.seed)
    weights = {k: v.detach().clone() for k, v in build_encoder(cfg.retriever).state_dict().items()}
    retrieval = Retrieval(cfg, data)
    vecs = QueryEncoder(cfg.retriever, [weights]).encode(list(retrieval.passages()), role="passage")
    shards = _write_vectors(folder, retrieval.doc_ids, vecs, per_file=64)
    held = retrieval.index_from("zeroshot", shards, f"{cfg.retriever.model}@init", 0)
    return retrieval, BuiltIndex("zeroshot", held, [weights], retrieval.doc_ids, {}, shards=shards), weights


def tiny_overrides(tmp_path: Path) -> list[str]:
    """Shrink any experiment for CPU tests: tiny encoder, small KB, a few steps, outputs and MLflow in tmp_path."""
    return [
        "retriever=tiny",
        "data.num_entities=24",
        "retriever.train.max_steps=4",
        "retriever.train.batch_size=4",
        "resources.num_cpus=4",
        f"output_dir={tmp_path / 'out'}",
        f"logger.tracking_uri={mlflow_db(tmp_path / 'mlflow.db')}",
        # fp32 whatever the CPU: the same numbers on every test machine, and the tiny encoder's matrices are too
        # small for bf16 to pay (auto is tested in tests/embed/test_precision.py)
        "retriever.train.precision=fp32",
        "index.precision=fp32",
        "generator.train.precision=fp32",
    ]


def quickstart_overrides(tmp: Path) -> list[str]:
    """The shared quickstart run's settings that decide its figures (its logging, profile and cache aside): a run
    composed with them and another index.shards must give the same figures (tests/index/test_sharded.py)."""
    return [
        "experiment=quickstart",
        *tiny_overrides(tmp),
        "generator=tiny_t5",
        "index.align_anchors=32",
        # one encode actor: each actor is a process that imports torch and builds the encoder (~3 s of CPU), and
        # 120 passages are one actor's work (the actor pool of 2 is tested in tests/corpus)
        "resources.pool.num_actors=1",
        "retriever.train.log_every=2",
        "retriever.train.val_every=2",
    ]


@pytest.fixture(scope="session")
def quickstart_run(ray_session, tmp_path_factory):
    """ONE finished tiny quickstart (2 gloo workers, ddp, 4 steps, zero-shot + trained indexes, the stale index aligned
    on 32 anchors, export, MLflow with a registered model, profile=true, validation every 2 steps, encoded corpora
    kept in
    <tmp>/vector_cache), shared by every module that only reads a finished run: each Train worker-group and encode
    start costs seconds, and the suite must stay short. Returns (typed cfg, results, tmp folder)."""
    from ragtrain.config import to_typed
    from ragtrain.pipeline.stages import run

    tmp = tmp_path_factory.mktemp("quickstart")
    cfg = to_typed(
        compose(
            [
                *quickstart_overrides(tmp),
                "logger.experiment_name=qs-test",
                f"logger.register_as={REGISTERED_MODEL}",
                "profile=true",
                f"index.cache_dir={tmp / 'vector_cache'}",
            ]
        )
    )
    with ListeningSockets() as sockets:  # what the run's processes listen on, sampled while it runs
        results = run(cfg)
    (tmp / "listening.json").write_text(json.dumps(sorted(sockets.seen)))
    return cfg, results, tmp


class ListeningSockets:
    """Samples, every 2 s while open (a listener lives as long as its training), the listening TCP sockets of this
    process and its descendants (the local Ray's raylet, workers, Train workers and actors are children of the process
    that started it): `seen` holds (address, process name) pairs."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()
        self._stop = threading.Event()

    def _sample(self) -> None:
        import psutil

        me = psutil.Process()
        names = {}
        for proc in [me, *me.children(recursive=True)]:
            try:
                names[proc.pid] = proc.name()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        # one read of the system's TCP table per sample (per-process queries read it once per process)
        self.seen |= {
            (c.laddr.ip, names[c.pid])
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in names
        }

    def __enter__(self) -> ListeningSockets:
        def loop() -> None:
            while not self._stop.wait(2.0):
                self._sample()

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()


# A tiny quickstart that mines one hard negative per query and distils a cross-encoder teacher trained for 3 steps
TEACHER = [
    "retriever.train.hard_negatives=1",
    "retriever.teacher.weight=0.5",
    "retriever.teacher.max_steps=3",
    "retriever.teacher.negatives=2",
    "retriever.teacher.batch_size=4",
    "retriever.teacher.max_length=64",
    "retriever.teacher.lr=1e-3",
]


REGISTERED_MODEL = "ragtrain-test-retriever"  # quickstart_run registers its retriever under this name


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server (SQLite backend, proxied artifacts) in its own process group. Its store is a copy
    of the schema template (mlflow_db): a new store would make the server run MLflow's migrations before it answers."""
    tmp = tmp_path_factory.mktemp("mlflow_server")
    store = mlflow_db(tmp / "server.db")
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no background job workers
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            store,
            "--artifacts-destination",
            str(tmp / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        cwd=tmp,
        env=env,
        stdout=open(tmp / "server.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(tmp / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its uvicorn worker: this group only
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
