"""Run by test_sharded.py in its own process: index shards on a real 2-node Ray cluster (separate raylets on
127.0.0.1, both offering `index_node`). index.shards=auto places one shard per node; a shard's process is killed
while a search is in flight and the search still returns the same answer. Prints one JSON line."""

import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np
import ray
from ray.cluster_utils import Cluster


def main(out_dir: str) -> None:
    from ragtrain.config import IndexConfig, PoolResources
    from ragtrain.index.sharded import SEARCH_BATCH, ShardGroup, resolve_shards
    from tests.index.test_shards import _vectors, _write_shards

    out = Path(out_dir)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"index_node": 1}})
    cluster.add_node(num_cpus=1, resources={"index_node": 1})
    ray.init(address=cluster.address)
    try:
        x = _vectors(300)
        shards = _write_shards(out / "vec", [f"d{i}" for i in range(300)], x, per_file=50)
        n = resolve_shards("auto", shards.rows, ray.nodes())
        group = ShardGroup(n, out / "shards", PoolResources(num_actors=1), timeout_s=60.0)
        index = group.build("t", shards, IndexConfig(), "fp", "enc", 0, seed=0)
        before = group.info()
        q = _vectors(8 * SEARCH_BATCH, seed=1)
        want = index.search(q, 10)
        exact = np.argsort(-(q[:50] @ x.T), axis=1, kind="stable")[:, :10]
        with ThreadPoolExecutor(1) as pool:
            searching = pool.submit(index.search, q, 10)
            time.sleep(0.05)
            os.kill(before[1]["pid"], signal.SIGKILL)  # shard 1's process, on the second raylet
            got = searching.result()
        after = group.info()
        print(
            json.dumps(
                {
                    "shards": n,
                    "nodes": [nd["NodeID"] for nd in ray.nodes() if nd["Alive"]],
                    "shard_nodes": [i["node"] for i in before],
                    "restarted_node": after[1]["node"],
                    "pids_changed": [a["pid"] != b["pid"] for a, b in zip(after, before)],
                    "restored": after[1]["restored"],
                    "same_after_kill": bool((got[1] == want[1]).all() and (got[0] == want[0]).all()),
                    "exact": bool((want[1][:50] == exact).all()),
                }
            )
        )
        group.close()
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
