"""A real two-node Ray cluster on one machine (ray.cluster_utils.Cluster, separate raylets on 127.0.0.1).

It runs in a subprocess so it cannot disturb the session's shared local Ray cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragtrain.sync.comm import all_reduce_bytes
from tests.conftest import REPO


@pytest.mark.integration
def test_hierarchical_sync_and_labelled_pool_on_two_nodes(tmp_path: Path) -> None:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run(
        [sys.executable, str(REPO / "tests" / "cluster" / "multinode_job.py"), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    assert len(res["nodes"]) == 2  # two raylets, distinct node ids
    assert res["pool_nodes"] == [res["labelled_node"]]  # the pool landed on the index_node-labelled node
    # live refresh: every index version was built on the labelled node while training ran on the cluster
    assert res["refresh_nodes"] == [res["labelled_node"]] and res["refreshes"] >= 1
    m, p = res["metrics"], 4 * res["n_params"]
    assert m["sync/nodes"] == 2  # 4 workers found 2 nodes (2 workers each)
    # every step: a 2-worker all-reduce inside the node; every 2nd step: a 4-worker all-reduce of parameters
    assert m["comm/bytes_per_step/grad_intra"] == all_reduce_bytes(p, 2)
    assert m["comm/bytes_per_step/params_inter"] == all_reduce_bytes(p, 4) / 2
