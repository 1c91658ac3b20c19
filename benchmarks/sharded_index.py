"""The sharded vector store (`ragtrain/index/sharded.py`) on a simulated cluster: 1, 2 and 3 index shards compared.

Cluster: `ray.cluster_utils.Cluster` on this machine: a head raylet with 1 CPU and 3 raylets with 1 CPU each
offering the `index_node` resource (separate raylets on 127.0.0.1), so `ShardGroup` places one shard actor per node.
The driver runs on the head.

Data: `--rows` seeded float32 unit vectors of `--dim` dimensions around `--clusters` gaussian centres (each row:
a centre plus gaussian noise of expected norm `--noise`, re-normalised), written as a vector VectorSet folder with
`ragtrain.index.vector_ops.write_vectors`. Queries are other seeded vectors drawn around the same centres.

Measured, for N in (1, 2, 3) shards and each factory in `--factories` (a fresh `ShardGroup` per pair, closed
before the next):
- build seconds: `ShardGroup.build` wall clock (the shared quantiser's training for IVF, every shard's add and
  persist), timed once the actors have started (their start-up is reported on its own);
- peak RSS of each shard actor (`ShardGroup.info()[i]["peak_rss_mb"]`, after the searches) and each shard's
  `index.faiss` size;
- search throughput (queries/s) and p50 / p99 latency from the driver, for `--single` searches of 1 query and
  `--batches` searches of 64 queries (k=10; a few warm-up searches first, not timed);
- recall@10 of `--recall-queries` queries against ONE index of the same factory (the N=1 run is the reference),
  and against the exact numpy top-10 of the first `--exact-queries` of them (computed while the data is written).

Live refresh: `ragtrain.index.live_rows.LiveRows` over the rows of 3 shards, in this process (no actors: there
is no text encoder for generated vectors). One round with `refresh.fraction` 1.0 and one with 0.25: `encode_round`
with an `encode` callable that returns the stored vectors plus seeded noise (a stand-in for the encoder, so its
seconds are numpy's, not a model's), `apply` (stores and persists the state), and the shard's FAISS index rebuilt
from `searchable()` on a copy of the N=3 run's shard index, emptied (a trained IVF quantiser is kept, as the shard
actors' `live_build` does). FAISS runs on 1 thread there, as each shard actor does on its 1-CPU node.

Merge: the driver's `merge_topk` alone, in-process, on random sorted top-k lists of N in (3, 10, 100) shards and
k in (10, 100), for a batch of 64 queries: microseconds per query.

Run (the full size; `--rows 20000` takes well under a minute):

    python benchmarks/sharded_index.py [--rows 1000000] [--dim 64|384] [--factories Flat IVF1024,Flat]

Prints a header (date, CPU model and flags, cores, commit), one table with the N=1, 2, 3 columns side by side and
their ratios to N=1, the refresh table and the merge table; the figures also go to `--out`
(benchmarks/results/sharded_index.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# the raylets started below inherit this, and so do the shard actors: they import this checkout's ragtrain
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

import numpy as np

K = 10
SHARD_COUNTS = (1, 2, 3)
INDEX_NODES = 3
BATCH = 64
FILE_ROWS = 50_000  # rows per parquet file of the vector set
WARMUP = 5  # untimed searches before each timed series
REFRESH_SHARDS = 3
REFRESH_FRACTIONS = (1.0, 0.25)
MERGE_SHARDS = (3, 10, 100)  # shard counts of the driver-side merge timing
MERGE_K = (10, 100)
MERGE_SECONDS = 0.3  # each merge size is repeated for at least this long (and at least 3 times)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
TAG = "bench"


def log(t0: float, msg: str) -> None:
    """One progress line, with the seconds since the start."""
    print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------------- machine


def machine() -> dict[str, Any]:
    """Date, CPU model, the CPU flags that matter for FAISS, core count, load average and the git commit."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    model = model or platform.processor() or "unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    import faiss
    import ray

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": model,
        "flags": {f: f in flags for f in CPU_FLAGS},
        "cores": os.cpu_count() or 0,
        "load_average_1m": os.getloadavg()[0],
        "commit": commit,
        "faiss": faiss.__version__,
        "ray": ray.__version__,
    }


def header(m: dict[str, Any]) -> str:
    flags = " ".join(f"{f}={'yes' if v else 'no'}" for f, v in m["flags"].items())
    return (
        f"{m['date']} | {m['cpu']} ({flags}) | {m['cores']} cores | load {m['load_average_1m']:.1f} | "
        f"commit {m['commit']} | faiss {m['faiss']}, ray {m['ray']}"
    )


# -------------------------------------------------------------------------------------------------------- data


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def around(centres: np.ndarray, n: int, noise: float, rng: np.random.Generator) -> np.ndarray:
    """`n` unit vectors: a random centre each plus gaussian noise of expected norm `noise`, re-normalised."""
    dim = centres.shape[1]
    picked = centres[rng.integers(len(centres), size=n)]
    return unit(picked + rng.standard_normal((n, dim), dtype=np.float32) * np.float32(noise / np.sqrt(dim)))


def row_chunks(rows: int, centres: np.ndarray, noise: float, seed: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, vectors) per file of the vector set, each chunk from its own seeded generator."""
    for k, start in enumerate(range(0, rows, FILE_ROWS)):
        rng = np.random.default_rng([seed, 1, k])
        yield start, around(centres, min(FILE_ROWS, rows - start), noise, rng)


class ExactTopK:
    """The exact inner-product top-k of some queries, updated chunk by chunk (ties: lower row first)."""

    def __init__(self, queries: np.ndarray, k: int) -> None:
        self.q, self.k = queries, k
        self.scores = np.full((len(queries), 0), -np.inf, dtype=np.float32)
        self.rows = np.zeros((len(queries), 0), dtype=np.int64)

    def add(self, start: int, x: np.ndarray) -> None:
        s = self.q @ x.T
        kk = min(self.k, s.shape[1])
        part = np.argpartition(-s, kk - 1, axis=1)[:, :kk]
        scores = np.concatenate([self.scores, np.take_along_axis(s, part, 1)], axis=1)
        rows = np.concatenate([self.rows, part + start], axis=1)
        order = np.lexsort((rows, -scores))[:, : self.k]
        self.scores, self.rows = np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1)


def write_vectors(folder: Path, rows: int, centres: np.ndarray, noise: float, seed: int, exact: ExactTopK) -> Any:
    """The vector VectorSet of the generated rows (ids p000000000, ...); `exact` sees every chunk on the way."""
    from ragtrain.corpus.encode import write_vectors

    def chunks() -> Iterator[tuple[list[str], np.ndarray]]:
        for start, x in row_chunks(rows, centres, noise, seed):
            exact.add(start, x)
            yield [f"p{i:09d}" for i in range(start, start + len(x))], x

    return write_vectors(folder, chunks())


# ------------------------------------------------------------------------------------------------- measurement


def recall_at_k(got: np.ndarray, want: np.ndarray) -> float:
    """Mean share of each query's reference top-k found in its top-k (row ids; -1 padding ignored)."""
    hits = [
        len(set(g[g >= 0].tolist()) & set(w[w >= 0].tolist())) / max(1, int((w >= 0).sum())) for g, w in zip(got, want)
    ]
    return float(np.mean(hits))


def time_searches(search: Callable[[np.ndarray], Any], batches: Sequence[np.ndarray]) -> dict[str, float]:
    """Queries/s over the series and p50 / p99 of the per-call latency (ms)."""
    for b in batches[:WARMUP]:
        search(b)
    lat = []
    start = time.perf_counter()
    for b in batches:
        t = time.perf_counter()
        search(b)
        lat.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    ms = np.asarray(lat) * 1e3
    return {
        "calls": len(batches),
        "queries_per_s": sum(len(b) for b in batches) / wall,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
    }


def index_config(factory: str, nprobe: int) -> Any:
    from ragtrain.config import IndexConfig

    return IndexConfig(factory=factory, nprobe=nprobe, shard_timeout_s=600.0)


def measure_group(
    n: int,
    factory: str,
    shards: Any,
    root: Path,
    queries: np.ndarray,
    recall_queries: np.ndarray,
    args: argparse.Namespace,
    t0: float,
) -> tuple[dict[str, Any], np.ndarray, Any]:
    """Build, search and inspect `factory` on a fresh group of `n` shards; returns the figures, the recall
    queries' top-k rows and, for `REFRESH_SHARDS` shards, shard 0's index emptied (None otherwise)."""
    import ray

    from ragtrain.config import PoolResources
    from ragtrain.index.sharded import ShardGroup

    start = time.perf_counter()
    group = ShardGroup(n, root, PoolResources(num_actors=1), timeout_s=600)
    try:
        group.info()  # every actor has started (process, imports): outside the build's time
        ready_s = time.perf_counter() - start
        start = time.perf_counter()
        index = group.build(
            TAG, shards, index_config(factory, args.nprobe), "generated", "generated", 0, seed=args.seed
        )
        build_s = time.perf_counter() - start
        built = group.info()
        log(
            t0,
            f"N={n} {factory}: actors ready in {ready_s:.2f} s, built in {build_s:.2f} s "
            f"({index.meta.extra['rows_per_shard']} rows per shard)",
        )

        def search(q: np.ndarray) -> Any:
            return index.search(q, K)

        single = time_searches(search, [queries[i : i + 1] for i in range(args.single)])
        log(t0, f"N={n} {factory}: batch 1: {single['queries_per_s']:.1f} queries/s, p50 {single['p50_ms']:.2f} ms")
        batched = time_searches(search, [queries[i * BATCH : (i + 1) * BATCH] for i in range(args.batches)])
        log(
            t0,
            f"N={n} {factory}: batch {BATCH}: {batched['queries_per_s']:.1f} queries/s, p50 {batched['p50_ms']:.2f} ms",
        )
        _, rows = index.search(recall_queries, K)
        info = group.info()
        head = ray.get_runtime_context().get_node_id()
        nodes = [i["node"] for i in info]
        files = [(root / TAG / f"shard-{i}" / "index.faiss").stat().st_size / 2**20 for i in range(n)]
        figures = {
            "shards": n,
            "factory": factory,
            "rows_per_shard": index.meta.extra["rows_per_shard"],
            "actors_ready_s": ready_s,
            "build_s": build_s,
            "peak_rss_mb_after_build": [i["peak_rss_mb"] for i in built],
            "peak_rss_mb": [i["peak_rss_mb"] for i in info],
            "index_file_mb": files,
            "distinct_nodes": len(set(nodes)),
            "on_head_node": sum(x == head for x in nodes),
            "batch_1": single,
            f"batch_{BATCH}": batched,
        }
        log(
            t0,
            f"N={n} {factory}: peak RSS per shard {[round(x) for x in figures['peak_rss_mb']]} MB on "
            f"{figures['distinct_nodes']} nodes",
        )
        empty = None
        if n == REFRESH_SHARDS:  # the refresh rebuilds on a copy of a shard's index, emptied (trained quantiser kept)
            import faiss

            empty = faiss.read_index(str(root / TAG / "shard-0" / "index.faiss"))
            empty.reset()
        return figures, rows, empty
    finally:
        group.close()
        shutil.rmtree(root, ignore_errors=True)


def refresh_shard(
    vecs: np.ndarray, folder: Path, template: Any, fraction: float, rng: np.random.Generator, drift: float, seed: int
) -> dict[str, float]:
    """One shard's round: `encode_round` with the stand-in encoder, `apply`, and the index rebuilt from
    `searchable()` on a copy of `template` (an empty index of the factory; a trained one keeps its quantiser)."""
    import faiss

    from ragtrain.index.live_rows import LiveRows

    shutil.rmtree(folder, ignore_errors=True)
    live = LiveRows(folder, vecs, lambda local: local)  # the "texts" are the local rows themselves
    scale = np.float32(drift / np.sqrt(vecs.shape[1]))

    def encode(local: np.ndarray) -> np.ndarray:
        """The stand-in encoder: the stored vectors plus seeded noise of expected norm `drift`."""
        x = live.vectors[np.asarray(local)]
        return unit(x + rng.standard_normal(x.shape, dtype=np.float32) * scale)

    stats = live.encode_round(1, encode, fraction, "oldest", None, seed)
    t = time.perf_counter()
    live.apply(1)
    apply_s = time.perf_counter() - t
    t = time.perf_counter()
    index = faiss.clone_index(template)
    index.reset()
    index.add(live.searchable())
    rebuild_s = time.perf_counter() - t
    return {
        "rows": live.rows,
        "encoded": stats["encoded"],
        "encode_s": stats["seconds"],
        "apply_s": apply_s,
        "rebuild_s": rebuild_s,
        "drift_cosine": stats["drift_cosine"],
    }


def refresh_rounds(
    shards: Any, factory: str, template: Any, work: Path, args: argparse.Namespace, t0: float
) -> list[dict]:
    """One live refresh round per fraction over `REFRESH_SHARDS` shards' rows, in this process (see the module);
    every shard's index is rebuilt on a copy of `template` (a shard's index of `factory`, emptied)."""
    import faiss

    from ragtrain.index.sharded import shard_ranges
    from ragtrain.index.vector_files import iter_rows

    faiss.omp_set_num_threads(1)  # as a shard actor on its 1-CPU node
    out = []
    for fraction in REFRESH_FRACTIONS:
        per_shard = []
        for i, (a, b) in enumerate(shard_ranges(shards.rows, REFRESH_SHARDS)):
            vecs = np.concatenate([v for _, v in iter_rows(shards, a, b)]).astype(np.float32)
            rng = np.random.default_rng([args.seed, 2, i])
            folder = work / f"live-{fraction:g}" / f"shard-{i}"
            per_shard.append(refresh_shard(vecs, folder, template, fraction, rng, args.drift, args.seed))
        keys = ("rows", "encoded", "encode_s", "apply_s", "rebuild_s")
        total = {k: sum(s[k] for s in per_shard) for k in keys}
        out.append(
            {
                "factory": factory,
                "fraction": fraction,
                **total,
                "total_s": total["encode_s"] + total["apply_s"] + total["rebuild_s"],
                "slowest_shard_s": max(s["encode_s"] + s["apply_s"] + s["rebuild_s"] for s in per_shard),
                "shards": per_shard,
            }
        )
        log(
            t0,
            f"refresh {factory} fraction {fraction:g}: {total['encoded']:,} of {total['rows']:,} rows re-encoded, "
            f"{out[-1]['total_s']:.2f} s over {REFRESH_SHARDS} shards",
        )
    faiss.omp_set_num_threads(os.cpu_count() or 1)
    return out


def merge_cost(seed: int) -> list[dict[str, float]]:
    """The driver's merge alone (`merge_topk`, in-process): microseconds per query to merge N shards' top-k lists
    of a batch of `BATCH` queries, for N in `MERGE_SHARDS` and k in `MERGE_K` (random scores, each list sorted)."""
    from ragtrain.index.sharded import merge_topk

    rng = np.random.default_rng([seed, 4])
    out = []
    for n in MERGE_SHARDS:
        for k in MERGE_K:
            parts = [
                (-np.sort(-rng.random((BATCH, k), dtype=np.float32), axis=1), rng.integers(0, 10**6, (BATCH, k)))
                for _ in range(n)
            ]
            offsets = [i * 10**6 for i in range(n)]
            merge_topk(parts, offsets, k)  # warm-up
            reps, start = 0, time.perf_counter()
            while reps < 3 or time.perf_counter() - start < MERGE_SECONDS:
                merge_topk(parts, offsets, k)
                reps += 1
            per_query = (time.perf_counter() - start) / reps / BATCH
            out.append({"shards": n, "k": k, "candidates": n * k, "reps": reps, "us_per_query": per_query * 1e6})
    return out


# ------------------------------------------------------------------------------------------------------- report


def fmt(v: float) -> str:
    if v != v:  # nan
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def side_by_side(results: dict[str, dict[int, dict[str, Any]]]) -> str:
    """One row per (factory, figure), a column per shard count, then each count's ratio to N=1."""
    from tabulate import tabulate

    figures: list[tuple[str, Callable[[dict], float], bool]] = [
        ("actors ready s (not in build)", lambda r: r["actors_ready_s"], True),
        ("build s", lambda r: r["build_s"], True),
        ("peak RSS MB, largest shard", lambda r: max(r["peak_rss_mb"]), True),
        ("peak RSS MB, all shards", lambda r: sum(r["peak_rss_mb"]), True),
        ("peak RSS MB after build, largest shard", lambda r: max(r["peak_rss_mb_after_build"]), True),
        ("index file MB, largest shard", lambda r: max(r["index_file_mb"]), True),
        ("batch 1: queries/s", lambda r: r["batch_1"]["queries_per_s"], True),
        ("batch 1: p50 ms", lambda r: r["batch_1"]["p50_ms"], True),
        ("batch 1: p99 ms", lambda r: r["batch_1"]["p99_ms"], True),
        (f"batch {BATCH}: queries/s", lambda r: r[f"batch_{BATCH}"]["queries_per_s"], True),
        (f"batch {BATCH}: p50 ms", lambda r: r[f"batch_{BATCH}"]["p50_ms"], True),
        (f"batch {BATCH}: p99 ms", lambda r: r[f"batch_{BATCH}"]["p99_ms"], True),
        ("recall@10 vs one index", lambda r: r["recall_vs_one_index"], False),
        ("recall@10 vs exact", lambda r: r["recall_vs_exact"], False),
        ("shard nodes (distinct)", lambda r: float(r["distinct_nodes"]), False),
    ]
    counts = [n for n in SHARD_COUNTS if any(n in per for per in results.values())]
    table = []
    for factory, per in results.items():
        for name, get, ratio in figures:
            vals = [get(per[n]) if n in per else float("nan") for n in counts]
            row = [factory, name, *[f"{v:.4f}" if "recall" in name else fmt(v) for v in vals]]
            base = vals[0]
            row += [fmt(v / base) if ratio and base else "" for v in vals[1:]]
            table.append(row)
    heads = ["factory", "figure", *[f"N={n}" for n in counts], *[f"N={n} / N=1" for n in counts[1:]]]
    return tabulate(table, headers=heads, stralign="right", disable_numparse=True)


def merge_table(rows: list[dict[str, float]]) -> str:
    from tabulate import tabulate

    return tabulate(
        [[r["shards"], r["k"], f"{r['candidates']:,}", fmt(r["us_per_query"])] for r in rows],
        headers=["shards N", "k", "candidates per query (N x k)", "merge us per query"],
        stralign="right",
        disable_numparse=True,
    )


def refresh_table(rounds: list[dict]) -> str:
    from tabulate import tabulate

    rows = []
    for r in rounds:
        full = next(x for x in rounds if x["factory"] == r["factory"] and x["fraction"] == 1.0)
        rows.append(
            [
                r["factory"],
                f"{r['fraction']:g}",
                f"{r['encoded']:,} / {r['rows']:,}",
                fmt(r["encode_s"]),
                fmt(r["apply_s"]),
                fmt(r["rebuild_s"]),
                fmt(r["total_s"]),
                fmt(r["slowest_shard_s"]),
                fmt(r["total_s"] / full["total_s"]),
            ]
        )
    heads = [
        "factory",
        "fraction",
        "rows encoded",
        "encode s (stand-in)",
        "apply s",
        "rebuild s",
        f"total s ({REFRESH_SHARDS} shards in turn)",
        "slowest shard s",
        "total / fraction 1",
    ]
    return tabulate(rows, headers=heads, stralign="right", disable_numparse=True)


# --------------------------------------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="vectors in the store")
    p.add_argument("--dim", type=int, default=64, help="vector dimension (e.g. 64, or 384 as MiniLM's)")
    p.add_argument("--factories", nargs="+", default=["Flat", "IVF1024,Flat"], help="faiss index_factory strings")
    p.add_argument("--nprobe", type=int, default=16, help="IVF lists searched per query")
    p.add_argument("--clusters", type=int, default=1000, help="gaussian centres the vectors are drawn around")
    p.add_argument("--noise", type=float, default=1.0, help="expected norm of a vector's noise around its centre")
    p.add_argument("--drift", type=float, default=0.2, help="expected norm of the stand-in encoder's change")
    p.add_argument("--single", type=int, default=200, help="timed searches of 1 query")
    p.add_argument("--batches", type=int, default=20, help=f"timed searches of {BATCH} queries")
    p.add_argument("--recall-queries", type=int, default=1000, help="queries for recall@10 against one index")
    p.add_argument("--exact-queries", type=int, default=200, help="of those, queries checked against numpy's top-10")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "sharded_index.json")
    args = p.parse_args()
    if args.rows < max(SHARD_COUNTS):
        p.error(f"--rows must be at least {max(SHARD_COUNTS)}")
    args.exact_queries = min(args.exact_queries, args.recall_queries)

    import ray
    from ray.cluster_utils import Cluster

    t0 = time.perf_counter()
    info = machine()
    print(header(info), flush=True)
    print(
        f"rows {args.rows:,} x dim {args.dim}, {args.clusters} clusters, noise {args.noise:g}; factories "
        f"{', '.join(args.factories)} (IVF nprobe {args.nprobe}); k={K}; cluster: head raylet 1 CPU + "
        f"{INDEX_NODES} index-node raylets of 1 CPU each on this machine",
        flush=True,
    )
    rng = np.random.default_rng([args.seed, 0])
    centres = unit(rng.standard_normal((args.clusters, args.dim), dtype=np.float32))
    pool = max(args.single, args.batches * BATCH, args.recall_queries)
    queries = around(centres, pool, args.noise, np.random.default_rng([args.seed, 3]))
    recall_queries = queries[: args.recall_queries]
    exact = ExactTopK(recall_queries[: args.exact_queries], K)

    scratch = tempfile.TemporaryDirectory(prefix="sharded_index-", dir=args.workdir)
    work = Path(scratch.name)
    cluster = None
    try:
        start = time.perf_counter()
        shards = write_vectors(work / "vectors", args.rows, centres, args.noise, args.seed, exact)
        log(t0, f"wrote {shards.rows:,} vectors in {len(shards.files)} files in {time.perf_counter() - start:.1f} s")

        start = time.perf_counter()
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        for _ in range(INDEX_NODES):
            cluster.add_node(num_cpus=1, resources={"index_node": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        log(t0, f"cluster of {len(ray.nodes())} raylets up in {time.perf_counter() - start:.1f} s")

        results: dict[str, dict[int, dict[str, Any]]] = {}
        templates: dict[str, Any] = {}
        for factory in args.factories:
            results[factory] = {}
            reference = None
            for n in SHARD_COUNTS:
                root = work / f"n{n}-{factory.replace(',', '_')}"
                figures, rows, empty = measure_group(n, factory, shards, root, queries, recall_queries, args, t0)
                templates[factory] = empty if empty is not None else templates.get(factory)
                reference = rows if reference is None else reference
                figures["recall_vs_one_index"] = recall_at_k(rows, reference)
                figures["recall_vs_exact"] = recall_at_k(rows[: args.exact_queries], exact.rows)
                log(
                    t0,
                    f"N={n} {factory}: recall@{K} {figures['recall_vs_one_index']:.4f} vs one index, "
                    f"{figures['recall_vs_exact']:.4f} vs exact ({args.exact_queries} queries)",
                )
                results[factory][n] = figures
        ray.shutdown()
        cluster.shutdown()
        cluster = None

        rounds = [r for f in args.factories for r in refresh_rounds(shards, f, templates[f], work, args, t0)]
        merges = merge_cost(args.seed)
        log(t0, f"merge timed for N in {MERGE_SHARDS} and k in {MERGE_K}")
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        scratch.cleanup()

    elapsed = time.perf_counter() - t0
    print()
    print(header(info))
    print(
        f"Sharded index: {args.rows:,} vectors x {args.dim} dims, k={K}; each shard actor on its own 1-CPU raylet "
        f"(one machine); recall against N=1 ({args.recall_queries} queries) and exact numpy top-{K} "
        f"({args.exact_queries} queries)"
    )
    print(side_by_side(results))
    print()
    print(
        f"Live refresh round over {REFRESH_SHARDS} shards' rows, measured in-process (LiveRows, FAISS on 1 thread); "
        "the encoder is a numpy stand-in (stored vector + noise), so 'encode s' is not a model's time"
    )
    print(refresh_table(rounds))
    print()
    print(
        f"Driver-side merge alone (merge_topk in-process, batches of {BATCH} queries, >= {MERGE_SECONDS:g} s each): "
        "what the scatter-gather adds on top of the shards' searches and the calls to them"
    )
    print(merge_table(merges))
    load_end = os.getloadavg()[0]
    print(
        f"\nwhole run: {elapsed:.1f} s; 1-minute load average {info['load_average_1m']:.1f} at the start, "
        f"{load_end:.1f} at the end"
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "machine": info,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "k": K,
        "batch": BATCH,
        "index_nodes": INDEX_NODES,
        "search": {f: {str(n): r for n, r in per.items()} for f, per in results.items()},
        "refresh": {"in_process": True, "shards": REFRESH_SHARDS, "rounds": rounds},
        "merge": merges,
        "seconds": elapsed,
        "load_average_1m_end": load_end,
    }
    args.out.write_text(json.dumps(record, indent=2))
    print(f"figures: {args.out}")


if __name__ == "__main__":
    main()
