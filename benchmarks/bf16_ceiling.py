"""How much faster can bf16 be than fp32 on this CPU? The matmul ceiling next to MiniLM's forward pass.

The goal is bf16 encoding >= 2.5x fp32. Whether that is reachable depends on the CPU: with AVX512-BF16 but no
AMX, a bf16 dot product (VDPBF16PS) does twice the multiply-adds of an fp32 FMA per instruction, so ~2x is the
hardware's ceiling for the matmuls, and the rest of the forward pass (softmax, layer norm, GELU, the conversions)
does not speed up at all. This measures, side by side in one process and one thread setting:

1. a square GEMM (torch.matmul) in fp32 and bf16, the ceiling of any bf16 speed-up here;
2. MiniLM's own linear-layer shapes ([tokens, 384] x [384, 1536]);
3. MiniLM's whole forward pass, fp32 against bf16 autocast and against bf16 weights (what `index.precision=bf16`
   runs since 2026-12-02: the embed-only encoders hold bf16 weights, `ragtrain.embed.model.inference_weights`).

    python benchmarks/bf16_ceiling.py [--threads 2] [--seq 256] [--batch 32] [--reps 5] [--profile]
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
    return {
        "fp32_s": t32,
        "bf16_s": t16,
        "ratio": t32 / t16,
        "fp32_gflops": 2 * m * k * n / t32 / 1e9,
        "bf16_gflops": 2 * m * k * n / t16 / 1e9,
    }


def forward_ratio(batch: int, seq: int, reps: int) -> dict[str, float]:
    """fp32 time / bf16-autocast time of MiniLM's forward pass on [batch, seq] tokens (the packaged weights)."""
    from transformers import AutoModel

    from ragtrain.embed.model import minilm_path

    model = AutoModel.from_pretrained(minilm_path()).eval()
    ids = torch.randint(1000, 20000, (batch, seq))
    mask = torch.ones_like(ids)

    def run(bf16: bool):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(input_ids=ids, attention_mask=mask)

    t32 = best_of(lambda: run(False), reps)
    t16 = best_of(lambda: run(True), reps)
    with torch.inference_mode():  # what each path costs in accuracy: mean-pooled vectors against fp32's
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state.mean(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = model(input_ids=ids, attention_mask=mask).last_hidden_state.float().mean(1)
    # every weight and activation in bf16 (model.bfloat16(), no autocast): no fp32 islands (layer norm, softmax)
    # and no conversions between them, at the cost of accuracy
    model = model.bfloat16()
    tw = best_of(lambda: run(False), reps)
    with torch.inference_mode():
        whole = model(input_ids=ids, attention_mask=mask).last_hidden_state.float().mean(1)
    cos = torch.nn.functional.cosine_similarity
    return {
        "fp32_s": t32,
        "bf16_s": t16,
        "ratio": t32 / t16,
        "fp32_texts_per_s": batch / t32,
        "bf16_texts_per_s": batch / t16,
        "bf16_weights_s": tw,
        "bf16_weights_ratio": t32 / tw,
        "autocast_min_cos": float(cos(ref, auto).min()),
        "bf16_weights_min_cos": float(cos(ref, whole).min()),
    }


def profile_ops(batch: int, seq: int, top: int = 6) -> dict[str, dict[str, float]]:
    """Self CPU ms of the costliest operators of one MiniLM forward, fp32 and bf16 autocast (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModel

    from ragtrain.embed.model import minilm_path

    model = AutoModel.from_pretrained(minilm_path()).eval()
    ids = torch.randint(1000, 20000, (batch, seq))
    mask = torch.ones_like(ids)
    out = {}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(input_ids=ids, attention_mask=mask)  # warm-up
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                model(input_ids=ids, attention_mask=mask)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
        out[name] = {e.key: e.self_cpu_time_total / 1e3 for e in ops}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="also print the costliest operators (torch.profiler)")
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
    print(
        f"CPU flags: {' '.join(out['cpu_flags']) or '(unknown)'}; {args.threads} threads; "
        f"batch {args.batch} x {args.seq} tokens"
    )
    print(f"{'what':<34}{'fp32 s':>10}{'bf16 s':>10}{'bf16 speed-up':>15}")
    for name in ("gemm_2048", "gemm_minilm_ffn", "gemm_minilm_qkv", "minilm_forward"):
        r = out[name]
        print(f"{name:<34}{r['fp32_s']:>10.4f}{r['bf16_s']:>10.4f}{r['ratio']:>14.2f}x")
    f = out["minilm_forward"]
    print(
        f"{'minilm_forward, bf16 weights':<34}{f['fp32_s']:>10.4f}{f['bf16_weights_s']:>10.4f}"
        f"{f['bf16_weights_ratio']:>14.2f}x"
    )
    print(
        f"min cosine to fp32 (mean-pooled): autocast {f['autocast_min_cos']:.6f}, "
        f"bf16 weights {f['bf16_weights_min_cos']:.6f}"
    )
    if args.profile:  # where the forward's time goes: the matmuls speed up, attention and the casts do not
        out["profile_ms"] = profile_ops(args.batch, args.seq)
        names = list(dict.fromkeys([*out["profile_ms"]["fp32"], *out["profile_ms"]["bf16"]]))
        print(f"{'operator (self CPU ms)':<44}{'fp32':>10}{'bf16':>10}")
        for n in names:
            f32, b16 = out["profile_ms"]["fp32"].get(n), out["profile_ms"]["bf16"].get(n)
            print(f"{n[:43]:<44}{'' if f32 is None else f'{f32:.0f}':>10}{'' if b16 is None else f'{b16:.0f}':>10}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
