"""deploy/: the KubeRay RayJob and the cluster-launcher YAML parse, give the nodes what
conf/resources/multi_node.yaml asks for, and their ragtrain command composes."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from tests.conftest import REPO, compose

RAYJOB = REPO / "deploy" / "kuberay" / "rayjob.yaml"
LAUNCHER = REPO / "deploy" / "cluster-launcher" / "aws.yaml"
INDEX_RESOURCE = "index_node"


def _ragtrain_args(command: str) -> list[str]:
    """The overrides of a `python -m ragtrain ...` command line."""
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "ragtrain"], command
    return words[3:]


def _rayjob() -> tuple[list[str], list[dict]]:
    """(ragtrain overrides, [{name, replicas, resources}] per worker group, resources as raylet totals)."""
    job = yaml.safe_load(RAYJOB.read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert spec["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no work on the head
    groups = []
    for g in spec["rayClusterSpec"]["workerGroupSpecs"]:
        p = g["rayStartParams"]
        res = {"CPU": float(p["num-cpus"]), "GPU": float(p.get("num-gpus", 0))}
        if "resources" in p:  # ray start --resources='{"index_node": 1}': KubeRay passes the string through
            res.update(json.loads(yaml.safe_load(p["resources"])))
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert float(limits.get("nvidia.com/gpu", 0)) == res["GPU"]  # the pod really gets the GPUs Ray advertises
        assert float(limits["cpu"]) >= res["CPU"]
        groups.append({"name": g["groupName"], "replicas": g["replicas"], "resources": res})
    return _ragtrain_args(spec["entrypoint"]), groups


def _launcher() -> tuple[list[str], list[dict]]:
    """Same for the cluster launcher (min_workers of each worker node type); the command is a marked comment."""
    text = LAUNCHER.read_text()
    cfg = yaml.safe_load(text)
    cmd = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("# ragtrain-command:")]
    assert len(cmd) == 1
    head = cfg["available_node_types"][cfg["head_node_type"]]
    assert head["resources"].get("CPU") == 0
    groups = [
        {"name": name, "replicas": t["min_workers"], "resources": {"GPU": 0, **t["resources"]}}
        for name, t in cfg["available_node_types"].items()
        if name != cfg["head_node_type"]
    ]
    return _ragtrain_args(cmd[0]), groups


@pytest.mark.parametrize("read", [_rayjob, _launcher], ids=["kuberay", "cluster-launcher"])
def test_nodes_fit_the_multi_node_resources(read) -> None:
    args, groups = read()
    assert "resources=multi_node" in args
    res = OmegaConf.to_container(compose(args).resources, resolve=True)  # the run's resources, as composed
    t, pool = res["trainer"], res["pool"]
    assert t["use_gpu"] is True  # GPU trainer nodes: the command turns the GPUs on
    want = pool["resources"][INDEX_RESOURCE]
    assert want > 0 and set(pool["resources"]) == {INDEX_RESOURCE}
    index = [g for g in groups if g["resources"].get(INDEX_RESOURCE)]
    trainers = [g for g in groups if g["resources"]["GPU"] > 0]
    assert index and trainers
    # the pool: every actor's bundle (cpus_per_actor, index_node share) fits on the labelled nodes, and only there
    assert all(INDEX_RESOURCE not in g["resources"] for g in trainers)
    per_node = [
        min(int(g["resources"][INDEX_RESOURCE] / want), int(g["resources"]["CPU"] / pool["cpus_per_actor"]))
        for g in index
    ]
    assert sum(n * g["replicas"] for n, g in zip(per_node, index)) >= pool["num_actors"]
    assert all(g["resources"]["GPU"] == 0 for g in index)  # index nodes are CPU nodes
    # the trainer: one GPU and cpus_per_worker CPUs per worker
    per_node = [min(int(g["resources"]["GPU"]), int(g["resources"]["CPU"] / t["cpus_per_worker"])) for g in trainers]
    assert sum(n * g["replicas"] for n, g in zip(per_node, trainers)) >= t["num_workers"]


def test_launcher_passes_rays_own_schema() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(yaml.safe_load(LAUNCHER.read_text())))


@pytest.mark.parametrize("read", [_rayjob, _launcher], ids=["kuberay", "cluster-launcher"])
def test_entry_command_composes(read, tmp_path: Path) -> None:
    args, _ = read()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-m", "ragtrain", *args, "--cfg", "job"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    job = yaml.safe_load(res.stdout)
    assert job["experiment_name"] == "scifact_finetune" and job["resources"]["trainer"]["use_gpu"] is True
    # --cfg job only composes: the range checks and interpolations a real start runs must pass too
    from ragtrain.config import to_typed

    typed = to_typed(compose([a for a in args if not a.startswith("hydra.")] + [f"output_dir={tmp_path / 'out'}"]))
    assert typed.resources.trainer.use_gpu and typed.experiment_name == "scifact_finetune"


@pytest.mark.parametrize(
    "read,shared", [(_rayjob, ("/outputs/", "/data/")), (_launcher, ("/shared/",))], ids=["kuberay", "cluster-launcher"]
)
def test_every_path_is_on_shared_storage_and_mlflow_is_a_server(read, shared) -> None:
    """Several nodes read and write these paths (ragtrain checks it at start-up; here, before a cluster exists)."""
    args, _ = read()
    values = dict(a.split("=", 1) for a in args if "=" in a)
    for key in ("output_dir", "data.root", "index.cache_dir", "hydra.run.dir"):
        assert values[key].startswith(shared), (key, values[key])
    assert values["logger.tracking_uri"].startswith("http")


def test_the_rayjob_repeats_none_of_ragtrains_worker_variables() -> None:
    """Ray refuses a job whose runtime env sets a variable that ray.init's runtime env sets too (init_ray's)."""
    from ragtrain.cluster.resources import worker_env
    from ragtrain.runtime.console import PROGRESS_ENV, QUIET_ENV

    spec = yaml.safe_load(RAYJOB.read_text())["spec"]
    job_vars = set((yaml.safe_load(spec.get("runtimeEnvYAML", "")) or {}).get("env_vars", {}))
    ours = set(worker_env()) | set(QUIET_ENV) | {PROGRESS_ENV}  # the console's, whatever this process set
    assert {"HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM"} <= ours and not job_vars & ours, job_vars & ours


def test_the_rayjob_image_is_built_from_the_official_ray_image_of_the_installed_ray() -> None:
    """The RayJob runs `make image`'s image: deploy/Dockerfile on rayproject/ray of the Ray version ragtrain is
    installed with, tagged with it; a Ray upgrade that leaves the manifests behind fails here."""
    import re

    import ray

    job = yaml.safe_load(RAYJOB.read_text())
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    images = {c["image"] for g in pods for c in g["template"]["spec"]["containers"]}
    assert images == {f"ragtrain:{ray.__version__}-py311-gpu"}
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert re.search(rf"^ARG RAY_VERSION={re.escape(ray.__version__)}$", dockerfile, re.M)
    assert "FROM rayproject/ray:${RAY_VERSION}-py311-gpu" in dockerfile
    make = subprocess.run(
        ["make", "-n", "image", "PY=" + sys.executable],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "VENV": str(Path(sys.executable).parent.parent)},
    )
    assert f"-t ragtrain:{ray.__version__}-py311-gpu -" in make.stdout, make.stdout + make.stderr
