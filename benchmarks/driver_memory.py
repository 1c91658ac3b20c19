"""Driver memory of a real `ragtrain` run as the corpus grows: the passage store against the in-memory corpus.

    python benchmarks/driver_memory.py --passages 20000 200000 [--modes store memory]

For each N a BEIR folder of N short passages (the generator of corpus_scale.py, 12-30 words each) with 100 dev
queries is written once; then each (N, mode) runs in a fresh process (VmHWM is per process):
`ragtrain.pipeline.stages.run` with `data=beir retriever=tiny stages=[index] logger=none` — read the corpus, encode it
on Ray Data (2 actors), build the Flat index from the vector files in the run's index shard actor, evaluate nDCG@10.
Mode `store` is what every run does
(the corpus streams into `<output_dir>/corpus/passages.arrow` and Ray Data's read tasks read it); mode `memory`
loads the same corpus as a dict in the driver and sends its texts through the object store (the path before the
passage store, kept for small corpora and tests). Recorded per run: driver peak RSS (VmHWM), RSS after imports,
the index shard's peak RSS (where the index lives), wall seconds, nDCG@10. `--overrides retriever.tiny.hidden_size=384`
gives the vectors MiniLM's width at the tiny model's encode cost. Printed side by side with the growth from the
smallest to the largest N; appended to
benchmarks/results/driver_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results" / "driver_memory.json"
QUERIES = 100


def write_folder(root: Path, n: int) -> None:
    """A BEIR folder of n generated passages (streamed to corpus.jsonl) and QUERIES dev queries on every n/100th."""
    import numpy as np
    from corpus_scale import make_docs

    root.mkdir(parents=True, exist_ok=True)
    (root / "qrels").mkdir(exist_ok=True)
    every = max(1, n // QUERIES)
    with (
        open(root / "corpus.jsonl", "w") as corpus,
        open(root / "queries.jsonl", "w") as queries,
        open(root / "qrels" / "dev.tsv", "w") as qrels,
    ):
        qrels.write("query-id\tcorpus-id\tscore\n")
        for start in range(0, n, 10_000):
            docs = make_docs({"id": np.arange(start, min(n, start + 10_000))})
            for k, (i, title, text) in enumerate(zip(docs["id"], docs["title"], docs["text"]), start=start):
                corpus.write(json.dumps({"_id": str(i), "title": title, "text": text}) + "\n")
                if k % every == 0:
                    # a query: the passage's text with its first words dropped (a lexical, not exact, match)
                    queries.write(json.dumps({"_id": f"q{i}", "text": " ".join(text.split()[3:])}) + "\n")
                    qrels.write(f"q{i}\t{i}\t1\n")


def child(root: str, mode: str, out: str, overrides: list[str]) -> None:
    """One run in this process; prints one JSON line."""
    from ragtrain.runtime.rss import peak_rss_mb

    rss_imports = peak_rss_mb()
    import ragtrain.pipeline.retrieval  # noqa: F401  (torch, transformers, faiss: counted before any data)
    from ragtrain.config import to_typed
    from ragtrain.corpus.load import load_data
    from ragtrain.pipeline.stages import run
    from tests.conftest import compose

    rss_imports = peak_rss_mb()
    cfg = to_typed(
        compose(
            [
                "data=beir",
                f"data.root={root}",
                "retriever=tiny",
                "stages=[index]",
                "logger=none",
                "resources.num_cpus=2",
                f"output_dir={out}",
                *overrides,
            ]
        )
    )
    if mode == "memory":  # the same run, with the corpus loaded as a dict (no store)
        import ragtrain.pipeline.stages as pipeline

        pipeline.load_data = lambda data_cfg, retriever=None, out_dir=None, **kw: load_data(
            data_cfg, retriever, out_dir, store=False, **kw
        )
    t = time.perf_counter()
    results = run(cfg)
    wall = time.perf_counter() - t
    z = results["zeroshot"]
    print(
        json.dumps(
            {
                "mode": mode,
                "driver_peak_rss_mb": peak_rss_mb(),
                "rss_after_imports_mb": rss_imports,
                "index_shard_peak_rss_mb": z["index_shard_peak_rss_mb"],
                "wall_s": wall,
                "ndcg@10": z["ndcg@10"],
                "overrides": overrides,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passages", type=int, nargs="+", default=[20_000, 200_000])
    ap.add_argument("--modes", nargs="+", default=["store", "memory"], choices=["store", "memory"])
    ap.add_argument(
        "--overrides",
        nargs="*",
        default=[],
        help="extra config overrides, e.g. retriever.tiny.hidden_size=384 (MiniLM's width)",
    )
    ap.add_argument("--child", nargs=3, metavar=("ROOT", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child, args.overrides)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ragtrain-drivermem-") as tmp:
        for n in args.passages:
            root = Path(tmp) / f"beir_{n}"
            write_folder(root, n)
            for mode in args.modes:
                proc = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        str(root),
                        mode,
                        str(Path(tmp) / f"out_{n}_{mode}"),
                        "--overrides",
                        *args.overrides,
                    ],
                    capture_output=True,
                    text=True,
                    cwd=REPO,
                )
                if proc.returncode:
                    sys.exit(f"N={n} mode={mode} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
                row = {
                    "passages": n,
                    **json.loads(proc.stdout.strip().splitlines()[-1]),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "load_avg": os.getloadavg()[0],
                }
                rows.append(row)
                print(
                    f"N={n:>8,} {mode:>6}: driver peak {row['driver_peak_rss_mb']:7.1f} MB (after imports "
                    f"{row['rss_after_imports_mb']:.1f}), index shard peak {row['index_shard_peak_rss_mb']:7.1f} MB, "
                    f"{row['wall_s']:6.1f} s, nDCG@10 {row['ndcg@10']:.4f}",
                    flush=True,
                )
    lo, hi = min(args.passages), max(args.passages)
    print(f"\ndriver peak RSS growth {lo:,} -> {hi:,} passages:")
    for mode in args.modes:
        a = next(r for r in rows if r["passages"] == lo and r["mode"] == mode)
        b = next(r for r in rows if r["passages"] == hi and r["mode"] == mode)
        print(
            f"  {mode:>6}: driver {b['driver_peak_rss_mb'] - a['driver_peak_rss_mb']:+8.1f} MB, index shard "
            f"{b['index_shard_peak_rss_mb'] - a['index_shard_peak_rss_mb']:+8.1f} MB"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    RESULTS.write_text(json.dumps(old + rows, indent=2))


if __name__ == "__main__":
    main()
