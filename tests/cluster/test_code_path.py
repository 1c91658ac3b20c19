"""Local Ray workers import the driver's ragtrain, not the environment's install (a frozen copy stays frozen)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ragtrain

PACKAGE = Path(ragtrain.__file__).resolve().parent


def _frozen_copy(tmp_path: Path) -> Path:
    root = tmp_path / "frozen"
    shutil.copytree(PACKAGE, root / "ragtrain", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _python(code: str, cwd: Path, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what the test gives
    full.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", **env)
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=full, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_a_worker_started_with_the_driver_pythonpath_imports_the_drivers_copy(tmp_path):
    root = _frozen_copy(tmp_path)
    # the driver runs in the frozen copy (python -m ragtrain from its folder: the folder is first on sys.path)
    path = _python("from ragtrain.cluster.resources import worker_pythonpath; print(worker_pythonpath())", root)
    assert path.split(os.pathsep)[0] == str(root.resolve())
    # a worker process starts elsewhere with that PYTHONPATH: the copy, not the installed (editable) checkout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    got = _python("import ragtrain; print(ragtrain.__file__)", elsewhere, PYTHONPATH=path)
    assert Path(got).resolve().is_relative_to(root.resolve()), got


@pytest.mark.slow(reason="starts its own local Ray (~15 s")
def test_local_ray_tasks_import_the_drivers_copy(tmp_path):
    root = _frozen_copy(tmp_path)
    code = (
        "import ray, ragtrain\n"
        "from ragtrain.config import ResourcesConfig\n"
        "from ragtrain.cluster.resources import init_ray\n"
        "init_ray(ResourcesConfig(num_cpus=1))\n"
        "f = ray.remote(num_cpus=0)(lambda: __import__('ragtrain').__file__)\n"
        "print(ray.get(f.remote()))\n"
    )
    got = _python(code, root, HF_HUB_OFFLINE="1")
    assert Path(got).resolve().is_relative_to(root.resolve()), got
