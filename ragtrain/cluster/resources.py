"""Connect to Ray (local or RAY_ADDRESS) and refuse resource requests the cluster can never satisfy."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import ragtrain
from ragtrain.config.logger import auth_env
from ragtrain.config.resources import ResourcesConfig
from ragtrain.runtime.console import get_logger, is_quiet, quiet_env
from ragtrain.runtime.errors import ConfigError

log = get_logger(__name__)


# Environment of Ray Train workers. Train V2 patches print() in workers to go to its logger *and* (Ray redirects
# stdout) to stdout, so every rank-0 line would reach the driver twice: rank 0's prints are our log, keep them plain.
# OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads otherwise spin in barriers; with a trainer and a pool actor on
# shared cores the spinning threads steal each other's time (a generator step was ~5x slower here); passive
# waiting costs ~nothing on an idle machine.
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "OMP_WAIT_POLICY": "PASSIVE",
}


class InfeasibleResourcesError(RuntimeError):
    """A request no node (or not the whole cluster) can satisfy: fail in seconds instead of pending forever."""


def code_path() -> str:
    """The folder this process imports ragtrain from (its parent): what every Ray worker must import too."""
    return str(Path(ragtrain.__file__).resolve().parent.parent)


def worker_pythonpath() -> str:
    """PYTHONPATH for local Ray workers: the driver's ragtrain first. Without it a worker resolves `ragtrain`
    through the environment's install, which for an editable install is the checkout it was installed from, not
    a frozen copy the driver runs in (seen: sweep trials ran the live checkout's code while the driver ran the
    copy's). PYTHONPATH entries come before the editable finder, which Python consults last."""
    return os.pathsep.join([code_path(), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])


WORKER_START_TIMEOUT_S = 300  # one run: its trainer's CPUs are free unless something else holds them
# A sweep's trainers may queue behind each other's: Tune restores a resumed sweep's unfinished and errored trials
# all at once, past the searcher's concurrency limit, and on a 2-CPU machine the second trainer then waited for the
# first one's CPUs until Train V2 gave up (WorkerGroupStartupTimeoutError, seen). Every trial's size was checked
# against the cluster before the sweep started, so waiting is right.
SWEEP_WORKER_START_TIMEOUT_S = 24 * 3600


def worker_env(worker_start_timeout_s: int = WORKER_START_TIMEOUT_S) -> dict[str, str]:
    """The environment variables every Ray worker of a run gets (init_ray's runtime env; a job's own runtime env
    must not set them again: Ray refuses to merge the two)."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_WAIT_POLICY": "PASSIVE",  # pool actors and the index service share cores with trainers
        # Train V2 gives a worker group 60 s to start; on a loaded laptop importing torch + transformers in
        # every worker can take longer, and the run would fail with WorkerGroupStartupTimeoutError.
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(worker_start_timeout_s),
    }
    env.update(quiet_env())  # the console settings (ragtrain.runtime.console)
    return env


PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def init_ray(res: ResourcesConfig, worker_start_timeout_s: int = WORKER_START_TIMEOUT_S) -> None:
    """Connect to $RAY_ADDRESS if set, else start a local Ray with resources.num_cpus logical CPUs."""
    if os.environ.get("RAY_ADDRESS", "").startswith("ray://"):
        # Ray Client: the driver would stay on this machine, and the stores, shards and outputs with it, where the
        # cluster's workers cannot read them
        raise ConfigError(
            f"RAY_ADDRESS={os.environ['RAY_ADDRESS']!r} is a Ray Client address: run ragtrain on the "
            "cluster instead (a RayJob, `ray job submit`, `ray exec`), with RAY_ADDRESS=auto or the "
            "head's GCS address (docs/cluster.md)"
        )
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    if ray.is_initialized():
        return

    env = worker_env(worker_start_timeout_s)
    # the tracking server's credentials (logger.tracking_uri's user:password, config.take_credentials) reach every
    # worker that logs to MLflow through the job's environment, never through a config or a file
    env.update(auth_env())
    # Every worker process of the job, Ray Train's own actors included (its placement-group cleaner), starts with
    # ragtrain's console settings
    hook = "ragtrain.runtime.console.worker_setup"
    if os.environ.get("RAY_ADDRESS"):
        # Ship this checkout's ragtrain to the cluster's workers (third-party packages come from the image).
        pkg = str(Path(ragtrain.__file__).resolve().parent)
        ray.init(
            address=os.environ["RAY_ADDRESS"],
            runtime_env={"env_vars": env, "py_modules": [pkg], "worker_process_setup_hook": hook},
        )
    else:
        # address="local": always start our own Ray; a bare ray.init() would join any other local cluster on the
        # machine (found through /tmp/ray) and then refuse num_cpus.

        env["PYTHONPATH"] = worker_pythonpath()  # the workers run the driver's ragtrain (e.g. a frozen copy)
        # Train V2 starts a preemption watcher actor per fit to notice nodes being drained (spot capacity on a
        # cluster); one machine's Ray drains none, and the actor costs a process start per fit and logs an error
        # line about its restarts. The user's own setting wins.
        env[PREEMPTION_WATCHER] = os.environ.get(PREEMPTION_WATCHER, "0")
        context = ray.init(
            address="local",
            num_cpus=res.num_cpus,
            runtime_env={"env_vars": env, "worker_process_setup_hook": hook},
            # "Started a local Ray instance." is Ray's INFO line; -v keeps it
            logging_level=logging.WARNING if is_quiet() else logging.INFO,
            include_dashboard=res.dashboard,
            dashboard_host="127.0.0.1",
        )
        if res.dashboard:
            log.info(f"[ray] dashboard: http://{context.dashboard_url}")


def node_capacities() -> list[dict[str, float]]:
    """Total resources of each alive node."""
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def check_feasible(
    what: str,
    bundle: dict[str, float],
    count: int,
    nodes: list[dict[str, float]] | None = None,
    free: list[dict[str, float]] | None = None,
) -> None:
    """Raise if `count` bundles of `bundle` can never be placed on the cluster's nodes (first-fit packing).

    `free` (per-node capacities left by earlier requests) is updated in place, so several groups that must run at
    the same time can be checked one after another against what the previous ones leave.
    """
    nodes = node_capacities() if nodes is None else nodes
    bundle = {k: float(v) for k, v in bundle.items() if v}
    free = [dict(n) for n in nodes] if free is None else free
    placed = 0
    for _ in range(count):
        for n in free:
            if all(n.get(k, 0.0) >= v - 1e-9 for k, v in bundle.items()):
                for k, v in bundle.items():
                    n[k] -= v
                placed += 1
                break
        else:
            break
    if placed < count:
        have = [{k: v for k, v in n.items() if not k.startswith(("node:", "memory", "object_store"))} for n in nodes]
        raise InfeasibleResourcesError(
            f"{what}: asked for {count} x {bundle}, but the cluster can place only {placed} "
            f"(nodes: {have}). Lower the request in conf/resources or add nodes with those resources."
        )


def trains_with_live_refresh(stages: list[str], refresh_enabled: bool) -> bool:
    """Whether a run's trainer and index pool (or refresh actors) run at the same time: live index refresh during
    retriever or joint training."""
    return refresh_enabled and bool({"retriever", "joint"} & set(stages))


def check_config(
    res: ResourcesConfig,
    together: bool = False,
    nodes: list[dict[str, float]] | None = None,
    trainer: bool = True,
    shard_gpus: tuple[int, float] = (0, 0.0),
) -> None:
    """Check the trainer group and the index pool fit the cluster: each on its own when they take turns, or both
    at once (`together`: live index refresh keeps the pool busy while the trainer runs). `trainer=False` (no
    retriever training in this run): only the pool is checked. `shard_gpus` (count, GPU each): index shards on
    GPUs (index.device=cuda), held for the whole run: the other groups are checked against what they leave."""
    t, p = res.trainer, res.pool
    nodes = node_capacities() if nodes is None else nodes
    count, each = shard_gpus
    if count and each:
        left = [dict(n) for n in nodes]
        what = f"index.device=cuda: {count} index shards x index.gpus_per_shard={each:g}"
        check_feasible(what, {"GPU": each}, count, nodes, left)
        nodes = left  # the trainer and the pool run beside the shards
    free = [dict(n) for n in nodes] if together else None
    pool_what = (
        "resources.pool (alongside resources.trainer: refresh.enabled runs both at once)"
        if together
        else "resources.pool"
    )
    beside = " beside the index shards' GPUs (index.device=cuda; or set index.device=cpu)" if count and each else ""
    groups = [
        (
            "resources.trainer" + beside,
            {"CPU": t.cpus_per_worker, **({"GPU": t.gpus_per_worker} if t.use_gpu else {}), **t.resources},
            t.num_workers,
        ),
        (
            pool_what,
            {"CPU": p.cpus_per_actor, **({"GPU": p.gpus_per_actor} if p.gpus_per_actor else {}), **p.resources},
            p.num_actors,
        ),
    ][0 if trainer else 1 :]
    # The group with more resource kinds (e.g. the pool's `index_node` label) is placed first: it can go to fewer
    # nodes, and the pipeline also reserves it first (the zero-shot index is built before training starts).
    for what, bundle, count in sorted(groups, key=lambda g: -len([v for v in g[1].values() if v])):
        check_feasible(what, bundle, count, nodes, free)


# Placement groups made inside a Tune trial (the encoder pool's, Ray Train's worker group) belong to the sweep's
# job, not to the trial: when ASHA stops a trial, they outlive it. Ray Train's own PlacementGroupCleaner needs the
# State API (the dashboard), which a minimal Ray install lacks, so a stopped trial's 2 CPUs stayed reserved and the
# next trial waited forever. Each trial therefore records its groups, and the sweep removes them when it ends.
PLACEMENT_GROUPS_FILE = "placement_groups.txt"


def record_placement_group(output_dir: str | Path, pg: Any) -> None:
    """Append `pg`'s id to <output_dir>/placement_groups.txt (None: not in a placement group, nothing to do)."""
    if pg is None:
        return
    path = Path(output_dir, PLACEMENT_GROUPS_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(pg.id.hex() + "\n")


def remove_recorded_placement_groups(output_dir: str | Path) -> int:
    """Remove the placement groups recorded under `output_dir` that still hold (or wait for) resources."""
    # lazy: ray is heavy (~0.5 s); this module imports without it
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    path = Path(output_dir, PLACEMENT_GROUPS_FILE)
    if not path.exists():
        return 0
    removed = 0
    for hex_id in sorted(set(path.read_text().split())):
        pg = PlacementGroup(PlacementGroupID(bytes.fromhex(hex_id)))
        if placement_group_table(pg).get("state") in ("PENDING", "CREATED", "RESCHEDULING"):
            remove_placement_group(pg)
            removed += 1
    return removed
