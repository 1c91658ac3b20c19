"""How much faster can bf16 be than fp32 on this CPU? The matmul ceiling next to MiniLM's forward pass.

Issue 13 asked for bf16 encoding >= 2.5x fp32. Whether that is reachable depends on the CPU: with AVX512-BF16 but no
AMX, a bf16 dot product (VDPBF16PS) does twice the multiply-adds of an fp32 FMA per instruction, so ~2x is the
hardware's ceiling for the matmuls, and the rest of the forward pass (softmax, layer norm, GELU, the conversions)
does not speed up at all. This measures, side by side in one process and one thread setting:

1. a square GEMM (torch.matmul) in fp32 and bf16, the ceiling of any bf16 speed-up here;
2. MiniLM's own linear-layer shapes ([tokens, 384] x [384, 1536]);
3. MiniLM's whole forward pass, fp32 against bf16 autocast (what `index.precision=bf16` runs).

    python benchmarks/bf16_ceiling.py [--threads 2] [--seq 256] [--batch 32] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "bf16_ceiling.json"


def cpu_flags() -> list[str]:
    """The CPU's bf16-relevant instruction sets (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    found = set(re.findall(r"\b(avx512_bf16|amx_bf16|amx_tile|avx512f|avx512_vnni|avx2)\b", text))
    return sorted(found)


def best_of(fn, reps: int) -> float:
    """The fastest of `reps` timed calls after one warm-up (the least disturbed by other load)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def gemm_ratio(m: int, k: int, n: int, reps: int) -> dict[str, float]:
    """fp32 time / bf16 time of one [m, k] x [k, n] matmul, with the fp32 GFLOP/s."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a16, b16 = a.bfloat16(), b.bfloat16()
    t32 = best_of(lambda: torch.matmul(a, b), reps)
    t16 = best_of(lambda: torch.matmul(a16, b16), reps)
    return {"fp32_s": t32, "bf16_s": t16, "ratio": t32 / t16, "fp32_gflops": 2 * m * k * n / t32 / 1e9,
            "bf16_gflops": 2 * m * k * n / t16 / 1e9}


def forward_ratio(batch: int, seq: int, reps: int) -> dict[str, float]:
    """fp32 time / bf16-autocast time of MiniLM's forward pass on [batch, seq] tokens (the packaged weights)."""
    from transformers import AutoModel

    from ragtrain.retriever.encoder import minilm_path

    model = AutoModel.from_pretrained(minilm_path()).eval()
    ids = torch.randint(1000, 20000, (batch, seq))
    mask = torch.ones_like(ids)

    def run(bf16: bool):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(input_ids=ids, attention_mask=mask)

    t32 = best_of(lambda: run(False), reps)
    t16 = best_of(lambda: run(True), reps)
    return {"fp32_s": t32, "bf16_s": t16, "ratio": t32 / t16, "fp32_texts_per_s": batch / t32,
            "bf16_texts_per_s": batch / t16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tokens = args.batch * args.seq
    out = {
        "cpu_flags": cpu_flags(),
        "threads": args.threads,
        "gemm_2048": gemm_ratio(2048, 2048, 2048, args.reps),
        "gemm_minilm_ffn": gemm_ratio(tokens, 384, 1536, args.reps),
        "gemm_minilm_qkv": gemm_ratio(tokens, 384, 384, args.reps),
        "minilm_forward": forward_ratio(args.batch, args.seq, args.reps),
    }
    print(f"CPU flags: {' '.join(out['cpu_flags']) or '(unknown)'}; {args.threads} threads; "
          f"batch {args.batch} x {args.seq} tokens")
    print(f"{'what':<34}{'fp32 s':>10}{'bf16 s':>10}{'bf16 speed-up':>15}")
    for name in ("gemm_2048", "gemm_minilm_ffn", "gemm_minilm_qkv", "minilm_forward"):
        r = out[name]
        print(f"{name:<34}{r['fp32_s']:>10.4f}{r['bf16_s']:>10.4f}{r['ratio']:>14.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
