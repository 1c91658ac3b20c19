"""Preparing one large .jsonl export against the same documents in many small files: the driver's peak RSS.

    python benchmarks/large_file.py --docs 100000 --words 300      # ~200 MB of text in one file and in 100 files

A corpus often arrives as one multi-GB jsonl export. Each run below is `corpus.load.load_data` with `data=documents`
(no chunking: the documents are the passages) streaming the folder into the run's passage store, in a fresh process
(VmHWM is per process), for each layout (one file / files of 1,000 documents) and each `data.prepare` (driver /
ray: Ray Data read tasks on a 2-CPU local Ray). Printed side by side: the driver's peak RSS, its growth over the
same run on a small corpus (the first 1,000 documents, one file), and seconds. The driver's RSS is shown by kind,
sampled every 50 ms: anon (its own heap: what it holds), file (mapped files: the passage store it writes, hashes
and memory-maps, page cache the kernel can drop) and shmem (Ray object-store blocks it reads). Appended to
benchmarks/results/large_file.json with the commit it ran at.
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
RESULTS = HERE / "results" / "large_file.json"
WORDS = ("entity", "river", "protein", "theorem", "harbour", "lattice", "signal", "orchard", "ledger", "comet")


def write_folder(root: Path, docs: int, words: int, per_file: int) -> None:
    """`docs` documents of `words` words as jsonl files of `per_file` (0: one file), plus queries and qrels."""
    (root / "qrels").mkdir(parents=True)
    per_file = per_file or docs
    f = None
    for i in range(docs):
        if i % per_file == 0:
            if f:
                f.close()
            f = open(root / f"part-{i // per_file:05d}.jsonl", "w", encoding="utf-8")
        text = " ".join(f"{WORDS[(i * 7 + j) % len(WORDS)]}{(i + j) % 997}" for j in range(words))
        f.write(json.dumps({"_id": f"d{i:08d}", "title": f"Document {i}", "text": text}) + "\n")
    if f:
        f.close()
    (root / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": f"q{i}", "text": f"entity {i}"}) + "\n" for i in range(10))
    )
    for split in ("train", "dev"):
        (root / "qrels" / f"{split}.tsv").write_text(
            "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i:08d}\t1\n" for i in range(10))
        )


def one_run(root: str, prepare: str, out: str) -> None:
    """In this process: prepare the folder into a passage store; print {docs, seconds, driver_peak_rss_mb}."""
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(HERE))
    from corpus_scale import RssSampler

    from ragtrain.config.data import DataConfig, Prepare
    from ragtrain.corpus.load import load_data
    from ragtrain.runtime.rss import peak_rss_mb

    def start_ray() -> None:
        import ray

        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
        )
        from ray.data import DataContext

        DataContext.get_current().enable_progress_bars = False

    cfg = DataConfig(source="documents", root=root, prepare=Prepare(prepare))
    cfg.chunk.enabled = False
    sampler = RssSampler()  # by kind: the heap (anon) is what the driver holds; file pages are the mapped store
    t = time.perf_counter()
    data = load_data(cfg, out_dir=Path(out), start_ray=start_ray)
    seconds = time.perf_counter() - t
    kinds = sampler.stop()
    print(
        json.dumps(
            {
                "docs": len(data.corpus),
                "seconds": seconds,
                "driver_peak_rss_mb": peak_rss_mb(),
                "driver_anon_peak_mb": kinds["peak"].get("anon", 0.0),
                "driver_file_peak_mb": kinds["peak"].get("file", 0.0),
                "driver_shmem_peak_mb": kinds["peak"].get("shmem", 0.0),
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=100000)
    p.add_argument("--words", type=int, default=300, help="words per document (~7 bytes each)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--one-run", nargs=3, metavar=("ROOT", "PREPARE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one_run:
        one_run(*args.one_run)
        return
    work = Path(tempfile.mkdtemp(prefix="large_file-", dir=args.workdir))
    folders = {"small": (min(1000, args.docs), 0), "one file": (args.docs, 0), "files of 1,000": (args.docs, 1000)}
    for name, (docs, per_file) in folders.items():
        write_folder(work / name.replace(" ", "_").replace(",", ""), docs, args.words, per_file)
    mb = sum(f.stat().st_size for f in (work / "one_file").glob("*.jsonl")) / 2**20
    commit = (
        subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        or "?"
    )
    rows = []
    for prepare in ("driver", "ray"):
        for name in folders:
            folder = work / name.replace(" ", "_").replace(",", "")
            r = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one-run",
                    str(folder),
                    prepare,
                    str(work / f"out-{prepare}-{folder.name}"),
                ],
                capture_output=True,
                text=True,
            )
            if r.returncode:
                sys.exit(f"{name} / {prepare} failed:\n{r.stderr[-3000:]}")
            row = json.loads(r.stdout.strip().splitlines()[-1]) | {"layout": name, "prepare": prepare}
            rows.append(row)
    print(f"{args.docs} documents of {args.words} words, {mb:.0f} MB of jsonl; commit {commit}")
    print(
        f"{'prepare':8} {'layout':16} {'docs':>8} {'s':>7} {'peak RSS MB':>12} {'anon / file / shmem peak MB':>28} "
        f"{'anon over small':>16}"
    )
    for r in rows:
        small = next(x for x in rows if x["prepare"] == r["prepare"] and x["layout"] == "small")
        r["anon_growth_over_small_mb"] = r["driver_anon_peak_mb"] - small["driver_anon_peak_mb"]
        kinds = f"{r['driver_anon_peak_mb']:.0f} / {r['driver_file_peak_mb']:.0f} / {r['driver_shmem_peak_mb']:.0f}"
        print(
            f"{r['prepare']:8} {r['layout']:16} {r['docs']:8d} {r['seconds']:7.1f} {r['driver_peak_rss_mb']:12.1f} "
            f"{kinds:>28} {r['anon_growth_over_small_mb']:+16.1f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    RESULTS.write_text(
        json.dumps(
            old
            + [
                {
                    "commit": commit,
                    "docs": args.docs,
                    "words": args.words,
                    "jsonl_mb": mb,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "rows": rows,
                }
            ],
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
