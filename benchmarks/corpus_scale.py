"""Corpus scale: files -> read + clean -> chunk -> store -> encode -> shards -> FAISS on local Ray, with RSS.

Scale mode (one N per process, so the driver's peak RSS is this N's; `--prepare stream` runs the same corpus as
one Ray Data stream, read -> clean -> chunk -> encode -> the driver's store and shard writers, as a run does for its
zero-shot index: `ragtrain.corpus.stream`; prepare_s is then 0 and encode_s the stream's wall time):
    python benchmarks/corpus_scale.py --passages 20000 [--retriever tiny] [--actors 2 --cpus-per-actor 1]
  N short documents (12-30 words, one chunk each) are generated deterministically into jsonl files of 1,000 (a
  data=documents folder; not timed as pipeline work), then run through the pipeline's own data path as
  data.prepare=ray runs it: Ray Data tasks read + clean the files and chunk the documents
  (`ragtrain.corpus.prepare`), streamed back to the driver, which deduplicates and writes the passage stores;
  `ragtrain.corpus.encode.encode_to_vectors` (the pipeline's EncodeBatch actors) encodes the store into parquet
  shards, and `ragtrain.index.vector_files.build_from_vectors` indexes them in a Ray task (saved through a temporary
  folder). The driver never holds all texts or any vector. Recorded: passages, prepare_s (read..store), encode_s,
  docs_per_s (passages / (prepare_s + encode_s)), per_core_encode_docs_per_s, driver_peak_rss_mb (this process's
  VmHWM), driver_rss_after_init_mb (before any data), worker_peak_rss_mb (max of the encode actors' and the index
  task's VmHWM; the actors' by kind: anon / file / shmem), index_build_s, wall_s. Appended to
  benchmarks/results/corpus_scale.json (one entry per N, retriever and --actor-env).

Throughput mode (same texts, same cores, same precision, side by side in one run):
    python benchmarks/corpus_scale.py --compare-docs 2000 [--reps 2]
  MiniLM, fp32: A = sentence-transformers in this process (torch threads = actors x cpus per actor); B = Ray Data
  encode_to_vectors; then B again with bf16. Ray Data's wall time includes its actor start-up and model load (every
  corpus encode pays it); its steady rate (rows / the slowest actor's encode seconds) is printed next to it.
  Written to benchmarks/results/corpus_scale_throughput.json. (Figures of earlier runs also hold a side C, the
  live refresh's former EncoderPool, since replaced by the index shards.)

    python benchmarks/corpus_scale.py --plot   # benchmarks/corpus_scale.png from corpus_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
RESULTS = HERE / "results"
WORDS = (
    "alpha beta gamma delta river mountain archive protein lattice quantum harbor violet ledger orbit cascade "
    "meadow tungsten carbon signal museum author painter village bridge season winter summer garden station "
    "library history market engine"
).split()


def make_docs(batch: dict) -> dict:
    """Deterministic documents from row ids (or {start, n} ranges of them): {id, title, text, source}, 12-30 words."""
    ids, titles, texts = [], [], []
    rows = (
        batch["id"].tolist()
        if "id" in batch
        else [i for s, k in zip(batch["start"].tolist(), batch["n"].tolist()) for i in range(s, s + k)]
    )
    for i in rows:
        n = 12 + (i * 7919) % 19
        words = [WORDS[(i * 2654435761 + k * 40503) % len(WORDS)] for k in range(n)]
        ids.append(f"d{i:08d}")
        titles.append(f"Entity {i}")
        texts.append(f"Passage {i}. " + " ".join(words) + ".")
    return {"id": ids, "title": titles, "text": texts, "source": ["generated"] * len(ids)}


class RssSampler:
    """This process's RSS by kind (anon / file / shmem), sampled every 50 ms on a thread: the first sample and the
    peak of each kind (VmHWM is only their sum)."""

    def __init__(self, every_s: float = 0.05):
        import threading

        from ragtrain.runtime.rss import rss_breakdown_mb

        self.first = rss_breakdown_mb()
        self.peak = dict(self.first)
        self._halt = threading.Event()

        def run() -> None:
            while not self._halt.wait(every_s):
                for k, v in rss_breakdown_mb().items():
                    self.peak[k] = max(v, self.peak.get(k, 0.0))

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        self._halt.set()
        self._thread.join()
        return {"start": self.first, "peak": self.peak}


def write_corpus_folder(root: Path, n: int, per_file: int = 1000) -> None:
    """N generated documents as a data=documents folder: jsonl files of `per_file` documents (0: one file of all N;
    written 1,000 documents at a time), plus the queries.jsonl and qrels a documents folder needs (ten queries,
    judged on the first documents)."""
    import numpy as np

    (root / "qrels").mkdir(parents=True)
    per_file = per_file or n
    for s in range(0, n, 1000):
        docs = make_docs({"id": np.arange(s, min(n, s + 1000))})
        with open(root / f"part-{s // per_file:05d}.jsonl", "a", encoding="utf-8") as f:
            for i, t, x in zip(docs["id"], docs["title"], docs["text"]):
                f.write(json.dumps({"_id": i, "title": t, "text": x}) + "\n")
    (root / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": f"q{i}", "text": f"entity {i}"}) + "\n" for i in range(10))
    )
    (root / "qrels" / "train.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i:08d}\t1\n" for i in range(10))
    )


def texts_list(n: int) -> tuple[list[str], list[str]]:
    import numpy as np

    docs = make_docs({"id": np.arange(n)})
    return docs["id"], [f"{t} {x}" for t, x in zip(docs["title"], docs["text"])]


def start_ray(num_cpus: int, niceness0: bool) -> None:
    import ray

    if niceness0:
        os.environ["RAY_worker_niceness"] = "0"
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_WAIT_POLICY": "PASSIVE",
        "PYTHONPATH": str(REPO),
    }
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": env})
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False


def initial_weights(cfg):
    import torch

    from ragtrain.embed.model import build_encoder

    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in build_encoder(cfg).state_dict().items()}


def actor_stats(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def scale(args) -> None:
    import ray

    from ragtrain.config.index import IndexConfig
    from ragtrain.config.resources import PoolResources
    from ragtrain.config.retriever import RetrieverConfig
    from ragtrain.corpus import encode as encode_mod
    from ragtrain.corpus.dataset import chunk_data, load_documents
    from ragtrain.corpus.encode import VectorSet, encode_to_vectors
    from ragtrain.embed.model import load_tokenizer
    from ragtrain.index.vector_files import build_from_vectors, save_atomic
    from ragtrain.runtime.rss import peak_rss_mb

    actor_env = dict(kv.split("=", 1) for kv in args.actor_env)
    encode_mod.ACTOR_ENV.update(actor_env)  # encode_to_vectors reads it when it starts the actor pool
    work = Path(tempfile.mkdtemp(prefix="corpus_scale-", dir=args.workdir))
    t0 = time.perf_counter()
    write_corpus_folder(work / "docs", args.passages, args.per_file)  # the user's files: not the pipeline's time
    write_s = time.perf_counter() - t0
    wall0 = time.perf_counter()
    start_ray(args.num_cpus, args.ray_worker_niceness0)
    cfg = RetrieverConfig(model=args.retriever, passage_max_length=64)
    if args.tiny_dim:  # a cheap encoder with MiniLM's vector size: what the driver relays in stream mode
        cfg.tiny.hidden_size = args.tiny_dim
    pool = PoolResources(num_actors=args.actors, cpus_per_actor=args.cpus_per_actor)
    index = IndexConfig(factory=args.factory, batch_size=64, shard_size=512, precision=args.precision)
    weights_ref = ray.put(initial_weights(cfg))  # the driver keeps only the ObjectRef
    rss_init = peak_rss_mb()
    sampler = RssSampler()  # the driver's RSS by kind: its own heap (anon) vs object-store pages it maps (shmem)
    stats_dir = work / "actor_stats"
    stats_dir.mkdir()
    load0 = os.getloadavg()[0]
    # The pipeline's own data path (corpus.load.load_data with data.prepare=ray): Ray Data tasks read + clean the
    # files and chunk the documents; the driver deduplicates and writes the stores
    t0 = time.perf_counter()
    if args.prepare == "stream":  # one Ray Data stream: read -> clean -> chunk -> encode -> the driver's writers
        from ragtrain.config.data import ChunkConfig, DataConfig
        from ragtrain.corpus.read import list_documents
        from ragtrain.corpus.stream import StreamEncode, stream_documents

        dcfg = DataConfig(
            source="documents",
            root=str(work / "docs"),
            dev_size=2,
            chunk=ChunkConfig(enabled=True, max_tokens=64, overlap=8),
        )
        enc = StreamEncode(
            weights=lambda: ray.get(weights_ref),
            index=index,
            pool=pool,
            folder=work / "vectors",
            stats_dir=str(stats_dir),
        )
        data = stream_documents(
            list_documents(work / "docs"),
            work / "docs",
            dcfg,
            cfg,
            enc,
            work / "corpus" / "passages.arrow",
            log=lambda m: None,
        )
        prepare_s = 0.0  # fused with the encode: the stream's wall time is encode_s
        shards = VectorSet.load(work / "vectors")
    else:
        data, _ = load_documents(
            work / "docs",
            split="dev",
            dev_size=2,
            log=lambda m: None,
            store_path=work / "corpus" / "documents.arrow",
            on_ray=args.prepare == "ray",
        )
        data = chunk_data(
            data,
            load_tokenizer(cfg),
            64,
            8,
            store_path=work / "corpus" / "passages.arrow",
            ray_tasks=args.actors if args.prepare == "ray" else 0,
            retriever=cfg,
        )
        prepare_s = time.perf_counter() - t0
        shards = encode_to_vectors(
            data.corpus, weights_ref, cfg, index, pool, work / "vectors", max_length=64, stats_dir=str(stats_dir)
        )
    actors = actor_stats(stats_dir)
    t0 = time.perf_counter()

    @ray.remote(num_cpus=1)
    def build_and_save() -> dict:  # in a Ray task: the driver gets metadata only
        import faiss  # lazy: the task's own import (the driver never builds the index)

        faiss.omp_set_num_threads(1)
        index = build_from_vectors(shards.folder, args.factory, "generated", f"{args.retriever}@init")
        save_atomic(index, work / "index")
        return {**asdict(index.meta), "peak_rss_mb": peak_rss_mb()}

    meta = ray.get(build_and_save.remote())
    index_s = time.perf_counter() - t0
    cores = args.actors * args.cpus_per_actor
    row = {
        "passages": shards.rows,
        "retriever": args.retriever,
        "actor_env": actor_env,
        "dim": shards.dim,
        "per_file": args.per_file,
        "prepare": args.prepare,
        "precision": args.precision,
        "factory": args.factory,
        "actors": args.actors,
        "cpus_per_actor": args.cpus_per_actor,
        "ray_num_cpus": args.num_cpus,
        "write_files_s": write_s,
        "prepare_s": prepare_s,
        "prepare_docs_per_s": shards.rows / prepare_s if prepare_s else None,
        "encode_s": shards.seconds,
        "docs_per_s": shards.rows / (prepare_s + shards.seconds),
        "encode_docs_per_s": shards.docs_per_s,
        "per_core_encode_docs_per_s": shards.docs_per_s / cores,
        "actor_steady_docs_per_s": shards.rows / max(max(a["seconds"] for a in actors), 1e-9),
        "driver_rss_after_init_mb": rss_init,
        "driver_peak_rss_mb": peak_rss_mb(),
        "driver_rss_by_kind_mb": sampler.stop(),
        "encode_actor_peak_rss_mb": max(a["peak_rss_mb"] for a in actors),
        "index_worker_peak_rss_mb": meta["peak_rss_mb"],
        "worker_peak_rss_mb": max(max(a["peak_rss_mb"] for a in actors), meta["peak_rss_mb"]),
        "encode_actor_rows": [a["rows"] for a in actors],
        "encode_actor_seconds": [a["seconds"] for a in actors],
        # where an actor's RSS is: anon (its own heap), file (libraries), shmem (object-store pages it touched)
        "encode_actor_rss_peaks_mb": {
            k: max(a.get("rss_peaks_mb", {}).get(k, 0.0) for a in actors) for k in ("anon", "file", "shmem")
        },
        "encode_actor_anon_series": max(actors, key=lambda a: a["rows"]).get("anon_series", []),
        "index_build_s": index_s,
        "index_ntotal": meta["ntotal"],
        "shard_files": len(shards.files),
        # stream mode: seconds the driver spent deciding on rows and appending them (its serial part, not waiting)
        "driver_rows_s": shards.stats.get("driver_rows_s"),
        "wall_s": time.perf_counter() - wall0,
        "load_avg_start": load0,
        "load_avg_end": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    assert meta["ntotal"] == shards.rows, "the index must hold every passage"
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "corpus_scale.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    # one entry per N, retriever, environment, precision and input layout
    key = ("passages", "retriever", "dim", "actor_env", "precision", "per_file", "prepare")
    old = {"actor_env": {}, "precision": "fp32", "per_file": 1000, "prepare": "ray"}  # rows written before the key
    rows = [r for r in rows if tuple(r.get(k, old.get(k)) for k in key) != tuple(row[k] for k in key)] + [row]
    path.write_text(
        json.dumps(sorted(rows, key=lambda r: (r["retriever"], str(r.get("actor_env", {})), r["passages"])), indent=2)
    )
    print(json.dumps(row, indent=2))


def compare(args) -> None:
    import numpy as np
    import ray
    import torch

    from ragtrain.config.index import IndexConfig
    from ragtrain.config.resources import PoolResources
    from ragtrain.config.retriever import Precision, RetrieverConfig
    from ragtrain.corpus.encode import encode_to_vectors
    from ragtrain.embed.model import minilm_path

    cores = int(args.actors * args.cpus_per_actor)
    start_ray(max(args.num_cpus, cores + 1), args.ray_worker_niceness0)
    cfg = RetrieverConfig(model="minilm", passage_max_length=args.max_length)
    pool_res = PoolResources(num_actors=args.actors, cpus_per_actor=args.cpus_per_actor)
    ids, texts = texts_list(args.compare_docs)
    weights = initial_weights(cfg)
    ref = ray.put(weights)
    work = Path(tempfile.mkdtemp(prefix="corpus_tp-", dir=args.workdir))

    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(cores)
    st = SentenceTransformer(minilm_path(), device="cpu")
    st.max_seq_length = args.max_length
    st.encode(texts[:64], batch_size=64)  # warm-up
    sides = set(args.sides.split(","))
    fp32 = IndexConfig(batch_size=64, shard_size=256, precision=Precision.fp32)
    bf16 = IndexConfig(batch_size=64, shard_size=256, precision=Precision.bf16)

    def ray_data(index: IndexConfig, tag: str, docs=None):
        i, t = (ids, texts) if docs is None else (ids[:docs], texts[:docs])
        sd = work / f"stats_{tag}"
        sd.mkdir(exist_ok=True)
        for p in sd.glob("*.json"):
            p.unlink()
        s = encode_to_vectors(
            (i, t), ref, cfg, index, pool_res, work / tag, max_length=args.max_length, stats_dir=str(sd)
        )
        steady = s.rows / max(max(a["seconds"] for a in actor_stats(sd)), 1e-9)
        return s, steady

    out: dict = {
        "docs": len(texts),
        "cores": cores,
        "max_length": args.max_length,
        "load_avg_start": os.getloadavg()[0],
        "reps": [],
    }
    for rep in range(args.reps):  # alternate the sides
        r: dict = {}
        t = time.perf_counter()
        a = st.encode(texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
        r["st_fp32_docs_per_s"] = len(texts) / (time.perf_counter() - t)
        s, steady = ray_data(fp32, "fp32")
        r["raydata_fp32_docs_per_s"], r["raydata_fp32_steady_docs_per_s"] = s.docs_per_s, steady
        b = s.read_all(order=ids)[1]
        if "bf16" in sides:
            s, steady = ray_data(bf16, "bf16")
            r["raydata_bf16_docs_per_s"], r["raydata_bf16_steady_docs_per_s"] = s.docs_per_s, steady
        cos = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        r["min_cosine_st_vs_raydata"] = float(cos.min())
        print(f"rep {rep}: " + ", ".join(f"{k} {v:.4g}" for k, v in r.items()), flush=True)
        out["reps"].append(r)
    med = {k: statistics.median(r[k] for r in out["reps"]) for k in out["reps"][0]}
    out["median"] = med
    out["ratio_raydata_vs_st"] = med["raydata_fp32_docs_per_s"] / med["st_fp32_docs_per_s"]
    out["ratio_raydata_steady_vs_st"] = med["raydata_fp32_steady_docs_per_s"] / med["st_fp32_docs_per_s"]
    if "bf16" in sides:
        out["ratio_bf16_vs_fp32_raydata"] = med["raydata_bf16_docs_per_s"] / med["raydata_fp32_docs_per_s"]
        out["ratio_bf16_vs_fp32_raydata_steady"] = (
            med["raydata_bf16_steady_docs_per_s"] / med["raydata_fp32_steady_docs_per_s"]
        )
    out["sides"] = sorted(sides)
    out["load_avg_end"] = os.getloadavg()[0]
    out["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in out.items() if k != "reps"}, indent=2))


def plot(args) -> None:
    """RSS and docs/s vs N, one line per input path (two steps: prepare=ray; one stream: prepare=stream)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dim = args.tiny_dim or (64 if args.retriever == "tiny" else 384)
    rows = [
        r
        for r in json.loads((RESULTS / "corpus_scale.json").read_text())
        if r["retriever"] == args.retriever
        and r["dim"] == dim
        and not r.get("actor_env")
        and r.get("precision", "fp32") == args.precision  # the default environment and layout only
        and r.get("per_file", 1000) == 1000
        and r.get("prepare", "ray") in ("ray", "stream")
    ]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, label in (("ray", "two steps"), ("stream", "one stream")):
        sel = sorted((r for r in rows if r.get("prepare", "ray") == mode), key=lambda r: r["passages"])
        if not sel:
            continue
        n = [r["passages"] for r in sel]
        a.plot(n, [r["driver_peak_rss_mb"] for r in sel], "o-", label=f"driver peak RSS ({label})")
        a.plot(n, [r["worker_peak_rss_mb"] for r in sel], "s--", label=f"worker peak RSS, max ({label})")
        b.plot(n, [r["docs_per_s"] for r in sel], "o-", label=f"end-to-end docs/s ({label})")
    a.set_xlabel("passages")
    a.set_ylabel("MB")
    a.legend(fontsize=8)
    a.set_title("peak RSS vs corpus size")
    b.set_xlabel("passages")
    b.set_ylabel("docs/s")
    b.set_title(
        f"throughput ({args.retriever}, {dim}-dim, {rows[0]['actors']}x{rows[0]['cpus_per_actor']:g} CPU actors)"
    )
    b.legend(fontsize=8)
    fig.tight_layout()
    out = HERE / (args.plot_name or "corpus_scale.png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passages", type=int, default=0)
    p.add_argument("--retriever", default="tiny", choices=["tiny", "minilm"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="scale mode: index.precision")
    p.add_argument("--factory", default="Flat")
    p.add_argument("--tiny-dim", type=int, default=0, help="scale mode: the tiny encoder's hidden size (e.g. 384)")
    p.add_argument("--per-file", type=int, default=1000, help="scale mode: documents per jsonl file (0: one file)")
    p.add_argument(
        "--prepare",
        default="ray",
        choices=["ray", "driver", "stream"],
        help="scale mode: read, clean and chunk on Ray Data tasks into the store, then encode it (ray); "
        "the same in the driver (driver); or read, clean, chunk and encode as one Ray Data stream "
        "(stream: what a run does when its first index is zero-shot)",
    )
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--cpus-per-actor", type=float, default=1.0)
    p.add_argument("--num-cpus", type=int, default=2, help="logical CPUs of the benchmark's private local Ray")
    p.add_argument("--compare-docs", type=int, default=0)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument(
        "--sides",
        default="st,raydata,bf16",
        help="compare mode: comma list; sentence-transformers (st) and Ray Data fp32 always run, "
        "'bf16' adds Ray Data in bf16",
    )
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep", action="store_true", help="keep the shards and the index")
    p.add_argument("--ray-worker-niceness0", action="store_true")
    p.add_argument("--plot", action="store_true")
    p.add_argument("--plot-name", default="", help="plot mode: the PNG's name under benchmarks/ (corpus_scale.png)")
    p.add_argument(
        "--actor-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of the encode actors (e.g. MALLOC_ARENA_MAX=2); the row records it",
    )
    p.add_argument("--out", default="corpus_scale_throughput.json", help="compare mode: file under benchmarks/results")
    args = p.parse_args()
    if not set(args.sides.split(",")) <= {"st", "raydata", "bf16"}:
        p.error(f"--sides: choose from st, raydata, bf16; got {args.sides!r}")
    if args.plot:
        plot(args)
    elif args.compare_docs:
        compare(args)
    elif args.passages:
        scale(args)
    else:
        p.error("give --passages N, --compare-docs N or --plot")


if __name__ == "__main__":
    main()
