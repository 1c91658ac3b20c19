"""Tests for the feasibility checks: pure first-fit packing on given nodes, and fail-fast against the live cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from ragtrain.cluster.resources import InfeasibleResourcesError, check_config, check_feasible, node_capacities
from ragtrain.config.resources import PoolResources, ResourcesConfig, TrainerResources
from tests.conftest import REPO, compose

CPU_NODE = {"CPU": 4.0, "memory": 8e9, "object_store_memory": 2e9, "node:10.0.0.1": 1.0}


# ---------------------------------------------------------------------------------------------------- pure


def test_fits_on_one_node() -> None:
    check_feasible("resources.pool", {"CPU": 1.0}, 4, nodes=[CPU_NODE])


def test_fits_across_nodes() -> None:
    check_feasible("resources.trainer", {"CPU": 2.0}, 3, nodes=[{"CPU": 4.0}, {"CPU": 2.0}])


def test_fractional_cpus_pack() -> None:
    check_feasible("resources.pool", {"CPU": 0.5}, 8, nodes=[{"CPU": 4.0}])
    with pytest.raises(InfeasibleResourcesError):
        check_feasible("resources.pool", {"CPU": 0.5}, 9, nodes=[{"CPU": 4.0}])


def test_zero_valued_entries_are_ignored() -> None:
    check_feasible("resources.trainer", {"CPU": 1.0, "GPU": 0.0, "index_node": 0}, 2, nodes=[{"CPU": 2.0}])


def test_zero_count_is_always_feasible() -> None:
    check_feasible("resources.pool", {"CPU": 64.0}, 0, nodes=[{"CPU": 1.0}])


def test_total_suffices_but_no_node_is_big_enough() -> None:
    """2 nodes x 1 CPU hold 2 CPUs in total, but a 2-CPU bundle fits on neither."""
    with pytest.raises(InfeasibleResourcesError) as e:
        check_feasible("resources.trainer", {"CPU": 2}, 1, nodes=[{"CPU": 1.0}, {"CPU": 1.0}])
    msg = str(e.value)
    assert msg.startswith("resources.trainer:")
    assert "1 x {'CPU': 2.0}" in msg and "only 0" in msg
    assert "[{'CPU': 1.0}, {'CPU': 1.0}]" in msg


def test_count_exceeds_per_node_packing() -> None:
    """3 bundles of 2 CPUs on 2 nodes x 3 CPUs: 6 CPUs in total, but only one bundle fits per node."""
    with pytest.raises(InfeasibleResourcesError, match="only 2"):
        check_feasible("resources.pool", {"CPU": 2.0}, 3, nodes=[{"CPU": 3.0}, {"CPU": 3.0}])


def test_custom_resource_present() -> None:
    nodes = [{"CPU": 4.0}, {"CPU": 2.0, "index_node": 1.0}]
    check_feasible("resources.pool", {"CPU": 1.0, "index_node": 0.5}, 2, nodes=nodes)


def test_custom_resource_missing() -> None:
    with pytest.raises(InfeasibleResourcesError) as e:
        check_feasible("resources.pool", {"CPU": 1.0, "index_node": 1.0}, 2, nodes=[CPU_NODE, {"CPU": 8.0}])
    msg = str(e.value)
    assert "resources.pool" in msg and "'index_node': 1.0" in msg and "2 x" in msg and "only 0" in msg
    assert "{'CPU': 4.0}" in msg and "{'CPU': 8.0}" in msg


def test_custom_resource_exhausted_on_the_labelled_node() -> None:
    nodes = [{"CPU": 8.0}, {"CPU": 8.0, "index_node": 1.0}]
    with pytest.raises(InfeasibleResourcesError, match="only 1"):
        check_feasible("resources.pool", {"CPU": 1.0, "index_node": 1.0}, 2, nodes=nodes)


def test_gpu_on_cpu_only_cluster() -> None:
    with pytest.raises(InfeasibleResourcesError) as e:
        check_feasible("resources.trainer", {"CPU": 1.0, "GPU": 1.0}, 2, nodes=[CPU_NODE, CPU_NODE])
    msg = str(e.value)
    assert "2 x {'CPU': 1.0, 'GPU': 1.0}" in msg and "only 0" in msg
    # What exists is listed, without Ray's bookkeeping entries (memory, object store, node:<ip>).
    assert "{'CPU': 4.0}" in msg
    assert "memory" not in msg and "object_store" not in msg and "node:" not in msg


def test_no_nodes() -> None:
    with pytest.raises(InfeasibleResourcesError, match="only 0"):
        check_feasible("resources.pool", {"CPU": 1.0}, 1, nodes=[])


def test_given_nodes_are_not_modified() -> None:
    nodes = [{"CPU": 2.0, "index_node": 1.0}]
    check_feasible("resources.pool", {"CPU": 1.0, "index_node": 1.0}, 1, nodes=nodes)
    assert nodes == [{"CPU": 2.0, "index_node": 1.0}]


# ---------------------------------------------------------------------------------------------------- live cluster


def test_node_capacities_of_the_local_cluster(ray_session) -> None:
    nodes = node_capacities()
    assert len(nodes) >= 1
    assert sum(n.get("CPU", 0.0) for n in nodes) >= 4


def test_check_config_default_fits(ray_session) -> None:
    check_config(ResourcesConfig(trainer=TrainerResources(num_workers=2), pool=PoolResources(num_actors=2)))


def test_check_config_gpu_fails_fast(ray_session) -> None:
    if any(n.get("GPU", 0) for n in node_capacities()):
        pytest.skip("the local cluster has GPUs")
    res = ResourcesConfig(trainer=TrainerResources(num_workers=2, use_gpu=True))
    start = time.monotonic()
    with pytest.raises(InfeasibleResourcesError) as e:
        check_config(res)
    elapsed = time.monotonic() - start
    assert elapsed < 5, f"check_config took {elapsed:.1f}s"
    msg = str(e.value)
    assert msg.startswith("resources.trainer:") and "'GPU': 1.0" in msg and "'CPU'" in msg


def test_check_config_pool_too_big_fails_fast(ray_session) -> None:
    cpus = max(n.get("CPU", 0.0) for n in node_capacities())
    res = ResourcesConfig(pool=PoolResources(num_actors=1, cpus_per_actor=cpus + 1))
    start = time.monotonic()
    with pytest.raises(InfeasibleResourcesError, match=r"^resources\.pool:"):
        check_config(res)
    assert time.monotonic() - start < 5


def test_check_config_custom_resource_missing(ray_session) -> None:
    res = ResourcesConfig(pool=PoolResources(num_actors=1, resources={"index_node": 1.0}))
    with pytest.raises(InfeasibleResourcesError, match="index_node"):
        check_config(res)


def test_a_pool_on_gpus_needs_gpu_nodes() -> None:
    """resources.pool.gpus_per_actor is checked like the trainer's GPUs, not left to wait in Ray Data forever."""
    res = ResourcesConfig(pool=PoolResources(num_actors=2, cpus_per_actor=1, gpus_per_actor=1.0))
    with pytest.raises(InfeasibleResourcesError, match=r"^resources\.pool:.*'GPU': 1\.0"):
        check_config(res, trainer=False, nodes=[{"CPU": 16.0}])
    check_config(res, trainer=False, nodes=[{"CPU": 16.0, "GPU": 2.0}])


def test_refresh_needs_trainer_and_pool_to_fit_together() -> None:
    """laptop_shared (2 workers + 2 actors) takes turns on 2 CPUs; with live refresh both run at once."""
    res = ResourcesConfig(trainer=TrainerResources(num_workers=2), pool=PoolResources(num_actors=2))
    check_config(res, together=False, nodes=[{"CPU": 2.0}])
    with pytest.raises(InfeasibleResourcesError, match="alongside resources.trainer") as e:
        check_config(res, together=True, nodes=[{"CPU": 2.0}])
    assert "only 0" in str(e.value)
    isolated = ResourcesConfig(trainer=TrainerResources(num_workers=1), pool=PoolResources(num_actors=1))
    check_config(isolated, together=True, nodes=[{"CPU": 2.0}])  # the laptop preset: 1 CPU each


def test_a_ray_client_address_is_refused(monkeypatch) -> None:
    """ray://: the driver, its stores and outputs would stay on this machine, out of the workers' reach."""
    from ragtrain.cluster.resources import init_ray
    from ragtrain.runtime.errors import ConfigError

    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    with pytest.raises(ConfigError, match=r"^RAY_ADDRESS='ray://head:10001' is a Ray Client address"):
        init_ray(ResourcesConfig())


def test_the_dashboard_extra_pins_the_installed_ray() -> None:
    import ray

    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(rf'^dashboard = \["ray\[default\]=={re.escape(ray.__version__)}"\]$', pyproject, re.M)


def test_the_dashboard_without_its_extra_is_one_line(tmp_path) -> None:
    from ragtrain.config import to_typed
    from ragtrain.config.resources import dashboard_installed
    from ragtrain.runtime.errors import ConfigError

    if dashboard_installed():
        pytest.skip("Ray's dashboard packages are installed here")
    with pytest.raises(
        ConfigError,
        match=r"resources.dashboard needs Ray's dashboard packages, which are not "
        r"installed: `make setup EXTRAS=dev,dashboard`",
    ):
        to_typed(compose(["experiment=quickstart", f"output_dir={tmp_path}", "resources.dashboard=true"]))


def test_the_dashboard_starts_on_loopback_and_prints_its_url(tmp_path) -> None:
    """A Ray of its own (another process): the session's Ray runs without a dashboard."""
    from ragtrain.config.resources import dashboard_installed

    if not dashboard_installed():
        pytest.skip("the dashboard extra is not installed (make setup EXTRAS=dev,dashboard)")
    code = (
        "import logging, ray\nfrom ragtrain.config import ResourcesConfig\nfrom ragtrain.cluster.resources import "
        "init_ray\nlogging.basicConfig(level=logging.INFO)\ninit_ray(ResourcesConfig(num_cpus=1, dashboard=True))\n"
        "ray.shutdown()\n"
    )
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"\[ray\] dashboard: http://127\.0\.0\.1:\d+", r.stdout + r.stderr)
