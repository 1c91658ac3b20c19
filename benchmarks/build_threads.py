"""An index build's encode on the laptop layout: one Ray Data actor with 1 torch thread (before) vs a thread per
free core (`ragtrain.corpus.encode.build_threads`, after), side by side in one run.

What is compared
    `encode_to_vectors` of the same passages (the first --docs SciFact passages, chunked to --max-tokens MiniLM
    tokens as `data.chunk` does, or whole) with the laptop's pool, `resources.pool` = 1 actor x 1 CPU, on a local
    Ray of `ray.init(num_cpus=2)`, MiniLM at the precision `auto` picks here. Before: `num_threads=1`, the pool's
    own CPU. After: `build_threads(pool)`, what a build that nothing runs beside now gets. Repetitions alternate
    before, after, before, after (--reps); each is timed around `encode_to_vectors` (actor start and model load
    included: a build pays them too). We print passages/s per repetition, the medians and after / before.

Data: ../shared/data/scifact (override with $RAGTRAIN_DATA); exits 0 with a message when it is absent.
Run: `python benchmarks/build_threads.py [--docs 2000] [--reps 2]`
Results: the printed table and benchmarks/results/build_threads.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
SCIFACT = (HERE.parent / os.environ.get("RAGTRAIN_DATA", "../shared/data")).resolve() / "scifact"


def machine() -> str:
    """CPU model, the flags that decide bf16 speed, cores, and the commit."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    marks = " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    return f"{model} ({marks}), {len(os.sched_getaffinity(0))} cores, commit {commit.strip() or '?'}"


def passages(docs: int, max_tokens: int) -> tuple[list[str], list[str]]:
    """(ids, texts) of the first `docs` SciFact abstracts, chunked into <= max_tokens MiniLM tokens (0: whole)."""
    from ragtrain.config.retriever import RetrieverConfig
    from ragtrain.corpus.chunk import chunk_document
    from ragtrain.embed.model import load_tokenizer

    tok = load_tokenizer(RetrieverConfig())
    ids, texts = [], []
    with gzip.open(SCIFACT / "corpus.jsonl.gz", "rt") as f:
        for line, _ in zip(f, range(docs)):
            d = json.loads(line)
            doc = {"id": d["_id"], "title": d.get("title", ""), "text": d["text"], "source": "corpus.jsonl.gz"}
            parts = chunk_document(doc, tok, max_tokens, max_tokens // 4) if max_tokens else [doc]
            for p in parts:
                ids.append(p["id"])
                texts.append(f"{p['title']}\n{p['text']}" if p["title"] else p["text"])
    return ids, texts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=2000, help="SciFact abstracts read (default 2000)")
    ap.add_argument("--max-tokens", type=int, default=128, help="chunk size in MiniLM tokens; 0 = whole abstracts")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of each side, alternating")
    ap.add_argument("--out", default=str(HERE / "results" / "build_threads.json"))
    args = ap.parse_args(argv)
    if not (SCIFACT / "corpus.jsonl.gz").exists():
        print(f"SciFact is not at {SCIFACT}: nothing to measure (set RAGTRAIN_DATA)")
        return 0
    import ray
    import torch

    from ragtrain.config.index import IndexConfig
    from ragtrain.config.resources import PoolResources
    from ragtrain.config.retriever import RetrieverConfig
    from ragtrain.corpus.encode import build_threads, encode_to_vectors
    from ragtrain.embed.model import build_encoder
    from ragtrain.embed.precision import resolve

    ids, texts = passages(args.docs, args.max_tokens)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        retriever = RetrieverConfig(passage_max_length=args.max_tokens + 2 if args.max_tokens else 256)
        precision = resolve("auto", torch.device("cpu"), "index.precision", announce=False)
        idx = IndexConfig(precision=precision, batch_size=32)
        pool = PoolResources(num_actors=1, cpus_per_actor=1)
        weights = ray.put(build_encoder(retriever).state_dict())
        sides = {"before": 1, "after": build_threads(pool)}
        head = f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC | {machine()} | {len(texts)} passages | "
        print(head + f"index.precision auto -> {precision} | threads before {sides['before']}, after {sides['after']}")
        rates: dict[str, list[float]] = {k: [] for k in sides}
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(args.reps):
                for side, threads in sides.items():
                    t0 = time.perf_counter()
                    encode_to_vectors((ids, texts), weights, retriever, idx, pool, Path(tmp, side), num_threads=threads)
                    rates[side].append(len(texts) / (time.perf_counter() - t0))
                    print(f"rep {rep + 1} {side:>6} ({threads} threads): {rates[side][-1]:7.1f} passages/s")
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(f"median passages/s: before {med['before']:.1f}, after {med['after']:.1f}, "
              f"after / before {med['after'] / med['before']:.2f}")  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"machine": machine(), "passages": len(texts), "threads": sides,
                                              "passages_per_s": rates, "median": med}, indent=2))  # fmt: skip
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
