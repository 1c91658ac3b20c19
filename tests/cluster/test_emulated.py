"""The emulated cluster (`python -m ragtrain.cluster`): nodes with their own namespace, address, /tmp and link; and
the multi-node pipeline job on it.

Needs root, ip and tc with tbf (else skipped, with why; the pipeline job then runs on two raylets on 127.0.0.1).
One 2-node cluster at 100 Mb/s (tests/cluster/conftest.py) serves the file, the job included; the last test that
uses it tears it down and checks that nothing is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ragtrain.cluster import emulated, linkprobe, netns
from tests.cluster.conftest import RATE, TwoNodes, host_links, missing_requirement, namespaces, stdout_of
from tests.conftest import REPO, mlflow_db

UPLINK = 50_000_000  # the 4-node network's rate between machines (4x that inside one)


def _on_node(state: emulated.State, i: int, script: str) -> subprocess.CompletedProcess:
    """A shell in node i's network and mount namespaces (those of its `ray start`)."""
    argv = ["nsenter", "-t", str(state.nodes[i]["pid"]), "-m", "-n", "-u", "sh", "-c", script]
    return subprocess.run(argv, capture_output=True, text=True)


def test_each_node_has_its_own_address_and_a_shaped_link_both_ways(emulated_cluster) -> None:
    state, _ = emulated_cluster
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


def test_tmp_is_private_to_each_node(emulated_cluster) -> None:
    """What a node writes under /tmp no other node (nor the host) sees; what the host kept there (a checkout, a
    venv) every node reads; the storage is one folder for all, wherever it sits."""
    state, before = emulated_cluster
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


def test_without_privileges_one_line_and_exit_2() -> None:
    """Root without CAP_NET_ADMIN and CAP_SYS_ADMIN (what a container or a plain user lacks): one line on stderr,
    exit 2, nothing created. Still the owner of the checkout and the venv, wherever they sit (a 0700 folder too)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop the capabilities")
    before = stdout_of(["ip", "netns", "list"])
    argv = ["setpriv", "--bounding-set=-net_admin,-sys_admin", "--inh-caps=-all"]
    argv += [sys.executable, "-m", "ragtrain.cluster", "run", "--nodes", "2", "--", "true"]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "python -m ragtrain.cluster: needs root (CAP_NET_ADMIN is missing): network namespaces, veth links and tbf "
        "need it"
    ]
    assert stdout_of(["ip", "netns", "list"]) == before


def test_docs_pipeline_with_live_refresh_and_a_killed_worker_on_two_nodes(two_nodes: TwoNodes) -> None:
    """The distributed paths in one small run on 2 nodes (the emulated cluster above, else 2 raylets on 127.0.0.1),
    started on the head with RAY_ADDRESS: a documents folder generated, chunked and streamed; training on 2 workers
    while the live refresh runs on the pool_node-labelled node, over 2 index shards (one per index node) that each
    re-encode half their rows per round (eager); trainer rank 1 killed at step 3 and the group restarted from its
    checkpoint; both indexes evaluated. Then index shards on the same cluster: one per index node, and one killed
    mid-search restarts on its node while the search returns the same answer."""
    out = two_nodes.storage / f"docs-{uuid.uuid4().hex[:6]}"
    mlflow_db(out / "mlflow" / "mlflow.db")  # the job's store, relative to its folder: the schema copied, not migrated
    res = two_nodes.job(out, "distributed")
    assert res["killed"] and res["steps"] == 4  # it really died, and training still ran every step
    assert res["refresh_nodes"] == [res["labelled_node"]] and res["refreshes"] >= 1
    for m in res["refresh_metrics"]:  # the 2 index shards each re-encoded half their rows, searched as they landed
        assert m["index/encoded_fraction"] == pytest.approx(0.5, abs=0.05) and m["index/version_skew"] >= 1
        assert 0.0 <= m["index/mixed_recall_at_10"] <= 1.0 and "index/shard1_encode_seconds" in m
        # 3 single-query searches timed from the service's node after each round
        assert 0.0 < m["index/search_ms_p50"] <= m["index/search_ms_p95"]
        if two_nodes.apart:  # a shard on another node than rank 0 fetched the whole snapshot over its link
            assert m["index/round_rx_mb"] >= 0.9 * res["snapshot_mb"] > 0, (m, res["snapshot_mb"])
    # index shards: auto put one on each index node; shard 1 killed mid-search restarted there, from disk, and the
    # search returned what it returns unharmed (and what exact search returns)
    assert res["shards"] == 2 and sorted(res["shard_nodes"]) == sorted(res["nodes"])
    assert res["pids_changed"] == [False, True] and res["restored"] == ["t"]
    assert res["restarted_node"] == res["shard_nodes"][1] and res["same_after_kill"] and res["exact"]
    assert res["chunks"] > 12  # 12 documents, chunked
    assert all(0.0 < v <= 1.0 for v in res["ndcg"].values())
    # rank 0 logged from its node into the SQLite store given relative to the driver's folder: the driver made the
    # path absolute (a worker's working folder is its raylet's); steps 2 and 4 (logged every 2nd; the restarted
    # group went on from the step-2 checkpoint)
    assert res["loss_steps"] == [2, 4]
    if two_nodes.apart:
        # one trainer worker per node (each takes its node's trainer_slot), so every step's gradient all-reduce
        # crossed the shaped link: in flight at least half the ring bound 2(W-1)/W * P/B per step, which loopback
        # (where gloo lands without GLOO_SOCKET_IFNAME) would beat by far
        assert res["comm_s_per_step"] >= 0.5 * res["grad_bytes_per_step"] * 8 / RATE, res


def test_teardown_leaves_no_namespace_link_or_process(emulated_cluster) -> None:
    state, before = emulated_cluster
    pids = [p for n in state.nodes for p in netns.namespace_pids(n["ns"])]
    assert len(pids) > 4  # Ray's processes ran in the node namespaces
    emulated.down(state.spec.name)
    emulated.down(state.spec.name)  # twice: idempotent
    # every namespace made since is another cluster's (other test runs on this machine make and delete theirs)
    made = namespaces() - before["netns"]
    assert [ns for ns in made if not ns.startswith("rtc-") or ns.startswith(f"rtc-{state.spec.name}-")] == []
    assert netns.cluster_namespaces(state.spec.name) == []
    assert host_links() == before["links"]
    assert [p for p in pids if Path(f"/proc/{p}").exists()] == []
    assert not emulated.state_file(state.spec.name).exists()


def _run(*args: str, **kw) -> subprocess.Popen:
    argv = [sys.executable, "-m", "ragtrain.cluster", "run", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow(reason="two more 1-node clusters (~30 s each on 2 cores); the 2-node cluster above runs by default")
def test_run_exits_with_the_command_and_tears_down_on_sigterm(tmp_path_factory) -> None:
    """`run` returns COMMAND's exit code; a SIGTERM while COMMAND runs still tears everything down."""
    why = missing_requirement()
    if why is not None:
        pytest.skip(why)
    before = stdout_of(["ip", "netns", "list"])
    storage = REPO / "outputs" / "test-cluster" / f"r{uuid.uuid4().hex[:6]}"
    try:
        p = _run("--name", "rexit", "--nodes", "1", "--storage", str(storage), "--", "sh", "-c", "exit 3")
        assert p.wait(timeout=300) == 3, p.stderr.read()[-3000:]
        assert stdout_of(["ip", "netns", "list"]) == before
        p = _run("--name", "rterm", "--nodes", "1", "--storage", str(storage), "--", "sleep", "600")
        deadline = time.monotonic() + 300
        while "sleep 600" not in _cmdlines("rtc-rterm-n0"):  # the cluster is up and runs the command
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.5)
        pids = netns.namespace_pids("rtc-rterm-n0")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 128 + signal.SIGTERM
        assert stdout_of(["ip", "netns", "list"]) == before
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
    why = missing_requirement()
    if why is not None:
        pytest.skip(why)
    name = f"g{uuid.uuid4().hex[:6]}"
    try:
        nodes, links = netns.make_network(name, 4, 2, UPLINK, 4 * UPLINK)
        assert [n.machine for n in nodes] == [0, 0, 1, 1]
        assert sorted(link.bits for link in links) == [UPLINK] * 2 + [4 * UPLINK] * 4  # 2 uplinks, 4 node links
        within = linkprobe.measure(nodes[1].ns, nodes[0].ns, nodes[0].address, 4 * UPLINK)
        across = linkprobe.measure(nodes[2].ns, nodes[0].ns, nodes[0].address, UPLINK)
        assert across == pytest.approx(UPLINK, rel=0.2)
        assert within > 2 * UPLINK  # not held to the uplinks' rate (a starved sender may fall short of 200 Mb/s)
    finally:
        netns.delete_network(name)
    assert netns.cluster_namespaces(name) == []
