"""Every embedding comes from one function: the corpus actors' class, the in-process and query encoders, the live
refresh's pool and the encode function the trainer's probes and validation call give the same vectors for the
same texts, and no module outside ragtrain/embed runs an encoder's forward to embed."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from ragtrain.config.retriever import Precision, RetrieverConfig, TinyEncoderConfig
from ragtrain.embed.encoders import EncodeBatch, LocalEncoder, QueryEncoder
from ragtrain.embed.model import build_encoder, encode_texts, load_tokenizer

PACKAGE = Path(__file__).resolve().parents[2] / "ragtrain"
TEXTS = [f"passage {i}: " + "words " * (i % 7) + "end" for i in range(23)]
# The only calls of a model's forward outside ragtrain/embed: the training steps of the retriever and of joint
# training (a loss needs the graph, which encode_texts' no-grad embedding must not keep) and the cross-encoder
# reranker (a score per pair, not a vector).
FORWARD_ALLOWED = {
    ("retriever/train.py", "QPEncoder.forward"),
    ("joint/train.py", "JointModel.forward"),
    ("reranker/model.py", "score_pairs"),
}


@pytest.fixture(scope="module")
def tiny():
    cfg = RetrieverConfig(
        model="tiny",
        tiny=TinyEncoderConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
        query_prefix="query: ",
        passage_prefix="passage: ",
    )
    torch.manual_seed(0)
    return cfg, build_encoder(cfg).state_dict()


def test_every_encoder_gives_the_vectors_of_encode_texts(tiny) -> None:
    cfg, weights = tiny
    model = build_encoder(cfg)
    model.load_state_dict(weights)
    for role in ("query", "passage"):  # each with its own prefix
        want = encode_texts(model, load_tokenizer(cfg), TEXTS, 24, 5, Precision.fp32, role=role).numpy()
        batch = EncodeBatch(cfg, weights, 24, batch_size=8)  # the corpus actors' class, run here
        batch.role = role
        got = {
            "EncodeBatch": batch.encode(TEXTS),
            # the index shards' encoder of the live refresh's rounds
            "LocalEncoder": LocalEncoder(cfg, weights, batch_size=3).encode(TEXTS, 24, role),
            "QueryEncoder": QueryEncoder(cfg, [weights], batch_size=16).encode(TEXTS, 24, role),
        }
        assert np.abs(want).sum() > 0
        for name, vecs in got.items():  # batch sizes differ: only float rounding may
            np.testing.assert_allclose(vecs, want, rtol=0, atol=1e-5, err_msg=f"{name} ({role})")


def _forward_calls(path: Path) -> list[str]:
    """Functions of `path` that call `<something named *model or *encoder>(**inputs)`: a forward pass."""
    tree = ast.parse(path.read_text())
    found: list[str] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope + [child.name] if isinstance(child, ast.FunctionDef | ast.ClassDef) else scope
            if isinstance(child, ast.Call) and any(k.arg is None for k in child.keywords):
                f = child.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name.endswith(("model", "encoder")):
                    found.append(".".join(scope))
            visit(child, inner)

    visit(tree, [])
    return found


def test_no_module_outside_embed_runs_an_encoder_forward_to_embed() -> None:
    calls = {
        (str(p.relative_to(PACKAGE)), where)
        for p in PACKAGE.rglob("*.py")
        if p.parent.name != "embed"
        for where in _forward_calls(p)
    }
    assert calls == FORWARD_ALLOWED
    defined = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py") if "\ndef encode_texts(" in p.read_text()]
    assert defined == [Path("embed/model.py")]


def test_one_function_fills_every_faiss_index() -> None:
    """Vector files, an index shard's row range, a live shard's rebuild and an in-memory matrix: every FAISS
    `add` in ragtrain is `faiss_index.build_from_chunks`'s."""
    adds = {
        (str(p.relative_to(PACKAGE)), i)
        for p in PACKAGE.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines())
        if "index.add(" in line
    }
    assert [f for f, _ in adds] == ["index/faiss_index.py"]


def test_a_bf16_encoder_gives_the_same_vectors_from_a_snapshot_sent_as_bf16(tiny) -> None:
    """The live refresh sends shards that encode in bf16 their snapshot as bf16 (half the bytes per round): they cast
    it on load anyway, so the vectors are the same bits as from the fp32 snapshot."""
    cfg, weights = tiny
    texts = ["a short passage", "another, somewhat longer passage about a thing"]
    half = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()}
    sent = LocalEncoder(cfg, half, batch_size=2, precision="bf16").encode(texts, 24, "passage")
    kept = LocalEncoder(cfg, dict(weights), batch_size=2, precision="bf16").encode(texts, 24, "passage")
    assert sent.dtype == kept.dtype and np.array_equal(sent, kept)
    fp32 = LocalEncoder(cfg, dict(weights), batch_size=2, precision="fp32").encode(texts, 24, "passage")
    assert not np.array_equal(sent, fp32)  # bf16 weights do change the vectors: the check above can fail
