"""The cost of `python -m ragtrain search` on a large saved index: the checksum check of every index file on each
call (before) against the verified stamps (`ragtrain.index.integrity.verified_stamps`: a file hashed once, then
re-hashed only when its size / mtime / ctime / inode change).

Data: `--rows` seeded random float32 unit vectors of `--dim` dimensions in `--shards` Flat shards, written as a
saved sharded index (each shard persisted with its manifest, then index_meta.json and the sealed sharded.json, as
`ShardedIndex.save` writes them), in a run folder whose config.yaml names the tiny encoder with `--dim` hidden
units (seeded init: the query encoder of an index built by `tiny@init`); no passage store, so the texts are
reloaded from the synthetic data.

Measured, in this process, for each of `--calls` calls of `ragtrain.commands.search.search(run, question)`: its
wall clock, the sha256 calls it made (`integrity.sha256_file`) and the seconds spent in them, with the stamps file
removed before every call (each call verifies in full: the cost before) and kept (the first call verifies and
records, the others re-hash nothing).
The page cache is warm after the first call in both, so the difference is the hashing's CPU, not the disk.

Run:
    python benchmarks/search_verify.py --rows 1000000 --dim 384 --shards 4 --folder /tmp/search_verify
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ragtrain.index import integrity
from ragtrain.index.faiss_index import build_index
from ragtrain.index.sharded import MANIFEST, SHARDED, persist

ENCODER = "tiny@init"


def save_random_index(folder: Path, rows: int, dim: int, shards: int, seed: int = 0) -> Path:
    """A saved sharded Flat index of `rows` seeded unit vectors (ids p0, p1, ...), one shard in memory at a time."""
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, rows, shards + 1).astype(int)
    entries, metas = [], []
    for i, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        x = np.random.default_rng([seed, i]).standard_normal((stop - start, dim), dtype=np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        index = build_index(x, [f"p{j}" for j in range(start, stop)], "Flat", "fingerprint", ENCODER)
        del x
        m = persist(
            index,
            folder / f"shard-{i}",
            {"shard": i, "version": 0, "start": int(start), "stop": int(stop), "encoder": ENCODER,
             "encoder_step": 0, "corpus_fingerprint": "fingerprint"},
        )  # fmt: skip
        metas.append(index.meta)
        entries.append({"shard": i, "folder": f"shard-{i}", "start": int(start), "stop": int(stop), "rows": m["rows"],
                        "version": 0, "checksum": m["checksum"],
                        "manifest": integrity.sha256_file(folder / f"shard-{i}" / MANIFEST)})  # fmt: skip
    meta = {**asdict(metas[0]), "ntotal": rows}
    (folder / "index_meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    listed = {"shards": entries, "index_meta": integrity.sha256_file(folder / "index_meta.json")}
    (folder / SHARDED).write_text(json.dumps(integrity.seal_shard_list(listed), indent=2))
    return folder


def write_run(out: Path, dim: int) -> None:
    """config.yaml (the tiny encoder with `dim` hidden units, synthetic data) and status.json of a finished run."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ragtrain.config import register_configs, to_typed

    register_configs()
    over = ["experiment=quickstart", "retriever=tiny", f"retriever.tiny.hidden_size={dim}", "data.num_entities=24",
            f"output_dir={out}", "logger=none", "index.precision=fp32"]  # fmt: skip
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = to_typed(compose(config_name="config", overrides=over))
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    (out / "status.json").write_text(json.dumps({"status": "complete"}))


def timed_calls(out: Path, calls: int, keep_stamps: bool) -> list[tuple[float, int, float]]:
    """(seconds, sha256 calls, seconds inside sha256) of each search call."""
    from ragtrain.commands.search import VERIFIED_FILE, search

    hashed, hash_s, real = [0], [0.0], integrity.sha256_file

    def counting(path: Path) -> str:
        hashed[0], start = hashed[0] + 1, time.perf_counter()
        try:
            return real(path)
        finally:
            hash_s[0] += time.perf_counter() - start

    integrity.sha256_file = counting
    (out / VERIFIED_FILE).unlink(missing_ok=True)
    rows = []
    try:
        for _ in range(calls):
            if not keep_stamps:
                (out / VERIFIED_FILE).unlink(missing_ok=True)
            hashed[0], hash_s[0], start = 0, 0.0, time.perf_counter()
            search(out, "who founded the company?", 5)
            rows.append((time.perf_counter() - start, hashed[0], hash_s[0]))
    finally:
        integrity.sha256_file = real
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--folder", type=Path, default=Path("/tmp/search_verify"))
    ap.add_argument("--reuse", action="store_true", help="search the run already in --folder (same sizes)")
    args = ap.parse_args()
    out = args.folder
    start = time.perf_counter()
    if not args.reuse:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        save_random_index(out / "index", args.rows, args.dim, args.shards)
        write_run(out, args.dim)
    size = sum(f.stat().st_size for f in (out / "index").rglob("*") if f.is_file())
    print(f"index: {args.rows} x {args.dim} fp32 in {args.shards} shards, {size / 2**30:.2f} GiB, "
          f"written in {time.perf_counter() - start:.1f}s")  # fmt: skip
    for label, keep in (("hash every call (before)", False), ("verified stamps (after)", True)):
        rows = timed_calls(out, args.calls, keep)
        print(f"{label}: " + ", ".join(f"{s:.1f}s ({n} files hashed in {h:.1f}s)" for s, n, h in rows))


if __name__ == "__main__":
    main()
