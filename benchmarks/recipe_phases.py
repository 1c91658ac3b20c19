"""Time per phase of the SciFact recipe (experiment=scifact_finetune) in fp32 and in bf16, side by side on this machine.

The recipe's phases, on a slice of SciFact so that both precisions run in minutes: the zero-shot encode of the
passages (bf16 weights, as the encode actors hold them), mining hard negatives for the training queries (their
encode plus an exact FAISS search), `--steps` training steps (one worker, the recipe's batch of queries, each with
its positive and hard negatives, under autocast) and the trained encode. The settings come from the composed
recipe (lengths, batch size, hard negatives, temperature, lr); one process, `--threads` torch threads. It prints
the date, the machine (CPU model, torch's CPU capability, whether oneDNN runs bf16 natively) and the commit, then
the table: seconds per phase per precision and bf16 / fp32 speed (> 1: bf16 is faster).

    python benchmarks/recipe_phases.py [--docs 256] [--queries 64] [--steps 2] [--threads 2]

Needs SciFact in ../shared/data/scifact (or --data); without it the script prints `SKIP: ...` and exits 0. The
figures also go to benchmarks/results/recipe_phases.json.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gzip
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# ../shared/data/scifact next to the checkout (or next to the folder of a git worktree's checkout)
CANDIDATES = [ROOT.parent / "shared" / "data" / "scifact", ROOT.parents[1] / "shared" / "data" / "scifact"]
DEFAULT_DATA = next((p for p in CANDIDATES if p.exists()), CANDIDATES[0])
RESULTS = Path(__file__).parent / "results" / "recipe_phases.json"
PHASES = ("zero-shot encode", "mining", "training steps", "trained encode")


def machine() -> dict[str, str]:
    from ragtrain.embed.precision import cpu_bf16_native, cpu_capability

    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    try:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load = "unknown"
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": model,
        "torch cpu capability": cpu_capability(),
        "oneDNN native bf16": str(cpu_bf16_native()),
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "load average (1/5/15 min)": load,
        "commit": commit,
    }


def load_slice(data: Path, docs: int, queries: int) -> tuple[dict[str, str], dict[str, str], dict[str, list[str]]]:
    """(passages id -> title + text, training queries id -> text, query -> gold ids): the first `queries` training
    queries whose gold passages are kept, and passages up to `docs` (their gold first)."""
    qrels: dict[str, list[str]] = {}
    for line in (data / "qrels" / "train.tsv").read_text().splitlines()[1:]:
        q, d, s = line.split("\t")
        if int(s) > 0:
            qrels.setdefault(q, []).append(d)
    corpus: dict[str, str] = {}
    with gzip.open(data / "corpus.jsonl.gz", "rt") as f:
        for line in f:
            row = json.loads(line)
            corpus[row["_id"]] = (row.get("title", "") + " " + row["text"]).strip()
    texts = {json.loads(line)["_id"]: json.loads(line)["text"] for line in (data / "queries.jsonl").open()}
    chosen = [q for q in sorted(qrels, key=int) if all(d in corpus for d in qrels[q])][:queries]
    keep = list(dict.fromkeys(d for q in chosen for d in qrels[q]))
    keep += [d for d in corpus if d not in set(keep)][: max(0, docs - len(keep))]
    return {d: corpus[d] for d in keep}, {q: texts[q] for q in chosen}, {q: qrels[q] for q in chosen}


def run_phases(
    precision: str,
    retriever,
    train,
    passages: dict[str, str],
    queries: dict[str, str],
    gold: dict[str, list[str]],
    steps: int,
    encode_batch: int,
) -> dict[str, float]:
    """Seconds of each recipe phase in `precision` (fp32 / bf16), with the same seed and data."""
    import faiss
    import torch.nn.functional as F

    from ragtrain.embed.model import (
        autocast,
        build_encoder,
        encode_texts,
        inference_weights,
        load_tokenizer,
        tokenize,
    )

    torch.manual_seed(0)
    model, tok = build_encoder(retriever), load_tokenizer(retriever)
    ids, texts = list(passages), list(passages.values())
    out: dict[str, float] = {}

    def encode(m, items: list[str], length: int, role: str) -> torch.Tensor:
        frozen = inference_weights(copy.deepcopy(m).eval(), precision)  # as the encode actors hold it
        return encode_texts(frozen, tok, items, length, encode_batch, precision, role=role)

    t0 = time.perf_counter()
    p_vec = encode(model, texts, retriever.passage_max_length, "passage")
    out["zero-shot encode"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    qids = list(queries)
    q_vec = encode(model, [queries[q] for q in qids], retriever.query_max_length, "query")
    index = faiss.IndexFlatIP(p_vec.shape[1])
    index.add(p_vec.numpy())
    _, rows = index.search(q_vec.numpy(), train.hard_negative_depth)
    negatives = {
        q: [ids[r] for r in row[train.hard_negative_skip_top :] if r >= 0 and ids[r] not in gold[q]][
            : train.hard_negatives
        ]
        for q, row in zip(qids, rows)
    }
    out["mining"] = time.perf_counter() - t0

    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=train.lr)
    device = torch.device("cpu")
    t0 = time.perf_counter()
    for step in range(steps):
        batch = [qids[(step * train.batch_size + i) % len(qids)] for i in range(train.batch_size)]
        pos = [passages[gold[q][0]] for q in batch]
        neg = [passages[d] for q in batch for d in negatives[q]]
        q = tokenize(tok, [queries[x] for x in batch], retriever.query_max_length, "query")
        p = tokenize(tok, pos + neg, retriever.passage_max_length, "passage")
        with autocast(precision, device):
            scores = model(**q) @ model(**p).T / retriever.temperature
        loss = F.cross_entropy(scores.float(), torch.arange(len(batch)))
        optim.zero_grad()
        loss.backward()
        optim.step()
    out["training steps"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    encode(model, texts, retriever.passage_max_length, "passage")
    out["trained encode"] = time.perf_counter() - t0
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--docs", type=int, default=256, help="passages in the slice (the recipe: all 5,183)")
    ap.add_argument("--queries", type=int, default=64, help="training queries mined (the recipe: ~700)")
    ap.add_argument("--steps", type=int, default=2, help="training steps timed (the recipe: 75 on 2 workers)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precisions", default="fp32,bf16")
    args = ap.parse_args()
    if not (args.data / "corpus.jsonl.gz").exists():
        print(f"SKIP: SciFact not found in {args.data} (corpus.jsonl.gz): nothing to time (--data <folder>)")
        return 0
    sys.path.insert(0, str(ROOT))
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ragtrain.config import register_configs

    torch.set_num_threads(args.threads)
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=scifact_finetune"])
    retriever = OmegaConf.to_object(cfg.retriever)
    passages, queries, gold = load_slice(args.data, args.docs, args.queries)
    info = machine()
    for k, v in info.items():
        print(f"{k}: {v}")
    print(
        f"slice: {len(passages)} passages, {len(queries)} training queries, {args.steps} steps of "
        f"{retriever.train.batch_size} queries x (1 + {retriever.train.hard_negatives}) passages; "
        f"passage_max_length {retriever.passage_max_length}, encode batch {cfg.index.batch_size}"
    )
    results = {}
    for prec in args.precisions.split(","):
        results[prec] = run_phases(
            prec, retriever, retriever.train, passages, queries, gold, args.steps, int(cfg.index.batch_size)
        )
        print(f"{prec}: " + ", ".join(f"{k} {v:.1f}s" for k, v in results[prec].items()), flush=True)
    from tabulate import tabulate

    precs = list(results)
    rows = []
    for phase in (*PHASES, "total"):
        secs = [sum(results[p].values()) if phase == "total" else results[p][phase] for p in precs]
        ratio = [secs[0] / s for s in secs[1:]]
        rows.append([phase, *secs, *ratio])
    headers = ["phase", *(f"{p} s" for p in precs), *(f"{p} speed vs {precs[0]}" for p in precs[1:])]
    print(tabulate(rows, headers=headers, floatfmt=".2f", tablefmt="github"))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps({"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "seconds": results}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
