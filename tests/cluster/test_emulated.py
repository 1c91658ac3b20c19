"""The emulated cluster (`python -m ragtrain.cluster`): nodes with their own namespace, address, /tmp and link.

Needs root, ip and tc with tbf (else skipped, with why). One 2-node cluster at 50 Mb/s serves the file; the last
test tears it down and checks that nothing is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from ragtrain.cluster import emulated, linkprobe, netns
from tests.conftest import REPO

RATE = 50_000_000
NUMEL = 1 << 20  # a 4 MB fp32 tensor


def _host_links() -> set[str]:
    return {line.split(":")[1].strip().split("@")[0] for line in _out(["ip", "-o", "link"]).splitlines()}


def _out(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def cluster():
    why = netns.missing_requirement()
    if why is not None:
        pytest.skip(why)
    before = {"netns": _out(["ip", "netns", "list"]), "links": _host_links()}
    name = f"t{uuid.uuid4().hex[:6]}"
    # the checkout may sit under /tmp (a CI clone): every node sees the storage through its own /tmp overlay
    storage = REPO / "outputs" / "test-cluster" / name
    host_file = Path(tempfile.mkdtemp(prefix="ragtrain-host-")) / "kept"  # under the host's /tmp, before `up`
    host_file.write_text("host")
    before["host_file"] = host_file
    spec = emulated.ClusterSpec(name=name, nodes=2, storage=str(storage), bandwidth=RATE)
    state = emulated.up(spec)
    yield state, before
    emulated.down(name)  # idempotent: the last test has torn it down already
    shutil.rmtree(storage, ignore_errors=True)
    shutil.rmtree(host_file.parent, ignore_errors=True)


def _on_node(state: emulated.State, i: int, script: str) -> subprocess.CompletedProcess:
    """A shell in node i's network and mount namespaces (those of its `ray start`)."""
    argv = ["nsenter", "-t", str(state.nodes[i]["pid"]), "-m", "-n", "-u", "sh", "-c", script]
    return subprocess.run(argv, capture_output=True, text=True)


def test_each_node_has_its_own_address_and_a_shaped_link_both_ways(cluster) -> None:
    state, _ = cluster
    assert [n["address"] for n in state.nodes] == ["10.237.0.10", "10.237.0.11"]
    assert _on_node(state, 1, "ip -o -4 addr show dev eth0").stdout.split()[3] == "10.237.0.11/24"
    assert "default" not in _on_node(state, 1, "ip route").stdout  # nothing leaves the private subnet
    # its host name resolves to its own address: where gloo binds by default, what c10d looks its peers up by
    assert _on_node(state, 1, "getent ahostsv4 $(hostname)").stdout.split()[0] == "10.237.0.11"
    assert _on_node(state, 0, f"getent ahostsv4 {state.nodes[1]['ns']}").stdout.split()[0] == "10.237.0.11"
    assert _on_node(state, 0, "getent hosts 10.237.0.11").stdout.split() == ["10.237.0.11", state.nodes[1]["ns"]]
    assert socket.gethostname() != state.nodes[1]["ns"]  # the host's name is untouched
    directions = {(m["src"], m["dst"]) for m in state.measured}
    assert directions == {(state.nodes[0]["ns"], state.nodes[1]["ns"]), (state.nodes[1]["ns"], state.nodes[0]["ns"])}
    for m in state.measured:
        assert m["asked_bits"] == RATE
        assert abs(m["achieved_bits"] - RATE) <= 0.2 * RATE, m
    saved = json.loads(emulated.state_file(state.spec.name).read_text())
    assert saved["measured"] == state.measured  # the state file carries the measured rates


def test_tmp_is_private_to_each_node(cluster) -> None:
    """What a node writes under /tmp no other node (nor the host) sees; what the host kept there (a checkout, a
    venv) every node reads; the storage is one folder for all, wherever it sits."""
    state, before = cluster
    mark = f"ragtrain-emulated-{uuid.uuid4().hex}"
    assert _on_node(state, 0, f"touch /tmp/{mark} && ls /tmp").returncode == 0
    assert _on_node(state, 0, f"test -e /tmp/{mark}").returncode == 0
    assert _on_node(state, 1, f"test -e /tmp/{mark}").returncode == 1  # node 1 does not see it
    assert not Path("/tmp", mark).exists()  # nor does the host
    listing = _on_node(state, 1, "ls /tmp").stdout.split()
    assert f"ray-{state.nodes[1]['ns']}" in listing and f"ray-{state.nodes[0]['ns']}" not in listing
    assert _on_node(state, 1, f"cat {before['host_file']}").stdout == "host"
    shared = Path(state.spec.storage) / f"{mark}.txt"
    assert _on_node(state, 1, f"echo node1 > {shared}").returncode == 0
    assert shared.read_text() == "node1\n" and _on_node(state, 0, f"cat {shared}").stdout == "node1\n"
    shared.unlink()


def test_a_gloo_all_reduce_across_the_two_nodes_is_paced_by_the_link(cluster) -> None:
    """A 2-worker TorchTrainer, one worker per node: one 4 MB all-reduce takes at least half the ring bound
    2(W-1)/W * P/B, which loopback (where gloo lands without GLOO_SOCKET_IFNAME) would beat by far."""
    state, _ = cluster
    storage = Path(state.spec.storage)
    env = {**emulated.command_env(state), "RAY_ADDRESS": state.head_address, "PYTHONPATH": str(REPO)}
    script = str(REPO / "tests" / "cluster" / "emulated_allreduce.py")
    argv = emulated.exec_argv(state, [sys.executable, script, str(storage), str(NUMEL)], cwd=str(REPO))
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    # c10d looks up each peer's host name: the hosts file names every node (without it, a warning per connection)
    assert "hostname of the client socket cannot be retrieved" not in r.stdout + r.stderr
    ranks = [json.loads((storage / f"allreduce-{i}.json").read_text()) for i in range(2)]
    assert {x["ip"] for x in ranks} == {"10.237.0.10", "10.237.0.11"}  # one worker on each node
    assert all(x["sum"] == 2.0 for x in ranks)
    bound = 2 * (2 - 1) / 2 * (4 * NUMEL * 8) / RATE  # 0.67 s
    assert max(x["seconds"] for x in ranks) >= 0.5 * bound, ranks


def test_without_privileges_one_line_and_exit_2() -> None:
    """Root without CAP_NET_ADMIN and CAP_SYS_ADMIN (what a container or a plain user lacks): one line on stderr,
    exit 2, nothing created. Still the owner of the checkout and the venv, wherever they sit (a 0700 folder too)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop the capabilities")
    before = _out(["ip", "netns", "list"])
    argv = ["setpriv", "--bounding-set=-net_admin,-sys_admin", "--inh-caps=-all"]
    argv += [sys.executable, "-m", "ragtrain.cluster", "run", "--nodes", "2", "--", "true"]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "python -m ragtrain.cluster: needs root (CAP_NET_ADMIN is missing): network namespaces, veth links and tbf "
        "need it"
    ]
    assert _out(["ip", "netns", "list"]) == before


def test_teardown_leaves_no_namespace_link_or_process(cluster) -> None:
    state, before = cluster
    pids = [p for n in state.nodes for p in netns.namespace_pids(n["ns"])]
    assert len(pids) > 4  # Ray's processes ran in the node namespaces
    emulated.down(state.spec.name)
    emulated.down(state.spec.name)  # twice: idempotent
    assert _out(["ip", "netns", "list"]) == before["netns"]
    assert netns.cluster_namespaces(state.spec.name) == []
    assert _host_links() == before["links"]
    assert [p for p in pids if Path(f"/proc/{p}").exists()] == []
    assert not emulated.state_file(state.spec.name).exists()


def _run(*args: str, **kw) -> subprocess.Popen:
    argv = [sys.executable, "-m", "ragtrain.cluster", "run", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow(reason="two more 1-node clusters (~30 s each on 2 cores); the 2-node cluster above runs by default")
def test_run_exits_with_the_command_and_tears_down_on_sigterm(tmp_path_factory) -> None:
    """`run` returns COMMAND's exit code; a SIGTERM while COMMAND runs still tears everything down."""
    why = netns.missing_requirement()
    if why is not None:
        pytest.skip(why)
    before = _out(["ip", "netns", "list"])
    storage = REPO / "outputs" / "test-cluster" / f"r{uuid.uuid4().hex[:6]}"
    try:
        p = _run("--name", "rexit", "--nodes", "1", "--storage", str(storage), "--", "sh", "-c", "exit 3")
        assert p.wait(timeout=300) == 3, p.stderr.read()[-3000:]
        assert _out(["ip", "netns", "list"]) == before
        p = _run("--name", "rterm", "--nodes", "1", "--storage", str(storage), "--", "sleep", "600")
        deadline = time.monotonic() + 300
        while "sleep 600" not in _cmdlines("rtc-rterm-n0"):  # the cluster is up and runs the command
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.5)
        pids = netns.namespace_pids("rtc-rterm-n0")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 128 + signal.SIGTERM
        assert _out(["ip", "netns", "list"]) == before
        assert [q for q in pids if Path(f"/proc/{q}").exists()] == []
    finally:
        for name in ("rexit", "rterm"):
            emulated.down(name)
        shutil.rmtree(storage, ignore_errors=True)


def _cmdlines(ns: str) -> str:
    out = []
    for pid in netns.namespace_pids(ns):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "))
        except OSError:
            pass
    return "\n".join(out)


def test_nodes_of_one_machine_talk_at_the_intra_rate_and_across_machines_at_the_bandwidth() -> None:
    """Network only (no Ray): 4 nodes, 2 per machine; 200 Mb/s inside a machine, 50 Mb/s between machines."""
    why = netns.missing_requirement()
    if why is not None:
        pytest.skip(why)
    name = f"g{uuid.uuid4().hex[:6]}"
    try:
        nodes, links = netns.make_network(name, 4, 2, RATE, 4 * RATE)
        assert [n.machine for n in nodes] == [0, 0, 1, 1]
        assert sorted(link.bits for link in links) == [RATE] * 2 + [4 * RATE] * 4  # 2 uplinks, 4 node links
        within = linkprobe.measure(nodes[1].ns, nodes[0].ns, nodes[0].address, 4 * RATE)
        across = linkprobe.measure(nodes[2].ns, nodes[0].ns, nodes[0].address, RATE)
        assert across == pytest.approx(RATE, rel=0.2)
        assert within > 2 * RATE  # not held to the uplinks' rate (a starved sender may fall short of 200 Mb/s)
    finally:
        netns.delete_network(name)
    assert netns.cluster_namespaces(name) == []
