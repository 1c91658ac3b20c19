"""Run on an emulated cluster's head: a 2-worker TorchTrainer (one worker per node) times one gloo all-reduce.

Usage: python emulated_allreduce.py STORAGE NUMEL. Each rank writes {"rank", "ip", "seconds", "sum"} to
STORAGE/allreduce-<rank>.json; the test reads them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def loop(config: dict) -> None:
    import ray
    import ray.train
    import torch
    import torch.distributed as dist

    t = torch.ones(config["numel"])
    dist.all_reduce(t.clone())  # the first one opens gloo's connections: not timed
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(t)
    seconds = time.perf_counter() - start
    rank = ray.train.get_context().get_world_rank()
    out = {"rank": rank, "ip": ray.util.get_node_ip_address(), "seconds": seconds, "sum": float(t[0])}
    (Path(config["storage"]) / f"allreduce-{rank}.json").write_text(json.dumps(out))


def main() -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    storage, numel = sys.argv[1], int(sys.argv[2])
    TorchTrainer(
        loop,
        train_loop_config={"numel": numel, "storage": storage},
        # one CPU per worker on nodes of one CPU: the two workers land on the two nodes
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=storage, name="allreduce"),
    ).fit()


if __name__ == "__main__":
    main()
