"""The `resources:` group (conf/resources/*.yaml): the local Ray, the trainer's workers and the encode actors."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from ragtrain.runtime.errors import check as _check


@dataclass
class TrainerResources:
    num_workers: int = 2
    cpus_per_worker: float = 1.0
    use_gpu: bool = False
    # use_gpu: each worker's claim on its GPU. A fraction leaves the rest of the GPU to index shards on it
    # (index.device=cuda, index.gpus_per_shard) on a one-GPU machine; NCCL needs one GPU per rank, so only with 1 worker
    gpus_per_worker: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources per worker

    def __post_init__(self) -> None:
        _check(self.num_workers > 0, "resources.trainer.num_workers", "must be > 0", self.num_workers)
        _check(self.cpus_per_worker > 0, "resources.trainer.cpus_per_worker", "must be > 0", self.cpus_per_worker)
        _check(
            0 < self.gpus_per_worker <= 1,
            "resources.trainer.gpus_per_worker",
            "must be a fraction of one GPU in (0, 1]",
            self.gpus_per_worker,
        )
        _check(
            self.gpus_per_worker == 1 or self.num_workers == 1,
            "resources.trainer.gpus_per_worker",
            f"below 1 could put two of the {self.num_workers} NCCL ranks on one GPU, which NCCL refuses: use 1 "
            "worker or whole GPUs",
            self.gpus_per_worker,
        )


@dataclass
class PoolResources:
    num_actors: int = 2
    cpus_per_actor: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)  # e.g. {index_node: 1} pins actors to labelled nodes
    gpus_per_actor: float = 0.0  # corpus encode actors (Ray Data map_batches num_gpus) on a GPU node

    def __post_init__(self) -> None:
        _check(self.num_actors > 0, "resources.pool.num_actors", "must be > 0", self.num_actors)
        _check(self.cpus_per_actor > 0, "resources.pool.cpus_per_actor", "must be > 0", self.cpus_per_actor)
        _check(self.gpus_per_actor >= 0, "resources.pool.gpus_per_actor", "must be >= 0", self.gpus_per_actor)


@dataclass
class ResourcesConfig:
    num_cpus: int | None = None  # CPUs of a local Ray started by ragtrain (ignored when RAY_ADDRESS is set)
    trainer: TrainerResources = field(default_factory=TrainerResources)
    pool: PoolResources = field(default_factory=PoolResources)
    # start Ray's dashboard with the local Ray, on 127.0.0.1 (its URL is printed); needs the dashboard extra
    dashboard: bool = False

    def __post_init__(self) -> None:
        _check(
            self.num_cpus is None or self.num_cpus > 0,
            "resources.num_cpus",
            "must be > 0 (or null: every CPU of this machine)",
            self.num_cpus,
        )
        _check(
            not self.dashboard or dashboard_installed(),
            "resources.dashboard",
            "needs Ray's dashboard packages, "
            "which are not installed: `make setup EXTRAS=dev,dashboard` installs them (ray[default])",
            True,
        )


def dashboard_installed() -> bool:
    """Whether Ray's dashboard can start here (ray[default] brings these; plain ray does not)."""
    return all(importlib.util.find_spec(m) for m in ("aiohttp_cors", "opencensus", "prometheus_client"))
