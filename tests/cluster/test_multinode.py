"""Multi-node jobs on a 2-node cluster of this module's own (tests/cluster/conftest.py: the emulated cluster where
this machine can make it, else two raylets on 127.0.0.1), each started on the head in a process of its own, so it
cannot disturb the test process's own Ray. The default suite's multi-node run is in test_emulated.py, on the cluster
its emulated checks use."""

from __future__ import annotations

import math
import uuid
from pathlib import Path

import pytest

from ragtrain.sync.comm import all_reduce_bytes
from tests.cluster.conftest import TwoNodes


def _out(two_nodes: TwoNodes, what: str) -> Path:
    """A fresh output folder in the cluster's storage (each emulated node has its own /tmp: not tmp_path)."""
    return two_nodes.storage / f"{what}-{uuid.uuid4().hex[:6]}"


@pytest.mark.slow(
    reason="a 2-node cluster of its own (~10 s); which paths are checked is unit-tested in test_storage.py"
)
def test_every_node_must_see_the_shared_paths(two_nodes: TwoNodes) -> None:
    """A path some node cannot see fails up front, naming its key and the node; the probe files are removed. On
    nodes apart it is a folder in the driver's own /tmp, named as unseen from the other node; on one machine's
    raylets (one filesystem) a path no node has, missing on both (each node answered itself)."""
    res = two_nodes.job(_out(two_nodes, "storage"), "storage")
    assert res["looked_from"] == res["nodes"] and res["left"] == []
    assert res["error"].startswith(f"data.root={res['only_here']!r} is not visible from node ")
    assert "on a cluster of 2 nodes" in res["error"]
    if two_nodes.apart:  # the driver (on the head) has it: node 1 is the one that cannot see it
        assert res["only_here"].startswith("/tmp/") and "(10.237.0.11)" in res["error"]


@pytest.mark.slow(
    reason="a pipeline run on this module's 2-node cluster; the default suite's is test_emulated.py's docs run"
)
def test_live_refresh_builds_every_version_on_the_labelled_node(two_nodes: TwoNodes) -> None:
    res = two_nodes.job(_out(two_nodes, "refresh"), "refresh")
    # every index version was built on the labelled node while training ran on the cluster
    assert res["refresh_nodes"] == [res["labelled_node"]] and res["refreshes"] >= 1


@pytest.mark.slow(
    reason="a 2-node cluster and three 4-worker trainings (~105 s); node scoping is unit-tested with gloo groups"
)
def test_node_scoped_sync_and_labelled_pool_on_two_nodes(two_nodes: TwoNodes) -> None:
    res = two_nodes.job(_out(two_nodes, "sync"), "sync")
    assert res["pool_nodes"] == [res["labelled_node"]]  # the refresh's CPUs: on the pool_node-labelled node
    m, p = res["metrics"], 4 * res["n_params"]
    assert m["sync/nodes"] == 2  # 4 workers found 2 nodes (2 workers each)
    # every step: a 2-worker all-reduce inside the node; every 2nd step: a 4-worker all-reduce of parameters
    assert m["comm/bytes_per_step/grad_intra"] == all_reduce_bytes(p, 2)
    assert m["comm/bytes_per_step/params_inter"] == all_reduce_bytes(p, 4) / 2

    # sync=hybrid_powersgd (start_iter 2, rank 4, 4 steps): the node mean in fp32 every step, then PowerSGD among the
    # 2 workers of equal local rank (one per node): steps 0-1 the full gradient, steps 2-3 the factors
    h = res["hybrid"]
    assert h["sync/nodes"] == 2 and h["comm/bytes_per_step/grad_intra"] == all_reduce_bytes(p, 2)
    assert (
        h["comm/bytes_per_step/grad_inter"]
        == (2 * all_reduce_bytes(p, 2) + 2 * all_reduce_bytes(4 * powersgd_numel(res["shapes"], 4), 2)) / 4
    )
    assert h["drift/param_divergence_mean"] < 1e-6  # every replica applied the same gradient
    # sync=layerwise: the top layer's gradients every step over 4 workers, the rest's parameters every 2nd step
    lw, top = res["layerwise"], 4 * res["n_top"]
    assert lw["comm/bytes_per_step/grad"] == all_reduce_bytes(top, 4)
    assert lw["comm/bytes_per_step/params"] == all_reduce_bytes(p - top, 4) / 2
    # drift is probed at step 4, right after a round: every group equal (the recipe clips the groups apart)
    assert lw["drift/param_divergence_mean"] < 1e-6


def powersgd_numel(shapes: list[list[int]], rank: int) -> int:
    """Entries PowerSGD all-reduces per step (torch's rule: a tensor viewed as n x m is compressed to rank x (n + m)
    when 2 x rank x (n + m) < n x m, its default min_compression_rate 2; vectors go whole)."""
    total = 0
    for s in shapes:
        n = s[0] if s else 1
        m = math.prod(s) // n if s else 1
        total += rank * (n + m) if len(s) > 1 and 2 * rank * (n + m) < n * m else n * m
    return total
