"""Peak memory of one training step, GradCache (retriever.train.cache_chunk_size) vs the uncached loss.

Each (batch, chunk) point runs in a fresh child process (peak RSS cannot be reset inside one process): it builds
the encoder (MiniLM by default), makes a batch of B queries (--query-len tokens) and B positive passages
(--passage-len tokens, no padding: every text is full length, the worst case), and runs one forward + backward of
the contrastive loss, uncached (chunk 0) or through `ragtrain.retriever.gradcache.cached_step`. A sampling thread
reads the child's RSS every 2 ms during the step; the step's peak above the RSS before it is the figure that
grows with the batch (the model, its gradients and the torch runtime are the baseline). The process's ru_maxrss
is printed too. Batches double until the uncached step goes over --budget-gib of peak RSS (it "does not fit");
the cached side continues to --max-batch.

    python benchmarks/gradcache_memory.py                    # MiniLM, chunk 16, batches 16 .. 256, budget 2 GiB
    python benchmarks/gradcache_memory.py --model tiny --max-batch 1024

Memory is what this measures; the seconds it prints are not a throughput figure on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def child(model_name: str, batch: int, chunk: int, query_len: int, passage_len: int) -> dict:
    import resource

    import torch

    from ragtrain.config.retriever import RetrieverConfig
    from ragtrain.embed.model import build_encoder
    from ragtrain.retriever.gradcache import cached_step
    from ragtrain.retriever.loss import contrastive_loss
    from ragtrain.retriever.train import QPEncoder

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = QPEncoder(build_encoder(RetrieverConfig(model=model_name))).train()
    vocab = model.encoder.backbone.config.vocab_size
    q = {
        "input_ids": torch.randint(1000, vocab, (batch, query_len)),
        "attention_mask": torch.ones(batch, query_len, dtype=torch.long),
    }
    p = {
        "input_ids": torch.randint(1000, vocab, (batch, passage_len)),
        "attention_mask": torch.ones(batch, passage_len, dtype=torch.long),
    }

    def loss_fn(qe, pe):
        return contrastive_loss(qe, pe, 0.05, gather=False)

    # warm-up step at batch 2 (allocator, lazy init), then measure from a settled baseline
    small = {k: v[:2] for k, v in q.items()}, {k: v[:2] for k, v in p.items()}
    loss_fn(*model(*small)).backward()
    model.zero_grad(set_to_none=False)
    base = rss()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    start = time.perf_counter()
    if chunk:
        loss = cached_step(model, q, p, chunk, loss_fn)
    else:
        loss = loss_fn(*model(q, p))
        loss.backward()
    seconds = time.perf_counter() - start
    stop.set()
    t.join()
    peak[0] = max(peak[0], rss())
    return {
        "batch": batch,
        "chunk": chunk,
        "base_rss": base,
        "peak_rss": peak[0],
        "step_peak": peak[0] - base,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "loss": float(loss),
        "seconds": seconds,
    }


def run_point(args, batch: int, chunk: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        str(batch),
        str(chunk),
        "--model",
        args.model,
        "--query-len",
        str(args.query_len),
        "--passage-len",
        str(args.passage_len),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode != 0:
        return {"batch": batch, "chunk": chunk, "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--min-batch", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--query-len", type=int, default=32)
    ap.add_argument("--passage-len", type=int, default=128)
    ap.add_argument("--budget-gib", type=float, default=2.0, help="peak RSS a step may use to 'fit'")
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.child:
        print(json.dumps(child(args.model, args.child[0], args.child[1], args.query_len, args.passage_len)))
        return

    gib = 1024**3
    budget = args.budget_gib * gib
    load = os.getloadavg()[0]
    print(
        f"{args.model}: queries {args.query_len} tokens, passages {args.passage_len} tokens, chunk {args.chunk}, "
        f"budget {args.budget_gib} GiB peak RSS; load average {load:.1f} on {os.cpu_count()} CPUs"
    )
    rows, uncached_fits = [], True
    batch = args.min_batch
    while batch <= args.max_batch:
        for chunk in (0, args.chunk):
            if chunk == 0 and not uncached_fits:
                continue
            if chunk > batch:
                continue
            r = run_point(args, batch, chunk)
            rows.append(r)
            if "error" in r:
                print(f"batch {batch:5d} chunk {chunk:3d}: failed {r['error']}", flush=True)
                continue
            fits = r["peak_rss"] <= budget
            if chunk == 0 and not fits:
                uncached_fits = False
            print(
                f"batch {batch:5d} {'cached ' + str(chunk) if chunk else 'uncached':>10}: step peak "
                f"+{r['step_peak'] / gib:6.3f} GiB over {r['base_rss'] / gib:.3f} GiB -> peak RSS "
                f"{r['peak_rss'] / gib:6.3f} GiB ({'fits' if fits else 'over budget'}), {r['seconds']:.1f} s",
                flush=True,
            )
        batch *= 2
    ok = [r for r in rows if "error" not in r and r["peak_rss"] <= budget]
    for chunk, name in ((0, "uncached"), (args.chunk, f"cached (chunk {args.chunk})")):
        fit = [r for r in ok if r["chunk"] == chunk]
        if fit:
            best = max(fit, key=lambda r: r["batch"])
            print(
                f"largest batch within {args.budget_gib} GiB, {name}: {best['batch']} "
                f"(peak RSS {best['peak_rss'] / gib:.3f} GiB, step +{best['step_peak'] / gib:.3f} GiB)"
            )
    out = ROOT / "benchmarks" / "results" / "gradcache_memory.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "load_average": load, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
