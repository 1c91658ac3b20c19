"""The RAG answer likelihood as the generator's evaluation computes it (ragtrain/generator/likelihood.py), on a tiny
Llama, against the sum worked out by hand: each passage's answer probability from a direct forward pass of its
prompt alone (no padding, no batching), weighted by the retriever's softmax over fixed scores."""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from ragtrain.generator.likelihood import evaluate_likelihood
from ragtrain.generator.model import build_generator, load_tokenizer
from ragtrain.generator.steps import GenExample, prompt_builder
from ragtrain.runtime.errors import ConfigError
from tests.conftest import typed
from tests.generator.tiny_llama import save_tiny_llama

PASSAGES = {
    "sb": "the denver broncos won super bowl 50.",
    "wa": "warsaw is the capital of poland. " * 3,  # prompts of other lengths in one batch: padding must not leak
    "po": "poland",
}
QUESTIONS = [
    GenExample("q1", "which team won super bowl 50?", ["the denver broncos", "broncos"], ["sb"]),
    GenExample("q2", "where is warsaw?", ["poland"], ["po"]),  # its gold passage is not among its top 2
]
# the retriever's top 2 of each question and their scores (query . passage), best first
FOUND = {"which team won super bowl 50?": (["sb", "wa"], [0.62, 0.55]), "where is warsaw?": (["wa", "sb"], [0.4, 0.1])}


class FixedSearch:
    """A retriever whose top k and scores are fixed (the index is not what this test measures)."""

    def search_scored(self, questions, k):
        return [FOUND[q][0][:k] for q in questions], [FOUND[q][1][:k] for q in questions]


def _direct_loglik(model, builder, question: str, passage: str, answer: str, max_target: int) -> float:
    """log p(answer | the prompt of `question` with `passage` alone), summed token by token from one forward pass."""
    src = builder.source(question, [passage])
    tgt = builder.target(answer, max_target)
    with torch.no_grad():
        logp = torch.log_softmax(model.hf(input_ids=torch.tensor([src + tgt])).logits[0].double(), dim=-1)
    return sum(logp[len(src) - 1 + j, t].item() for j, t in enumerate(tgt))  # token t from the one before it


def test_the_rag_likelihood_is_the_retriever_weighted_sum_over_two_passages(tmp_path: Path) -> None:
    llama = save_tiny_llama(tmp_path / "llama", chat=False)
    cfg = typed(
        [f"output_dir={tmp_path / 'out'}", "generator=smollm2", f"generator.model={llama}", "generator.prompt=plain",
         "generator.train.precision=fp32", "generator.eval.likelihood_top_k=2", "generator.eval.batch_size=3",
         "joint.retriever_temperature=0.05"]
    )  # fmt: skip
    g = cfg.generator
    tok = load_tokenizer(g)
    torch.manual_seed(0)
    model = build_generator(g, tok).eval()
    builder = prompt_builder(g, tok)
    summary, rows = evaluate_likelihood(model, builder, QUESTIONS, PASSAGES, FixedSearch(), cfg, nullcontext)
    assert [r["qid"] for r in rows] == ["q1", "q2"] and summary["n"] == 2 and summary["top_k"] == 2
    for e, row in zip(QUESTIONS, rows):
        ids, scores = FOUND[e.question]
        ll = [_direct_loglik(model, builder, e.question, PASSAGES[p], e.answers[0], g.max_target_length) for p in ids]
        gold = _direct_loglik(model, builder, e.question, PASSAGES[e.gold[0]], e.answers[0], g.max_target_length)
        # by hand: p_R = exp(s_i / 0.05) / (exp(s_1 / 0.05) + exp(s_2 / 0.05)), then sum_i p_R,i p_G,i
        w = [math.exp(s / 0.05) for s in scores]
        marginal = sum(wi / sum(w) * math.exp(li) for wi, li in zip(w, ll))
        assert row["passages"] == ids and row["scores"] == pytest.approx(scores)
        assert row["loglik"] == pytest.approx(ll, abs=1e-4) and row["gold_loglik"] == pytest.approx(gold, abs=1e-4)
        assert row["rag_nll"] == pytest.approx(-math.log(marginal), abs=1e-4)
        assert row["rag_nll_top1"] == pytest.approx(-ll[0], abs=1e-4)
        assert row["oracle_nll"] == pytest.approx(-gold, abs=1e-4)
        assert min(-li for li in ll) - 1e-9 <= row["rag_nll"] <= max(-li for li in ll) + 1e-9
    for key in ("rag_nll", "rag_nll_top1", "oracle_nll"):
        assert summary[key] == pytest.approx((rows[0][key] + rows[1][key]) / 2)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["generator.eval.likelihood_top_k=-1"], "generator.eval.likelihood_top_k must be >= 0"),
        (["generator.eval.max_questions=64", "generator.eval.likelihood_questions=10"],
         r"generator.eval.likelihood_questions must be 0 \(every question\) or at least generator.eval.max_questions"),
        (["generator.eval.likelihood_questions=100"], r"at least generator.eval.max_questions \(all\)"),
    ],
)  # fmt: skip
def test_likelihood_settings_that_cannot_hold_em_questions_are_refused(tmp_path: Path, overrides, match) -> None:
    with pytest.raises(ConfigError, match=match):
        typed([f"output_dir={tmp_path}", *overrides])
