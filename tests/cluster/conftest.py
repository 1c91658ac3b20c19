"""The 2-node Ray cluster the multi-node tests run their jobs on: the emulated one (`ragtrain.cluster.emulated`:
each node its own network namespace, address, /tmp and a link shaped at RATE) where this machine can make it, else
two raylets on 127.0.0.1 (ray.cluster_utils.Cluster: one address, one /tmp). Either way the same layout: 2 CPUs per
node, the custom resources of NODE_RESOURCES, a storage folder every node sees, and a job started on the head with
RAY_ADDRESS set. Both fixtures are per module: under `--dist loadfile` a module runs whole in one process, so one
cluster serves every test of a module (test_emulated.py's last test tears it down and checks that nothing is left).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ragtrain.cluster import emulated, netns
from tests.conftest import REPO

RATE = 100_000_000  # bits/s: the rate checks need a shaped link; the jobs move a tiny model (8 MB a step) over it
CPUS_PER_NODE = 2  # the jobs' 2 and 4 trainer workers, the pool's actor and the index shards
# the head and node 1 each hold an index shard (index.shards=auto); the pool goes where `pool_node` is: node 1
NODE_RESOURCES = {
    0: {"index_node": 1.0, "trainer_slot": 1.0},
    1: {"index_node": 1.0, "pool_node": 1.0, "trainer_slot": 1.0},
}
JOB = REPO / "tests" / "cluster" / "multinode_job.py"


@functools.cache
def missing_requirement() -> str | None:
    """Why no emulated cluster can be made here (None: it can); asked once per process (it probes tbf)."""
    return netns.missing_requirement()


def stdout_of(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def namespaces() -> set[str]:
    """The names of the network namespaces on this machine now."""
    return {line.split()[0] for line in stdout_of(["ip", "netns", "list"]).splitlines() if line.strip()}


def host_links() -> set[str]:
    return {line.split(":")[1].strip().split("@")[0] for line in stdout_of(["ip", "-o", "link"]).splitlines()}


@pytest.fixture(scope="module")
def emulated_cluster() -> Iterator[tuple[emulated.State, dict]]:
    """A 2-node emulated cluster at RATE, and what the host had before it (namespaces, links, a file in /tmp)."""
    why = missing_requirement()
    if why is not None:
        pytest.skip(why)
    before = {"netns": namespaces(), "links": host_links()}
    name = f"t{uuid.uuid4().hex[:6]}"
    # the checkout may sit under /tmp (a CI clone): every node sees the storage through its own /tmp overlay
    storage = REPO / "outputs" / "test-cluster" / name
    host_file = Path(tempfile.mkdtemp(prefix="ragtrain-host-")) / "kept"  # under the host's /tmp, before `up`
    host_file.write_text("host")
    before["host_file"] = host_file
    spec = emulated.ClusterSpec(
        name=name,
        nodes=2,
        storage=str(storage),
        cpus_per_node=CPUS_PER_NODE,
        bandwidth=RATE,
        node_resources=NODE_RESOURCES,
    )
    state = emulated.up(spec)
    yield state, before
    emulated.down(name)  # idempotent: test_emulated.py's last test has torn it down already
    shutil.rmtree(storage, ignore_errors=True)
    shutil.rmtree(host_file.parent, ignore_errors=True)


@dataclass
class TwoNodes:
    """Where a job runs: `argv` wraps a command so that it runs on the head, with `env`."""

    address: str  # the head's GCS
    storage: Path  # a folder every node sees: a job's outputs go here (each emulated node has its own /tmp)
    env: dict[str, str]
    apart: bool  # nodes with their own addresses and /tmp (the emulated cluster)
    state: emulated.State | None = None

    def run(self, argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
        if self.state is not None:
            argv = emulated.exec_argv(self.state, argv, cwd=str(REPO))
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=REPO)

    def job(self, out: Path, part: str) -> dict:
        """multinode_job.py's `part` with its outputs in `out`: the JSON line it printed."""
        r = self.run([sys.executable, str(JOB), str(out), part])
        assert r.returncode == 0, r.stderr[-4000:]
        res = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
        assert len(res["nodes"]) == 2  # two raylets, distinct node ids
        # nodes apart have an address each, Ray's own (not loopback); one machine's raylets share 127.0.0.1
        assert res["addresses"] == (["10.237.0.10", "10.237.0.11"] if self.apart else ["127.0.0.1"] * 2)
        # c10d looks up each peer's host name: the hosts file names every node (without it, a warning per connection)
        assert "hostname of the client socket cannot be retrieved" not in r.stdout + r.stderr
        return res


def _local_cluster(storage: Path) -> Iterator[TwoNodes]:
    """Two raylets on 127.0.0.1 in this process's tree (nothing connects this process to them: its own Ray, if
    any, is untouched)."""
    from ray.cluster_utils import Cluster  # lazy: only where no emulated cluster can be made

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": CPUS_PER_NODE, "resources": NODE_RESOURCES[0]})
    try:
        cluster.add_node(num_cpus=CPUS_PER_NODE, resources=NODE_RESOURCES[1])
        cluster.wait_for_nodes()
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(REPO)}
        yield TwoNodes(cluster.address, storage, {**env, "RAY_ADDRESS": cluster.address}, apart=False)
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def two_nodes(request, tmp_path_factory) -> Iterator[TwoNodes]:
    """The module's 2-node cluster: the emulated one (shared with the module's emulated checks) where it can be
    made, else two raylets on 127.0.0.1."""
    if missing_requirement() is not None:
        yield from _local_cluster(tmp_path_factory.mktemp("two-nodes"))
        return
    state, _ = request.getfixturevalue("emulated_cluster")
    env = {**emulated.command_env(state), "RAY_ADDRESS": state.head_address, "PYTHONPATH": str(REPO)}
    yield TwoNodes(state.head_address, Path(state.spec.storage), env, apart=True, state=state)
