"""A real two-node Ray cluster on one machine (ray.cluster_utils.Cluster, separate raylets on 127.0.0.1).

It runs in a subprocess so it cannot disturb the session's shared local Ray cluster.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragtrain.sync.comm import all_reduce_bytes
from tests.conftest import REPO


def _job(out: Path, part: str) -> dict:
    """Run multinode_job.py's `part` on a fresh 2-node cluster; its JSON line."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run(
        [sys.executable, str(REPO / "tests" / "cluster" / "multinode_job.py"), str(out), part],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    assert len(res["nodes"]) == 2  # two raylets, distinct node ids
    return res


@pytest.mark.slow(
    reason="a 2-node cluster of its own (~10 s); which paths are checked is unit-tested in test_storage.py"
)
def test_every_node_must_see_the_shared_paths(tmp_path: Path) -> None:
    """A path some node cannot see fails up front, naming its key and the node; the probe files are removed.
    (One machine shares one filesystem: the missing path is missing on both nodes; each node answered itself.)"""
    res = _job(tmp_path / "out", "storage")
    assert res["looked_from"] == res["nodes"] and res["left"] == []
    assert (
        res["error"].startswith(f"data.root={str(tmp_path / 'out' / 'only-on-the-driver')!r} is not visible from node ")
        and "on a cluster of 2 nodes" in res["error"]
    )


def test_docs_pipeline_with_live_refresh_and_a_killed_worker_on_two_nodes(tmp_path: Path) -> None:
    """The distributed paths in one small run on a real 2-raylet cluster: a documents folder generated, chunked and
    streamed; training on 2 workers while the live refresh runs on the index_node-labelled node, over 2 index
    shards that each re-encode half their rows per round (eager); trainer rank 1 killed at step 3 and the group
    restarted from its checkpoint; both indexes evaluated. Then index shards on the same cluster: one per index
    node, and one killed mid-search restarts on its node while the search returns the same answer."""
    res = _job(tmp_path / "out", "distributed")
    assert res["killed"] and res["steps"] == 4  # it really died, and training still ran every step
    assert res["refresh_nodes"] == [res["labelled_node"]] and res["refreshes"] >= 1
    for m in res["refresh_metrics"]:  # the 2 index shards each re-encoded half their rows, searched as they landed
        assert m["index/encoded_fraction"] == pytest.approx(0.5, abs=0.05) and m["index/version_skew"] >= 1
        assert 0.0 <= m["index/mixed_recall_at_10"] <= 1.0 and "index/shard1_encode_seconds" in m
    # index shards: auto put one on each index node; shard 1 killed mid-search restarted there, from disk, and the
    # search returned what it returns unharmed (and what exact search returns)
    assert res["shards"] == 2 and sorted(res["shard_nodes"]) == sorted(res["nodes"])
    assert res["pids_changed"] == [False, True] and res["restored"] == ["t"]
    assert res["restarted_node"] == res["shard_nodes"][1] and res["same_after_kill"] and res["exact"]
    assert res["chunks"] > 12  # 12 documents, chunked
    assert all(0.0 < v <= 1.0 for v in res["ndcg"].values())


@pytest.mark.slow(reason="a second 2-node cluster and a pipeline run; the default suite's is the docs run above")
def test_live_refresh_builds_every_version_on_the_labelled_node(tmp_path: Path) -> None:
    res = _job(tmp_path / "out", "refresh")
    # every index version was built on the labelled node while training ran on the cluster
    assert res["refresh_nodes"] == [res["labelled_node"]] and res["refreshes"] >= 1


@pytest.mark.slow(
    reason="a 2-node cluster and three 4-worker trainings (~105 s); node scoping is unit-tested with gloo groups"
)
def test_node_scoped_sync_and_labelled_pool_on_two_nodes(tmp_path: Path) -> None:
    res = _job(tmp_path / "out", "sync")
    assert res["pool_nodes"] == [res["labelled_node"]]  # the refresh's CPUs: on the index_node-labelled node
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
