"""Distillation: a student (same or smaller output dim) learns to reproduce a reference encoder's vectors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from ragtrain.config.retriever import RetrieverConfig, TinyEncoderConfig
from ragtrain.data import make_synthetic
from ragtrain.embed.align import embedding_drift
from ragtrain.embed.model import build_encoder, encode_texts, load_tokenizer
from ragtrain.repair.distill import StudentEncoder, distill


# same-dimension distillation also runs in the vector_avg pipeline test (index.distill_steps)
@pytest.mark.parametrize(
    "out_dim",
    [
        pytest.param(
            None,
            marks=pytest.mark.slow(
                reason="same-dimension distillation: the same code as the 16-dimension case that runs by default"
            ),
        ),
        16,
    ],
)
def test_student_reproduces_reference(out_dim) -> None:
    texts = [p.full_text() for p in make_synthetic(num_entities=60).corpus.values()]
    train, held_out = texts[:240], texts[240:]
    ref_cfg = RetrieverConfig(model="tiny", tiny=TinyEncoderConfig(hidden_size=32, num_layers=2, num_heads=2))
    torch.manual_seed(0)
    reference = build_encoder(ref_cfg)
    tok = load_tokenizer(ref_cfg)
    ref_train = encode_texts(reference, tok, train, 48).numpy()
    ref_held = encode_texts(reference, tok, held_out, 48).numpy()

    torch.manual_seed(1)  # a different init: the student starts far from the reference
    student = StudentEncoder(build_encoder(ref_cfg), out_dim)
    untrained = copy.deepcopy(student)
    proj, losses = distill(student, tok, train, ref_train, 48, steps=150, lr=3e-3)
    target = proj(ref_held)
    before = embedding_drift(encode_texts(untrained, tok, held_out, 48).numpy(), target)
    after = embedding_drift(encode_texts(student, tok, held_out, 48).numpy(), target)
    assert student.dim == (out_dim or 32)
    assert np.mean(losses[-10:]) < 0.25 * np.mean(losses[:10])
    assert after < 0.25 * before and after < 0.05


def test_distill_gives_queries_and_passages_their_prefixes() -> None:
    """With retriever.*_prefix set, each text is tokenised under its own role (none given: a clear error)."""
    from ragtrain.embed.model import tokenize

    cfg = RetrieverConfig(
        model="tiny",
        query_prefix="query: ",
        passage_prefix="passage: ",
        tiny=TinyEncoderConfig(hidden_size=32, num_layers=1, num_heads=2),
    )
    tok = load_tokenizer(cfg)
    texts, roles = ["a passage about mills", "which mill?"], ["passage", "query"]
    torch.manual_seed(0)
    reference = build_encoder(cfg).eval()
    with torch.no_grad():  # the reference vectors of each text as encoding makes them: prefix by role
        ref = torch.cat([reference(**tokenize(tok, [t], 32, r)) for t, r in zip(texts, roles)]).numpy()
    with pytest.raises(ValueError, match="role"):
        distill(StudentEncoder(copy.deepcopy(reference)), tok, texts, ref, 32, steps=1)
    student = StudentEncoder(copy.deepcopy(reference))
    _, losses = distill(student, tok, texts, ref, 32, steps=1, lr=0.0, roles=roles)
    assert losses[0] < 1e-10  # the student is the reference: zero loss only when every text got its own prefix
    _, swapped = distill(
        StudentEncoder(copy.deepcopy(reference)), tok, texts, ref, 32, steps=1, lr=0.0, roles=roles[::-1]
    )
    assert swapped[0] > 1e-4
