"""Retriever training throughput: ragtrain (Ray Train TorchTrainer) vs a plain torchrun DDP script, same model/data.

What is compared
    A: ragtrain: ``ragtrain.retriever.train.fit_retriever`` (TorchTrainer running the unchanged
       ``train_loop_per_worker``), --workers x 1 CPU, gloo, MiniLM, per-worker batch --batch-size.
    B: ``benchmarks/torchrun_baseline.py`` under ``torchrun --nproc_per_node --workers --master_addr 127.0.0.1``
       with OMP_NUM_THREADS=1 and ``torch.set_num_threads(1)`` per process: the same encoder (``build_encoder``),
       ``QPEncoder``, ``tokenize``, ``contrastive_loss``, the same batches (``local_batch``), the same
       optimizer/schedule/clipping, its own loop, DDP wrapper and process group.

How
    Both run --warmup + --steps optimizer steps. Only the --steps steps after the warm-up are timed.
    ragtrain: the config sets ``log_every = --warmup``, and the benchmark passes a picklable file sink (duck-typed
    like ``ragtrain.track.mlflow.MetricSink``) that rank 0's loop calls every log window; it appends
    ``(step, time.time(), metrics)`` to a file. Throughput = (last step - warm-up step) x global batch /
    (time of the last report - time of the warm-up report) -- wall clock, so it includes the loop's own logging.
    The loop's in-window ``train/samples_per_s`` (which excludes the log calls) is reported alongside.
    torchrun: rank 0 stamps every step; throughput = steps x global batch / (t[end] - t[warm-up]).
    Ray start-up, worker-group start-up, model load and checkpointing are outside the timed region on both
    sides (fit_retriever's total wall time is reported for context). Ray is started before each ragtrain
    repetition and shut down after it, so the torchrun runs see no Ray processes.
    Repetitions alternate ragtrain, torchrun, ragtrain, torchrun ... (--reps); we report each side's median
    samples/s and ratio = median(ragtrain) / median(torchrun) (goal >= 0.95). Also the CPU seconds of the rank-0
    process per timed step (``time.process_time`` in the sink / at the stamps): a secondary figure, less
    sensitive to other work on the machine. The per-window mean losses of
    both sides are printed too: same weights and batches, so they should be close (dropout is not seeded
    identically, so they are not bit-equal).

    --sink mlflow swaps the file sink for ragtrain's real ``MetricSink`` (MLflow on SQLite in a temp dir), stamped
    before each MLflow call: the figure then includes the tracking cost inside the loop, and the seconds of each
    ``MetricSink.log`` call are printed (the loop warms the sink up before step 0, so no call is cold).

Data
    --data synthetic (default, short texts) or --data scifact (../shared/data/scifact; if absent the script
    prints a message and exits 0). Query/passage max lengths: 64/256 (ragtrain's defaults) for both.

Run: ``python benchmarks/train_throughput.py [--data synthetic|scifact] [--reps 2] [--batch-size 16]``
Results: printed table + ``benchmarks/results/train_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from torchrun_baseline import DEFAULT_SCIFACT, load_train_data, scifact_available  # noqa: E402

RESULTS = HERE / "results"


@dataclass
class FileSink:
    """Picklable stand-in for ragtrain.track.mlflow.MetricSink: rank 0 appends one JSON line per log call."""

    path: str

    def warm_up(self) -> None:
        """Nothing to start (ragtrain's MetricSink opens its MLflow store here)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        t, cpu = time.time(), time.process_time()  # process_time: CPU seconds of this (rank-0 worker) process
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "time": t, "cpu": cpu, "nice": os.nice(0), "metrics": metrics}) + "\n")


@dataclass
class TimedMlflowSink:
    """--sink mlflow: stamp like FileSink, then log through ragtrain's real MetricSink (MLflow, SQLite in a temp dir).

    The stamp is taken BEFORE the MLflow call, so the wall-clock window [warm-up report, last report] contains
    the MLflow calls of every report but the last.
    """

    path: str
    uri: str
    run_id: str

    def warm_up(self) -> None:
        """Open the MLflow store before step 0, as ragtrain's loop does with its own sink."""
        from ragtrain.track.mlflow import MetricSink

        MetricSink(self.uri, self.run_id).warm_up()

    def log(self, metrics: dict[str, float], step: int) -> None:
        from ragtrain.track.mlflow import MetricSink

        t, cpu = time.time(), time.process_time()
        MetricSink(self.uri, self.run_id).log(metrics, step)
        with open(self.path, "a") as f:
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "time": t,
                        "cpu": cpu,
                        "nice": os.nice(0),
                        "log_s": time.time() - t,
                        "metrics": metrics,
                    }
                )
                + "\n"
            )


def start_local_ray(num_cpus: int) -> None:
    """A private local Ray, as ragtrain.cluster.resources.init_ray starts it (same runtime env), but with
    address="local": a plain ray.init() attaches to any `ray start` cluster already running on the machine
    (and then refuses num_cpus), which would mix other people's work into the measurement."""
    import ray

    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    ray.init(address="local", num_cpus=num_cpus, runtime_env={"env_vars": env})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def composed_sync(name: str):
    """conf/sync/<name>.yaml composed and typed as `python -m ragtrain sync=<name>` composes it."""
    from hydra import compose, initialize_config_dir

    from ragtrain.config import PROJECT_ROOT, register_configs, to_typed

    register_configs()
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return to_typed(compose("config", overrides=[f"sync={name}", "output_dir=unused"])).sync


def run_ragtrain(args, data, weights, rep: int) -> dict:
    import ray

    from ragtrain.cluster.resources import check_config
    from ragtrain.config import Config
    from ragtrain.config.data import DataConfig
    from ragtrain.config.logger import LoggerBackend, LoggerConfig
    from ragtrain.config.resources import ResourcesConfig, TrainerResources
    from ragtrain.config.retriever import RetrieverConfig, RetrieverTrainConfig
    from ragtrain.retriever.train import fit_retriever

    # the replica-sync strategy (ragtrain.config.sync.SyncConfig), when this ragtrain has one
    sync_kw = {"sync": composed_sync(args.sync)} if args.sync else {}
    with tempfile.TemporaryDirectory(prefix="ragtrain_bench_") as tmp:
        cfg = Config(
            data=DataConfig(source="beir", root=str(args.scifact_root))
            if args.data == "scifact"
            else DataConfig(num_entities=args.num_entities),
            retriever=RetrieverConfig(
                model="minilm",
                query_max_length=args.query_max_length,
                passage_max_length=args.passage_max_length,
                train=RetrieverTrainConfig(
                    batch_size=args.batch_size, max_steps=args.warmup + args.steps, log_every=args.warmup, seed=0
                ),
            ),
            resources=ResourcesConfig(
                num_cpus=args.ray_cpus, trainer=TrainerResources(num_workers=args.workers, cpus_per_worker=1.0)
            ),
            logger=LoggerConfig(backend=LoggerBackend.none),
            output_dir=str(Path(tmp) / "out"),
            **sync_kw,
            stages=["retriever"],
            zeroshot_eval=False,
        )
        sink_path = str(Path(tmp) / "sink.jsonl")
        if args.sink == "mlflow":
            from ragtrain.track.mlflow import RunLogger

            logger = RunLogger(
                LoggerConfig(tracking_uri=f"sqlite:///{tmp}/mlflow.db", experiment_name="bench"),
                run_name=f"train_throughput_{rep}",
            )
            sink = TimedMlflowSink(sink_path, logger.uri, logger.run_id)
        else:
            sink = FileSink(sink_path)
        start_local_ray(cfg.resources.num_cpus)
        check_config(cfg.resources)
        t0 = time.perf_counter()
        fit = fit_retriever(cfg, data, weights, sink=sink)
        total_s = time.perf_counter() - t0
        ray.shutdown()
        recs = [json.loads(line) for line in Path(sink.path).read_text().splitlines()]
    # Only the training-window reports (the loop may log other metric groups, e.g. drift/*, at the same steps).
    recs = [r for r in recs if "train/samples_per_s" in r["metrics"]]
    recs.sort(key=lambda r: r["step"])
    gb = args.batch_size * args.workers
    first = next(r for r in recs if r["step"] == args.warmup)
    last = recs[-1]
    assert last["step"] == args.warmup + args.steps, recs
    wall_s = last["time"] - first["time"]
    n = (last["step"] - first["step"]) * gb
    # The loop's own per-window figure: window samples / window seconds (log calls excluded).
    after = [r for r in recs if r["step"] > args.warmup]
    prev_steps = [args.warmup] + [r["step"] for r in after[:-1]]
    win_samples = [(r["step"] - p) * gb for r, p in zip(after, prev_steps)]
    win_secs = [s / r["metrics"]["train/samples_per_s"] for s, r in zip(win_samples, after)]
    return {
        "samples_per_s": n / wall_s,
        "rank0_cpu_s_per_step": (last["cpu"] - first["cpu"]) / (last["step"] - first["step"]),
        "rank0_nice": last.get("nice"),
        "measured_seconds": wall_s,
        "inloop_samples_per_s": sum(win_samples) / sum(win_secs),
        "fit_seconds_total": total_s,
        "fit_steps": fit.steps,
        "sink": args.sink,
        "sink_log_seconds": [r["log_s"] for r in recs if "log_s" in r],
        "windows": [
            {
                "step": r["step"],
                "loss": r["metrics"]["train/loss"],
                "samples_per_s": r["metrics"]["train/samples_per_s"],
            }
            for r in recs
        ],
    }


def run_torchrun(args, rep: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="torchrun_bench_") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc_per_node",
            str(args.workers),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            str(HERE / "torchrun_baseline.py"),
            "--data",
            args.data,
            "--scifact-root",
            str(args.scifact_root),
            "--num-entities",
            str(args.num_entities),
            "--batch-size",
            str(args.batch_size),
            "--warmup",
            str(args.warmup),
            "--steps",
            str(args.steps),
            "--query-max-length",
            str(args.query_max_length),
            "--passage-max-length",
            str(args.passage_max_length),
            "--threads",
            "1",
            "--out",
            str(out),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, cwd=str(REPO), check=True, timeout=args.timeout)
        total_s = time.perf_counter() - t0
        res = json.loads(out.read_text())
    res["process_seconds_total"] = total_s
    # Window losses on the same grid as ragtrain's log windows (mean of the per-step global mean losses).
    ends = list(range(args.warmup, args.warmup + args.steps + 1, args.warmup))
    if ends[-1] != args.warmup + args.steps:
        ends.append(args.warmup + args.steps)
    starts = [0] + ends[:-1]
    res["windows"] = [{"step": e, "loss": statistics.fmean(res["losses"][s:e])} for s, e in zip(starts, ends)]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", choices=["synthetic", "scifact"], default="synthetic")
    ap.add_argument("--scifact-root", default=str(DEFAULT_SCIFACT))
    ap.add_argument("--num-entities", type=int, default=200, help="synthetic KB size")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ray-cpus", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16, help="queries per worker per step")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (also ragtrain's log_every)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--query-max-length", type=int, default=64)
    ap.add_argument("--passage-max-length", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument(
        "--sync",
        default=None,
        help="ragtrain sync.strategy (default: the config's default, ddp); the baseline is always DDP",
    )
    ap.add_argument(
        "--sink",
        choices=["file", "mlflow"],
        default="file",
        help="ragtrain's metric sink: a file (no tracking cost) or ragtrain's MLflow MetricSink (SQLite)",
    )
    ap.add_argument("--timeout", type=int, default=1800, help="per torchrun run (s)")
    ap.add_argument(
        "--ray-worker-niceness",
        type=int,
        default=None,
        help="set RAY_worker_niceness for our Ray (Ray's default: workers run at nice 15, the baseline at "
        "nice 0; on a loaded machine pass 0 to compare like for like)",
    )
    ap.add_argument("--out", default=str(RESULTS / "train_throughput.json"))
    args = ap.parse_args()
    if args.ray_worker_niceness is not None:
        os.environ["RAY_worker_niceness"] = str(args.ray_worker_niceness)  # read by the raylet at ray.init

    if args.data == "scifact" and not scifact_available(args.scifact_root):
        print(f"SKIP: SciFact not found at {args.scifact_root} (use --data synthetic for the synthetic KB)")
        return 0

    load_start = os.getloadavg()[0]
    if load_start > (os.cpu_count() or 1):
        print(
            f"WARNING: 1-min load average {load_start:.1f} > {os.cpu_count()} CPUs: other work is running, "
            "figures will be noisy (the ratio of alternated medians is the robust number)"
        )

    import torch

    from ragtrain.config.retriever import RetrieverConfig
    from ragtrain.embed.model import build_encoder

    data = load_train_data(args.data, args.scifact_root, args.num_entities)
    print(
        f"[data] {args.data}: {len(data.passages)} passages, {len(data.examples)} training examples; "
        f"{args.workers} workers x batch {args.batch_size}, {args.warmup} warm-up + {args.steps} timed steps"
    )
    weights = {k: v.detach().clone() for k, v in build_encoder(RetrieverConfig(model="minilm")).state_dict().items()}

    rag, base = [], []
    for rep in range(args.reps):
        print(f"\n--- rep {rep + 1}/{args.reps}: ragtrain (TorchTrainer) ---", flush=True)
        rag.append(run_ragtrain(args, data, weights, rep))
        print(f"[rep {rep + 1}] ragtrain {rag[-1]['samples_per_s']:.2f} samples/s", flush=True)
        print(f"\n--- rep {rep + 1}/{args.reps}: torchrun baseline ---", flush=True)
        base.append(run_torchrun(args, rep))
        print(
            f"[rep {rep + 1}] torchrun {base[-1]['samples_per_s']:.2f} samples/s (load avg {os.getloadavg()[0]:.1f})",
            flush=True,
        )

    rag_med = statistics.median(r["samples_per_s"] for r in rag)
    rag_inloop_med = statistics.median(r["inloop_samples_per_s"] for r in rag)
    base_med = statistics.median(r["samples_per_s"] for r in base)
    ratio = rag_med / base_med

    from tabulate import tabulate

    headers = ["samples/s"] + [f"rep {i + 1}" for i in range(args.reps)] + ["median"]
    rows = [
        ["ragtrain TorchTrainer (wall)"] + [f"{r['samples_per_s']:.2f}" for r in rag] + [f"{rag_med:.2f}"],
        ["ragtrain (loop's own figure)"]
        + [f"{r['inloop_samples_per_s']:.2f}" for r in rag]
        + [f"{rag_inloop_med:.2f}"],
        ["torchrun DDP"] + [f"{r['samples_per_s']:.2f}" for r in base] + [f"{base_med:.2f}"],
    ]
    gb = args.batch_size * args.workers
    print()
    print(
        f"== retriever train throughput: {args.data}, {args.workers} workers x 1 CPU, global batch {gb}, "
        f"q/p max len {args.query_max_length}/{args.passage_max_length}, {args.steps} timed steps =="
    )
    print(tabulate(rows, headers=headers))
    print(f"ratio ragtrain/torchrun (medians): {ratio:.3f}  (goal >= 0.95: {'OK' if ratio >= 0.95 else 'BELOW'})")
    print(f"nice: ragtrain rank-0 worker {rag[0].get('rank0_nice')}, torchrun ranks {os.nice(0)} (inherited)")
    print(
        f"start-up + checkpoint (not timed): ragtrain fit_retriever total median "
        f"{statistics.median(r['fit_seconds_total'] for r in rag):.1f}s, torchrun process total median "
        f"{statistics.median(r['process_seconds_total'] for r in base):.1f}s"
    )
    if args.sink == "mlflow":
        calls = [[f"{x:.3f}" for x in r["sink_log_seconds"]] for r in rag]
        print(f"MetricSink.log seconds per report (rank 0, in the training loop): {calls}")
    rag_cpu = statistics.median(r["rank0_cpu_s_per_step"] for r in rag)
    base_cpu = statistics.median(r["rank0_cpu_s_per_step"] for r in base)
    print(
        f"rank-0 CPU seconds per step (medians; less sensitive to other load): ragtrain {rag_cpu:.3f}, "
        f"torchrun {base_cpu:.3f}, efficiency ratio torchrun/ragtrain {base_cpu / rag_cpu:.3f}"
    )
    lrows = [
        [w["step"]] + [f"{r['windows'][i]['loss']:.4f}" for r in rag] + [f"{r['windows'][i]['loss']:.4f}" for r in base]
        for i, w in enumerate(rag[0]["windows"])
    ]
    print("window mean loss (sanity: same weights and batches; dropout is unseeded, so only roughly equal):")
    print(
        tabulate(
            lrows,
            headers=["step"]
            + [f"ragtrain {i + 1}" for i in range(args.reps)]
            + [f"torchrun {i + 1}" for i in range(args.reps)],
        )
    )

    result = {
        "benchmark": "train_throughput",
        "data": args.data,
        "workers": args.workers,
        "cpus_per_worker": 1,
        "batch_size": args.batch_size,
        "global_batch": gb,
        "warmup_steps": args.warmup,
        "measured_steps": args.steps,
        "query_max_length": args.query_max_length,
        "passage_max_length": args.passage_max_length,
        "reps": args.reps,
        "sink": args.sink,
        "sync": args.sync or "config default",
        "ragtrain": {"median_samples_per_s": rag_med, "median_inloop_samples_per_s": rag_inloop_med, "runs": rag},
        "torchrun": {"median_samples_per_s": base_med, "runs": base},
        "ratio_ragtrain_over_torchrun": ratio,
        "rank0_cpu_s_per_step": {
            "ragtrain": rag_cpu,
            "torchrun": base_cpu,
            "ratio_torchrun_over_ragtrain": base_cpu / rag_cpu,
        },
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "loadavg_1min": {"start": load_start, "end": os.getloadavg()[0]},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
