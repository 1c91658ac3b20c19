"""The generator's answer log-likelihood per (question, passage) pair, on a tiny Llama, against a direct forward
pass of each prompt alone (no padding, no batching)."""

from __future__ import annotations

import torch

from ragtrain.config.generator import GeneratorConfig, PromptStyle
from ragtrain.generator.model import build_generator, load_tokenizer
from ragtrain.generator.steps import prompt_builder
from ragtrain.joint.likelihood import answer_loglik
from tests.generator.tiny_llama import save_tiny_llama


def test_answer_loglik_matches_a_direct_forward_pass(tmp_path) -> None:
    g = GeneratorConfig(
        arch="causal", model=str(save_tiny_llama(tmp_path / "llama")), prompt=PromptStyle.chat, dropout=0.0
    )
    tok = load_tokenizer(g)
    torch.manual_seed(0)
    model = build_generator(g, tok).eval()
    builder = prompt_builder(g, tok)
    questions = ["which team won super bowl 50?", "where is warsaw?"]
    passages = [  # prompts of different lengths: padding must not leak into the sums
        ["the denver broncos won super bowl 50.", "warsaw is the capital of poland."],
        ["warsaw is the capital of poland. " * 3, "poland"],
    ]
    answers = ["the denver broncos", "poland"]
    ll = answer_loglik(model, builder, questions, passages, answers, g.max_target_length)
    assert ll.shape == (2, 2) and not ll.requires_grad
    for b in range(2):
        for i in range(2):
            src = builder.source(questions[b], [passages[b][i]])
            tgt = builder.target(answers[b], g.max_target_length)
            ids = torch.tensor([src + tgt])
            with torch.no_grad():
                logp = torch.log_softmax(model.hf(input_ids=ids).logits[0].double(), dim=-1)
            direct = sum(logp[len(src) - 1 + j, t].item() for j, t in enumerate(tgt))  # token t from the one before
            assert abs(ll[b, i].item() - direct) < 1e-4, (b, i, ll[b, i].item(), direct)
    # with grad=True the likelihood is differentiable w.r.t. the generator
    ll = answer_loglik(model, builder, questions, passages, answers, g.max_target_length, grad=True)
    ll.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
