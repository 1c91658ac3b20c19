"""Training throughput while the index shards refresh the index vs while they do not, isolated vs oversubscribed.

What is compared (both inside ONE training run each, so both sides of a ratio share the machine's state)
    Every step of a live-refresh run (``refresh.enabled``) is timed on rank 0 and tagged with whether a refresh
    was running when it ended; ratio = samples/s of tagged steps / samples/s of untagged steps
    (``index/refresh_throughput_ratio``, from ``ragtrain.index.live_client.LiveIndexClient.summary``).
    A: isolated: ``resources=laptop`` -- 1 trainer worker with 1 CPU (1 torch thread) and the refresh's 1 reserved
       CPU (``resources.pool``: the one index shard encodes with 1 torch thread), each in its own placement group,
       on ``num_cpus=2`` (= the cores).
    B: oversubscribed: the same, but the trainer worker takes 2 CPUs (2 torch threads) on ``num_cpus=3``, so during
       a refresh 3 busy threads share 2 cores -- what happens when the trainer and the refresh are not kept apart.
    Time spent measuring staleness and taking snapshots is outside the step times on both sides.
    C: the machine's ceiling: a fixed 1-thread torch workload (MiniLM-sized matmuls) timed alone, then while a second
       process runs the same workload on the other core. Its ratio bounds what any isolation can reach here: on
       vCPUs that are SMT siblings, or share memory bandwidth with each other or with the host, it is < 1.

Data: the quickstart synthetic KB (``--entities``), MiniLM, passages of <= 64 tokens, batch ``--batch-size``.
Run: ``python benchmarks/refresh_throughput.py [--steps 60] [--every 10]``
Results: printed table + ``benchmarks/results/refresh_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KEYS = [
    "index/samples_per_s_refreshing",
    "index/samples_per_s_idle",
    "index/refresh_throughput_ratio",
    "index/steps_during_refresh",
    "index/refreshes",
    "train/samples_per_s",
    "index/refresh_seconds_total",
]


def run_side(name: str, extra: list[str], args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    """One training run with live refresh; returns rank 0's summary."""
    import ray
    from hydra import compose, initialize_config_dir

    from ragtrain.config import register_configs, to_typed
    from ragtrain.pipeline.stages import run

    register_configs()
    overrides = [
        "experiment=quickstart",
        "resources=laptop",
        "logger=none",
        "zeroshot_eval=false",
        f"data.num_entities={args.entities}",
        f"retriever.train.batch_size={args.batch_size}",
        f"retriever.train.max_steps={args.steps}",
        "retriever.train.hard_negatives=1",
        "refresh.enabled=true",
        f"refresh.every_steps={args.every}",
        f"refresh.check_every={args.every}",
        f"output_dir={tmp / name}",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = to_typed(compose(config_name="config", overrides=overrides))
    try:
        results = run(cfg)
    finally:
        ray.shutdown()  # each side gets its own Ray with its own CPU count
    return {k: float(results["train"].get(k, float("nan"))) for k in KEYS}


def _matmuls(seconds: float) -> float:
    """Matmuls/s of one torch thread on MiniLM-sized shapes (batch 16 x 64 tokens, hidden 384, FFN 1536)."""
    import time

    import torch

    torch.set_num_threads(1)
    a, w1, w2 = torch.randn(1024, 384), torch.randn(384, 1536), torch.randn(1536, 384)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a = torch.tanh((a @ w1) @ w2)
        n += 1
    return n / (time.perf_counter() - start)


def ceiling(seconds: float = 10.0) -> dict[str, float]:
    """C: throughput of one busy thread alone vs with a second busy process beside it (same run, same machine)."""
    import multiprocessing as mp
    import time

    alone = _matmuls(seconds)
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        other = pool.apply_async(_matmuls, (seconds + 4,))  # started first, still running for all of our window
        time.sleep(2)
        together = _matmuls(seconds)
        other.get()
    return {"matmuls_per_s_alone": alone, "matmuls_per_s_beside_another": together, "ceiling_ratio": together / alone}


def main() -> None:
    """Run A (isolated) and B (oversubscribed), print the ratios side by side."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="refresh.every_steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--entities", type=int, default=200)
    p.add_argument("--sides", default="A,B", help="comma-separated sides to run: A, B")
    args = p.parse_args()
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        print(f"warning: 1-minute load average {load:.1f} > {os.cpu_count()} cores: figures will be noisy")
    sides = {
        "A isolated (1+1 CPU)": ["resources.num_cpus=2"],
        "B oversubscribed (2+1 CPU on 2 cores)": ["resources.num_cpus=3", "resources.trainer.cpus_per_worker=2"],
    }
    wanted = set(args.sides.split(","))
    sides = {k: v for k, v in sides.items() if k[0] in wanted}
    roof = ceiling()
    with tempfile.TemporaryDirectory() as d:
        out = {name: run_side(f"side{i}", extra, args, Path(d)) for i, (name, extra) in enumerate(sides.items())}
    from tabulate import tabulate

    rows = [
        [name, *[v[k] for k in KEYS], v["index/refresh_seconds_total"] / max(1.0, v["index/refreshes"])]
        for name, v in out.items()
    ]
    print(tabulate(rows, headers=["side", *KEYS, "s/refresh"], floatfmt=".3g"))
    print(
        f"C ceiling: one busy thread beside another busy process runs at {roof['ceiling_ratio']:.3f}x its speed "
        f"alone ({roof['matmuls_per_s_beside_another']:.1f} vs {roof['matmuls_per_s_alone']:.1f} matmuls/s); "
        + "; ".join(
            f"{name}: ratio / ceiling = {v['index/refresh_throughput_ratio'] / roof['ceiling_ratio']:.3f}"
            for name, v in out.items()
        )
    )
    results = REPO / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / "refresh_throughput.json").write_text(
        json.dumps({"args": vars(args), "load": load, "sides": out, "ceiling": roof}, indent=2)
    )


if __name__ == "__main__":
    main()
