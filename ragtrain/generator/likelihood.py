"""The RAG answer likelihood as an evaluation metric (ragtrain/eval/likelihood.py has its formulas): per question,
the retriever's top `generator.eval.likelihood_top_k` passages with their scores, and the generator's teacher-forced
log-likelihood of the answer given each passage alone and given the gold passage.

It needs no generation, one forward pass per (question, passage) prompt, so it is computed on more questions than
EM / F1: `GenData.likelihood`, every question of the evaluated split by default (`generator.eval.
likelihood_questions`), which holds EM's sample. `steps.evaluate` runs it after EM / F1 in both recipes: the
generator stage's generator with its run's index, the joint stage's with its trained query encoder. (The joint
stage's own `joint/likelihood.py` is the training target: k passages per question of a training batch, with grad.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from ragtrain.config import Config
from ragtrain.eval.likelihood import mean_nll, question_nll
from ragtrain.generator.model import GenModel
from ragtrain.generator.prompt import PromptBuilder


class Question(Protocol):
    """What the metric reads of an evaluated question (`steps.GenExample`)."""

    qid: str
    question: str
    answers: list[str]
    gold: list[str]


class ScoredSearch(Protocol):
    """A retriever that gives its scores: `RetrievalClient` (the run's index) or the joint stage's `IndexSearch`."""

    def search_scored(self, questions: Sequence[str], k: int) -> tuple[list[list[str]], list[list[float]]]: ...


def answer_logliks(
    model: GenModel,
    builder: PromptBuilder,
    items: Sequence[tuple[str, str, str]],
    max_target_length: int,
    batch_size: int,
    amp: Callable[[], AbstractContextManager],
) -> list[float]:
    """log p_G(answer | prompt of the question with one passage) for each (question, passage text, answer), in the
    input order. Prompts run in batches of similar length, longest first (a batch pads to its longest: passages
    range from a few dozen tokens to several hundred)."""
    src = [builder.source(q, [p]) for q, p, _ in items]
    tgt = [builder.target(a, max_target_length) for _, _, a in items]
    order = sorted(range(len(items)), key=lambda i: len(src[i]) + len(tgt[i]), reverse=True)
    device = next(model.parameters()).device
    out = [0.0] * len(items)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        b = model.arch.collate([src[i] for i in idx], [tgt[i] for i in idx], model.pad_id)
        with torch.no_grad(), amp():
            lp = model.target_logprobs(**{k: v.to(device) for k, v in b.items()}).double()
        for i, v in zip(idx, lp.tolist()):
            out[i] = v
    return out


def likelihood_rows(
    model: GenModel,
    builder: PromptBuilder,
    questions: Sequence[Question],
    passages: Mapping[str, str],
    client: ScoredSearch,
    cfg: Config,
    amp: Callable[[], AbstractContextManager],
) -> list[dict[str, Any]]:
    """One row per question: its top-k passage ids and scores, the answer's log-likelihood given each and given the
    gold passage, and the three figures (`question_nll`). The answer is the first gold answer, the one the
    generator trains on."""
    g = cfg.generator
    k = g.eval.likelihood_top_k
    hits: list[list[str]] = []
    scores: list[list[float]] = []
    for i in range(0, len(questions), g.eval.batch_size):  # queries encoded in batches, as EM's retrieval is
        ids, s = client.search_scored([e.question for e in questions[i : i + g.eval.batch_size]], k)
        hits += ids
        scores += s
    # every prompt once: the gold passage is often one of the top k
    wanted = {(e.qid, p): (e.question, passages[p], e.answers[0]) for e, h in zip(questions, hits)
              for p in [*h, *e.gold[:1]]}  # fmt: skip
    keys = list(wanted)
    ll = dict(zip(keys, answer_logliks(model, builder, [wanted[x] for x in keys], g.max_target_length,
                                       g.eval.batch_size, amp)))  # fmt: skip
    # p_R's temperature: joint.retriever_temperature, the softmax over the top-k scores that joint training fits
    # (emdr2 minimises this very marginal); one value for every variant, so their figures compare
    temperature = cfg.joint.retriever_temperature
    rows = []
    for e, h, top in zip(questions, hits, scores):
        gold = e.gold[0] if e.gold else None
        logliks = [ll[(e.qid, p)] for p in h]
        gold_ll = ll[(e.qid, gold)] if gold is not None else None
        rows.append(
            {"qid": e.qid, "answer": e.answers[0], "passages": h, "scores": top, "loglik": logliks, "gold": gold,
             "gold_loglik": gold_ll, **question_nll(top, logliks, gold_ll, temperature)}
        )  # fmt: skip
    return rows


def evaluate_likelihood(
    model: GenModel,
    builder: PromptBuilder,
    questions: Sequence[Question],
    passages: Mapping[str, str],
    client: ScoredSearch,
    cfg: Config,
    amp: Callable[[], AbstractContextManager],
    rank: int = 0,
    world: int = 1,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The mean figures ({rag_nll, rag_nll_top1, oracle_nll, n, top_k, seconds}) and the rows in the order of
    `questions`; ranks split the questions and gather the rows (every rank gets both)."""
    start = time.perf_counter()
    rows = likelihood_rows(model, builder, questions[rank::world], passages, client, cfg, amp)
    if world > 1:
        gathered: list = [None] * world
        torch.distributed.all_gather_object(gathered, rows)
        rows = [r for part in gathered for r in part]
    by_qid = {r["qid"]: r for r in rows}
    ordered = [by_qid[e.qid] for e in questions]
    summary = mean_nll(ordered)
    summary.update(top_k=float(cfg.generator.eval.likelihood_top_k), seconds=time.perf_counter() - start)
    return summary, ordered
