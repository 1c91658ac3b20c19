"""Index-pool encode throughput: ragtrain's EncoderPool vs one sentence-transformers process, same CPUs.

What is compared
    A: sentence-transformers ``SentenceTransformer(minilm_path()).encode(texts, batch_size=64,
       normalize_embeddings=True)`` in THIS process, torch intra-op threads = --st-threads (default 2),
       ``max_seq_length`` forced to --max-length (256).
    B: ``ragtrain.index.pool.EncoderPool`` with --actors x --cpus-per-actor Ray CPUs (default 2 x 1, i.e. the
       machine's 2 cores; ``--actors 1 --cpus-per-actor 2`` tries one 2-thread actor), fed the same texts with the
       same max length, batch size and fp32 precision, through ``EncoderPool.encode`` exactly as the pipeline does.
    Both use the same MiniLM weights (the pool receives the ragtrain encoder's initial state dict via set_weights).

How
    Ray start-up, actor start-up (model load in each actor) and one warm-up encode of --warmup-docs texts on each
    side are excluded. The weight transfer (``ray.put`` + ``EncoderPool.set_weights``) is timed separately, per
    repetition, with a new snapshot version each time. Timed repetitions alternate A, B, A, B, ... (--reps), each
    timed with ``time.perf_counter`` around the encode call only; we report docs/s per repetition, the median of
    each side, and ratio = median(pool docs/s) / median(ST docs/s) (goal >= 0.95). The vectors of the last
    repetition of each side are compared row by row (max |a - b| and min cosine; they must agree: >= 0.9999).
    On Linux the CPU seconds of each side are read too (this process for ST; the actors' /proc counters plus
    this driver for the pool): docs per CPU-second is printed as a secondary, load-robust efficiency figure, and
    the per-actor CPU seconds show how evenly the shards spread the work over the actors. The shards
    ``EncoderPool.encode`` really used are recorded by wrapping ``ragtrain.index.pool.make_shards`` (observed
    only, passed through unchanged) and printed with their post-truncation token counts.
    Ray runs its workers at nice 15, and this process runs at nice 0. On a machine busy with other work, that
    alone can sink the pool's wall-clock figure, so pass --ray-worker-niceness 0 to compare like for like.
    The niceness of both sides is printed.

Data
    Default: the first --docs SciFact passages in corpus order (``Passage.full_text()``), from
    ``../shared/data/scifact`` (override with --scifact-root). If that folder is absent the script prints a message
    and exits 0, unless ``--data synthetic`` is given (the synthetic people KB, short passages).

Run: ``python benchmarks/pool_throughput.py [--docs 1000] [--reps 3] [--actors 2 --cpus-per-actor 1]``
Results: printed table + ``benchmarks/results/pool_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# Must be set before Ray (or transformers) is imported: keep Ray on 127.0.0.1, never reach the Hub.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# $RAGTRAIN_DATA (relative: to the checkout, as the configs read it), else ../shared/data
DEFAULT_SCIFACT = (HERE.parent / os.environ.get("RAGTRAIN_DATA", "../shared/data")).resolve() / "scifact"
RESULTS = HERE / "results"


def start_local_ray(num_cpus: int) -> None:
    """A private local Ray, as ragtrain.cluster.resources.init_ray starts it (same runtime env), but with
    address="local": a plain ray.init() attaches to any `ray start` cluster already running on the machine
    (and then refuses num_cpus), which would mix other people's work into the measurement."""
    import ray

    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    ray.init(address="local", num_cpus=num_cpus, runtime_env={"env_vars": env})


def proc_cpu_seconds(pid: int) -> float | None:
    """user + system CPU seconds of a process (all its threads), from /proc (Linux); None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def proc_nice(pid: int) -> int | None:
    """The nice value of a process, from /proc (Linux); None elsewhere."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
    except (OSError, IndexError, ValueError):
        return None


def descendant_pids(root: int, name: str) -> list[int]:
    """PIDs of processes under `root` (this driver: its raylet, then the workers) whose cmdline contains `name`."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, stack = [], [root]
    while stack:
        for c in children.get(stack.pop(), []):
            stack.append(c)
            try:
                if name in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace"):
                    out.append(c)
            except OSError:
                pass
    return sorted(out)


def load_texts(args) -> tuple[list[str], str] | None:
    """The first --docs passage texts (full_text) of the chosen data set, or None when SciFact is absent."""
    if args.data == "scifact":
        root = Path(args.scifact_root)
        if not (root / "queries.jsonl").exists():
            return None
        from ragtrain.data import load_beir

        data = load_beir(root, split="dev")
        name = "scifact"
    else:
        from ragtrain.data import make_synthetic

        # The synthetic KB has 5 passages per entity.
        data = make_synthetic(num_entities=max(10, math.ceil(args.docs / 5) + 1), seed=0)
        name = "synthetic"
    texts = [p.full_text() for p in data.corpus.values()][: args.docs]
    return texts, name


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", choices=["scifact", "synthetic"], default="scifact")
    ap.add_argument("--scifact-root", default=str(DEFAULT_SCIFACT))
    ap.add_argument("--docs", type=int, default=1000, help="first N passages of the corpus")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per side (alternated)")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--cpus-per-actor", type=float, default=1.0)
    ap.add_argument("--ray-cpus", type=int, default=2, help="ray.init(num_cpus=...)")
    ap.add_argument("--st-threads", type=int, default=2, help="torch threads of the sentence-transformers process")
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument(
        "--shard-size",
        type=int,
        default=None,
        help="IndexConfig.shard_size (default: ragtrain's; the pool may still cut smaller shards)",
    )
    ap.add_argument(
        "--shards-per-actor",
        type=int,
        default=None,
        help="experiment: override ragtrain.index.pool.SHARDS_PER_ACTOR in this process (default: keep)",
    )
    ap.add_argument("--warmup-docs", type=int, default=64, help="texts encoded once per side before timing")
    ap.add_argument(
        "--ray-worker-niceness",
        type=int,
        default=None,
        help="set RAY_worker_niceness for our Ray (Ray's default: workers run at nice 15, the baseline at "
        "nice 0; on a loaded machine pass 0 to compare like for like)",
    )
    ap.add_argument("--out", default=str(RESULTS / "pool_throughput.json"))
    args = ap.parse_args()
    if args.ray_worker_niceness is not None:
        os.environ["RAY_worker_niceness"] = str(args.ray_worker_niceness)  # read by the raylet at ray.init

    loaded = load_texts(args)
    if loaded is None:
        print(f"SKIP: SciFact not found at {args.scifact_root} (use --data synthetic for the synthetic KB)")
        return 0
    texts, data_name = loaded
    n_tokens_note = f"{len(texts)} docs from {data_name}, mean {statistics.mean(len(t) for t in texts):.0f} chars"
    print(f"[data] {n_tokens_note}")

    load_start = os.getloadavg()[0]
    if load_start > (os.cpu_count() or 1):
        print(
            f"WARNING: 1-min load average {load_start:.1f} > {os.cpu_count()} CPUs: other work is running, "
            "figures will be noisy (the ratio of alternated medians is the robust number)"
        )

    import numpy as np
    import ray
    import torch
    from sentence_transformers import SentenceTransformer

    from ragtrain.config import IndexConfig, PoolResources, Precision, RetrieverConfig
    from ragtrain.embed.model import build_encoder, minilm_path
    from ragtrain.index.pool import EncoderPool

    torch.set_num_threads(args.st_threads)
    retriever = RetrieverConfig(model="minilm", passage_max_length=args.max_length)
    index_kw = {"batch_size": args.batch_size, "precision": Precision.fp32}
    if args.shard_size:
        index_kw["shard_size"] = args.shard_size
    index_cfg = IndexConfig(**index_kw)

    # --- side A: sentence-transformers in this process
    st = SentenceTransformer(minilm_path(), device="cpu")
    st.max_seq_length = args.max_length
    assert st.max_seq_length == args.max_length

    def st_encode(tx: list[str]) -> np.ndarray:
        return st.encode(
            tx, batch_size=args.batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )

    # --- side B: ragtrain's pool on a private local Ray (ray.init(address="local", num_cpus=2))
    t0 = time.perf_counter()
    start_local_ray(args.ray_cpus)
    ray_start_s = time.perf_counter() - t0
    pool_res = PoolResources(num_actors=args.actors, cpus_per_actor=args.cpus_per_actor)
    t0 = time.perf_counter()
    pool = EncoderPool(retriever, pool_res)
    pool.node_ids()  # blocks until every actor has run __init__ (model load)
    actor_start_s = time.perf_counter() - t0
    weights = {k: v.detach().clone() for k, v in build_encoder(retriever).state_dict().items()}

    def send_weights(version: str) -> tuple[float, float]:
        t = time.perf_counter()
        ref = ray.put(weights)
        put_s = time.perf_counter() - t
        t = time.perf_counter()
        pool.set_weights(version, ref)
        return put_s, time.perf_counter() - t

    def pool_encode(tx: list[str]) -> np.ndarray:
        vecs, _ = pool.encode(tx, args.max_length, index_cfg, progress=False)
        return vecs

    # Observe (not change) the shards EncoderPool.encode really uses: wrap the module-level make_shards it calls.
    import ragtrain.index.pool as pool_module

    seen_shards: list[list[list[int]]] = []
    _make_shards = pool_module.make_shards

    def recording_make_shards(*a, **k):
        shards = _make_shards(*a, **k)
        seen_shards.append(shards)
        return shards

    pool_module.make_shards = recording_make_shards
    if args.shards_per_actor is not None:  # experiment knob: override the pool's module constant in this process
        if not hasattr(pool_module, "SHARDS_PER_ACTOR"):
            raise SystemExit("--shards-per-actor: this ragtrain's EncoderPool has no SHARDS_PER_ACTOR")
        pool_module.SHARDS_PER_ACTOR = args.shards_per_actor
    tok_len = [len(x) for x in st.tokenizer(texts, truncation=True, max_length=args.max_length)["input_ids"]]
    print(
        f"[setup] ray.init {ray_start_s:.1f}s, {args.actors} actor(s) x {args.cpus_per_actor:g} CPU up in "
        f"{actor_start_s:.1f}s (excluded)"
    )

    # Warm-up both sides (first-call allocations, lazy imports) outside the timed region.
    send_weights("warmup")
    warm = texts[: args.warmup_docs]
    st_encode(warm)
    pool_encode(warm)

    actor_pids = descendant_pids(os.getpid(), "EncoderActor")
    if len(actor_pids) != args.actors:
        actor_pids = []  # could not identify our actors (not Linux?): no CPU-time figures for the pool

    actor_nice = [proc_nice(p) for p in actor_pids]
    print(f"[setup] nice: this process (ST) {os.nice(0)}, pool actors {actor_nice}")

    def pool_cpu() -> list[float] | None:
        vals = [proc_cpu_seconds(p) for p in actor_pids]
        return None if not vals or any(v is None for v in vals) else vals  # type: ignore[return-value]

    st_rates, pool_rates, put_times, set_times = [], [], [], []
    st_cpu_rates, pool_cpu_rates, actor_cpu = [], [], []
    st_vecs = pool_vecs = None
    for rep in range(args.reps):
        c = time.process_time()
        t = time.perf_counter()
        st_vecs = st_encode(texts)
        st_s = time.perf_counter() - t
        st_cpu_rates.append(len(texts) / (time.process_time() - c))
        st_rates.append(len(texts) / st_s)

        put_s, set_s = send_weights(f"rep{rep}")  # not in the encode timing
        put_times.append(put_s)
        set_times.append(set_s)
        a0, c = pool_cpu(), time.process_time()
        t = time.perf_counter()
        pool_vecs = pool_encode(texts)
        pool_s = time.perf_counter() - t
        driver_cpu, a1 = time.process_time() - c, pool_cpu()
        pool_rates.append(len(texts) / pool_s)
        if a0 is not None and a1 is not None:
            per_actor = [y - x for x, y in zip(a0, a1)]
            actor_cpu.append(per_actor)
            pool_cpu_rates.append(len(texts) / (sum(per_actor) + driver_cpu))
        print(
            f"[rep {rep + 1}/{args.reps}] sentence-transformers {st_rates[-1]:7.1f} docs/s ({st_s:.1f}s) | "
            f"EncoderPool {pool_rates[-1]:7.1f} docs/s ({pool_s:.1f}s) | set_weights {set_s * 1e3:.0f} ms | load "
            f"avg {os.getloadavg()[0]:.1f}"
        )

    pool.shutdown()
    ray.shutdown()
    pool_module.make_shards = _make_shards
    shards = seen_shards[-1] if seen_shards else []
    shard_docs = [len(sh) for sh in shards]
    shard_tokens = [sum(tok_len[i] for i in sh) for sh in shards]

    a = np.asarray(st_vecs, dtype=np.float64)
    b = np.asarray(pool_vecs, dtype=np.float64)
    max_abs = float(np.abs(a - b).max())
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    min_cos = float(cos.min())

    st_med, pool_med = statistics.median(st_rates), statistics.median(pool_rates)
    ratio = pool_med / st_med
    pool_label = f"EncoderPool {args.actors}x{args.cpus_per_actor:g}CPU"
    st_label = f"SentenceTransformer 1 proc x {args.st_threads} thr"

    from tabulate import tabulate

    rows = [
        [st_label] + [f"{r:.1f}" for r in st_rates] + [f"{st_med:.1f}"],
        [pool_label] + [f"{r:.1f}" for r in pool_rates] + [f"{pool_med:.1f}"],
    ]
    headers = ["docs/s"] + [f"rep {i + 1}" for i in range(args.reps)] + ["median"]
    print()
    print(f"== encode throughput: {n_tokens_note}, max_length {args.max_length}, batch {args.batch_size}, fp32 ==")
    print(tabulate(rows, headers=headers))
    print(f"ratio pool/ST (medians): {ratio:.3f}  (goal >= 0.95: {'OK' if ratio >= 0.95 else 'BELOW'})")
    if shards:

        def show(v: list) -> str:
            return str(v) if len(v) <= 8 else f"{v[:4]} ... {v[-2:]}"

        print(
            f"shards used by EncoderPool.encode: {len(shards)} for {args.actors} actor(s); docs {show(shard_docs)}; "
            f"tokens after truncation {show(shard_tokens)}"
        )
    print(
        f"vectors: max |diff| = {max_abs:.2e}, min cosine = {min_cos:.6f}  "
        f"(goal >= 0.9999: {'OK' if min_cos >= 0.9999 else 'FAIL'})"
    )
    if pool_cpu_rates:
        st_cpu_med, pool_cpu_med = statistics.median(st_cpu_rates), statistics.median(pool_cpu_rates)
        print(
            f"CPU efficiency (docs per CPU-second; less sensitive to other load): ST {st_cpu_med:.2f}, "
            f"pool {pool_cpu_med:.2f} (actors + driver), ratio {pool_cpu_med / st_cpu_med:.3f}"
        )
        print(
            "actor CPU-seconds per rep (balance of the shards over the actors): "
            + "; ".join("/".join(f"{x:.1f}" for x in r) for r in actor_cpu)
        )
    print(
        f"weight transfer (excluded): ray.put median {statistics.median(put_times) * 1e3:.0f} ms, "
        f"set_weights median {statistics.median(set_times) * 1e3:.0f} ms"
    )

    result = {
        "benchmark": "pool_throughput",
        "data": data_name,
        "docs": len(texts),
        "max_length": args.max_length,
        "batch_size": args.batch_size,
        "shard_size": index_cfg.shard_size,
        "shards_per_actor": getattr(pool_module, "SHARDS_PER_ACTOR", None),
        "shards": {"count": len(shards), "docs": shard_docs, "tokens": shard_tokens},
        "precision": "fp32",
        "reps": args.reps,
        "pool": {
            "actors": args.actors,
            "cpus_per_actor": args.cpus_per_actor,
            "ray_num_cpus": args.ray_cpus,
            "docs_per_s": pool_rates,
            "median_docs_per_s": pool_med,
        },
        "sentence_transformers": {
            "torch_threads": args.st_threads,
            "docs_per_s": st_rates,
            "median_docs_per_s": st_med,
        },
        "ratio_pool_over_st": ratio,
        "cpu_efficiency_docs_per_cpu_s": {"st": st_cpu_rates, "pool": pool_cpu_rates, "pool_actor_cpu_s": actor_cpu},
        "vectors": {"max_abs_diff": max_abs, "min_cosine": min_cos},
        "nice": {"st_process": os.nice(0), "pool_actors": actor_nice},
        "weight_transfer_s": {"ray_put": put_times, "set_weights": set_times},
        "startup_s": {"ray_init": ray_start_s, "actors": actor_start_s},
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ray": ray.__version__,
        },
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
