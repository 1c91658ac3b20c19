"""Shared fixtures: one real local Ray cluster per test session, configs composed the way users compose them."""

from __future__ import annotations

import os
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
RAY_CPUS = 4  # logical CPUs: light tasks may exceed the 2 physical cores


@pytest.fixture(scope="session")
def ray_session():
    """A real local Ray cluster, started once for the whole test session."""
    import ray

    if not ray.is_initialized():
        # PYTHONPATH: Ray workers must import functions defined in test modules (tests.sync.test_async_ps, ...).
        env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO),
               "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300"}  # a loaded CI box starts workers slowly
        ray.init(address="local", num_cpus=RAY_CPUS, runtime_env={"env_vars": env})  # never join another Ray
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


def tiny_overrides(tmp_path: Path) -> list[str]:
    """Shrink any experiment for CPU tests: tiny encoder, small KB, a few steps, outputs and MLflow in tmp_path."""
    return [
        "retriever=tiny",
        "data.num_entities=24",
        "retriever.train.max_steps=4",
        "retriever.train.batch_size=4",
        "resources.num_cpus=4",
        f"output_dir={tmp_path / 'out'}",
        f"logger.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ]


@pytest.fixture(scope="session")
def quickstart_run(ray_session, tmp_path_factory):
    """ONE finished tiny quickstart (2 gloo workers, ddp, 4 steps, zero-shot + trained indexes, the stale index aligned
    on 32 anchors, export, MLflow with a registered model, profile=true, validation every 2 steps, encoded corpora kept in
    <tmp>/vector_cache), shared by every module that only reads a finished run: each Train worker-group and encode
    start costs seconds, and the suite must stay short. Returns (typed cfg, results, tmp folder)."""
    from ragtrain.config import to_typed
    from ragtrain.pipeline import run

    tmp = tmp_path_factory.mktemp("quickstart")
    cfg = to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp), "generator=tiny_t5", "index.align_anchors=32",
                            "logger.experiment_name=qs-test", f"logger.register_as={REGISTERED_MODEL}", "profile=true",
                            "retriever.train.log_every=2", "retriever.train.val_every=2",
                            f"index.cache_dir={tmp / 'vector_cache'}"]))
    return cfg, run(cfg), tmp


# A tiny quickstart that mines one hard negative per query and distils a cross-encoder teacher trained for 3 steps
TEACHER = ["retriever.train.hard_negatives=1", "retriever.teacher.weight=0.5", "retriever.teacher.max_steps=3",
           "retriever.teacher.negatives=2", "retriever.teacher.batch_size=4", "retriever.teacher.max_length=64",
           "retriever.teacher.lr=1e-3"]


REGISTERED_MODEL = "ragtrain-test-retriever"  # quickstart_run registers its retriever under this name

