"""The generator's pieces both training recipes share (the generator stage's ragtrain/generator/train.py and the joint
stage's ragtrain/joint/train.py), and that `ragtrain.commands.ask` and the benchmarks use: the question data, the step
sampler and each step's passages (the gold-only curriculum, then the retrieved ones), the prompt builder, autocast,
and EM / F1 evaluation in every retrieval mode.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from ragtrain.config import Config
from ragtrain.config.generator import (
    EVAL_MODES,
    GENERATOR_ARCHS,
    GeneratorConfig,
    GeneratorTrainConfig,
    GenPrecision,
    PromptStyle,
)
from ragtrain.embed.precision import resolve
from ragtrain.eval.qa_metrics import score
from ragtrain.generator.likelihood import evaluate_likelihood
from ragtrain.generator.model import AnswerDecoder, GenModel
from ragtrain.generator.prompt import PromptBuilder, Template
from ragtrain.generator.retriever_client import RetrievalClient


@dataclass
class GenExample:
    qid: str
    question: str
    answers: list[str]
    gold: list[str]  # doc ids of the relevant passages (grade > 0)


@dataclass
class GenData:
    train: list[GenExample]
    eval: list[GenExample]
    passages: Mapping[str, str]  # doc id -> prompt text of the passage (title applied per generator.include_title)
    # the questions of the answer likelihood (generator.eval.likelihood_questions): `eval` and more; empty = none
    likelihood: list[GenExample] = field(default_factory=list)


class Sampler:
    """Global example order: a seeded permutation per epoch, concatenated; position p -> example index."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._perms: dict[int, list[int]] = {}

    def __call__(self, pos: int) -> int:
        epoch = pos // self.n
        if epoch not in self._perms:
            perm = list(range(self.n))
            random.Random(f"{self.seed}-{epoch}").shuffle(perm)
            self._perms = {epoch: perm}  # batches only move forward: keep one epoch
        return self._perms[epoch][pos % self.n]


def train_passages(
    ex: GenExample,
    hits: list[str],
    k: int,
    include_gold: bool,
    shuffle: bool,
    rng: random.Random,
    whole: Callable[[list[str]], int] | None = None,
) -> list[str]:
    """Top-k retrieved ids; the gold passage replaces the lowest-ranked hit when missing; optionally shuffled.

    `whole(ids)`: how many leading ids the prompt holds whole (`PromptBuilder.whole_passages`). With it, the gold
    passage is kept among those: it is counted first, the others in rank order fill the rest of the budget, and
    only the passages that fit whole are shuffled, ahead of the rest (of which the prompt may hold a cut piece). So
    neither a shuffle nor a long higher-ranked hit can push the gold passage out of its own training prompt.
    """
    ids = list(hits[:k])
    gold = [p for p in ids if p in ex.gold][:1] if include_gold and ex.gold else []
    if include_gold and ex.gold and not gold:
        ids, gold = ids[: k - 1] + [ex.gold[0]], [ex.gold[0]]
    ordered = gold + [p for p in ids if p != gold[0]] if gold else ids
    n = whole(ordered) if whole is not None and gold else len(ids)
    if n >= len(ids):  # every passage fits whole (or there is no gold passage to keep): any order keeps them all
        if shuffle:
            rng.shuffle(ids)
        return ids
    n = max(1, n)  # 0: even the gold passage alone is longer than the budget (then it is cut)
    fits, rest = ordered[:n], ordered[n:]
    if shuffle:
        rng.shuffle(fits)
    else:
        fits.sort(key=ids.index)  # rank order among the passages that fit
    return fits + rest


def step_passages(
    ex: GenExample,
    hits: list[str],
    step: int,
    t: GeneratorTrainConfig,
    k: int,
    rng: random.Random,
    whole: Callable[[list[str]], int] | None = None,
) -> list[str]:
    """A training prompt's passage ids at `step`: the gold passage alone for the first `t.oracle_steps` (a curriculum:
    the answer format is learned on the passage that holds the answer; `hits` is not read then), `train_passages`
    after. The generator stage and the joint stage both call it, so joint training follows the same curriculum."""
    if step < t.oracle_steps:
        return list(ex.gold[:1])
    return train_passages(ex, hits, k, t.include_gold, t.shuffle_passages, rng, whole)


def prompt_builder(g: GeneratorConfig, tokenizer) -> PromptBuilder:
    """The configured prompt template and budgets for `tokenizer`."""
    return PromptBuilder(
        tokenizer,
        g.max_source_length,
        g.passage_max_tokens,
        Template(g.question_prefix, g.passage_prefix, g.answer_prefix),
        causal=GENERATOR_ARCHS[g.arch].causal,
        chat=PromptStyle(g.prompt) == PromptStyle.chat,
    )


def autocast(precision: GenPrecision, device: torch.device) -> AbstractContextManager:
    """bf16 / fp16 autocast on the device type, or nothing for fp32 (auto: bf16 where `device` runs it natively)."""
    p = GenPrecision(resolve(precision, device, "generator.train.precision", announce=False))
    if p == GenPrecision.fp32:
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if p == GenPrecision.bf16 else torch.float16)


def _prompts(
    builder: PromptBuilder, data: GenData, exs: Sequence[GenExample], pids: Sequence[list[str]], max_target: int
) -> tuple[list[list[int]], list[list[int]]]:
    src = [builder.source(e.question, [data.passages[p] for p in ps]) for e, ps in zip(exs, pids)]
    return src, [builder.target(e.answers[0], max_target) for e in exs]


def generate_sorted(model: GenModel, sources: Sequence[list[int]], g: GeneratorConfig, device: torch.device) -> list:
    """Answer ids for each prompt, in the input order. Prompts go in batches of similar length, longest first: a
    batch is left-padded to its longest prompt, and paragraphs range from a few dozen tokens to several hundred,
    so random batches spend much of the prompt's forward pass on padding."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]), reverse=True)
    out: list = [None] * len(sources)
    for i in range(0, len(order), g.eval.batch_size):
        idx = order[i : i + g.eval.batch_size]
        b = model.arch.collate([sources[j] for j in idx], [[] for _ in idx], model.pad_id, for_generation=True)
        with autocast(g.train.precision, device):
            answers = model.generate(
                b["input_ids"].to(device), b["attention_mask"].to(device), g.eval.num_beams, g.eval.max_new_tokens
            )
        for j, a in zip(idx, answers):
            out[j] = a
    return out


def evaluate(
    model: GenModel,
    builder: PromptBuilder,
    data: GenData,
    client: RetrievalClient,
    cfg: Config,
    device: torch.device,
    rank: int,
    world: int,
) -> tuple[dict[str, dict[str, float]], dict[str, list]]:
    """EM/F1 per eval mode, then the answer likelihood (mode "likelihood": rag_nll, rag_nll_top1, oracle_nll) on
    `data.likelihood`; ranks split the questions and gather predictions (every rank gets the scores)."""
    g = cfg.generator
    decode = AnswerDecoder(builder.tok)
    exs = data.eval  # the split, or its generator.eval.max_questions sample (build_gen_data)
    mine = exs[rank::world]
    model.eval()
    results, predictions = {}, {}
    for mode in [m for m in EVAL_MODES if m in g.eval.modes]:
        start, used = time.perf_counter(), []
        for i in range(0, len(mine), g.eval.batch_size):  # queries encoded in the batches they always were
            batch = mine[i : i + g.eval.batch_size]
            if mode == "rag":
                used += client.search([e.question for e in batch], g.retrieval.top_k)
            else:
                used += [e.gold[:1] if mode == "oracle" else [] for e in batch]
        used = [list(p) for p in used]
        src, _ = _prompts(builder, data, mine, used, g.max_target_length)
        preds = [decode(o) for o in generate_sorted(model, src, g, device)]
        rows = [(e.qid, (p, u)) for e, p, u in zip(mine, preds, used)]
        if world > 1:
            gathered: list = [None] * world
            torch.distributed.all_gather_object(gathered, rows)
            rows = [r for part in gathered for r in part]
        by_qid = dict(rows)
        ordered = [by_qid[e.qid][0] for e in exs]
        passages = [by_qid[e.qid][1] for e in exs]
        results[mode] = {**score(ordered, [e.answers for e in exs]), "seconds": time.perf_counter() - start}
        if mode == "rag":  # how often retrieval put the gold passage in the prompt: EM's ceiling from retrieval
            results[mode]["gold_in_top_k"] = sum(bool(set(e.gold) & set(u)) for e, u in zip(exs, passages)) / max(
                1, len(exs)
            )
        predictions[mode] = [
            {"qid": e.qid, "question": e.question, "prediction": p, "answers": e.answers, "passages": u}
            for e, p, u in zip(exs, ordered, passages)
        ]
    if data.likelihood and g.eval.likelihood_top_k:
        results["likelihood"], predictions["likelihood"] = evaluate_likelihood(
            model, builder, data.likelihood, data.passages, client, cfg,
            lambda: autocast(g.train.precision, device), rank, world,
        )  # fmt: skip
    model.train()
    return results, predictions
