"""The bi-encoder reproduces sentence-transformers' all-MiniLM-L6-v2 vectors (the MTEB reference setting)."""

from __future__ import annotations

import pytest
import torch

from ragtrain.config.retriever import Precision, RetrieverConfig
from ragtrain.embed.model import build_encoder, encode_texts, load_tokenizer, minilm_path
from tests.conftest import SCIFACT


@pytest.fixture(scope="module")
def texts() -> list[str]:
    if SCIFACT.exists():
        from ragtrain.data import load_beir

        data = load_beir(SCIFACT, split="dev")
        return [p.full_text() for p in list(data.corpus.values())[:48]]
    from ragtrain.data import make_synthetic

    return [p.full_text() for p in list(make_synthetic(num_entities=20).corpus.values())[:48]]


@pytest.fixture(scope="module")
def minilm():
    cfg = RetrieverConfig(model="minilm", passage_max_length=256)
    return cfg, build_encoder(cfg), load_tokenizer(cfg)


def test_matches_sentence_transformers(texts, minilm) -> None:
    from sentence_transformers import SentenceTransformer

    cfg, model, tok = minilm
    ours = encode_texts(model, tok, texts, cfg.passage_max_length, batch_size=16)
    st = SentenceTransformer(minilm_path(), device="cpu")
    assert st.max_seq_length == 256
    ref = torch.from_numpy(st.encode(texts, batch_size=16, normalize_embeddings=True))
    cos = (ours * ref).sum(-1)
    assert cos.min().item() > 0.99999
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(texts)))


# bf16 is emulated on a CPU without bf16 units (AVX2: ~6x fp32's time): the bf16 checks encode a few passages, cut
BF16_TEXTS, BF16_TOKENS = 8, 128


def test_bf16_close_to_fp32(texts, minilm) -> None:
    cfg, model, tok = minilm
    texts = texts[:BF16_TEXTS]
    fp32 = encode_texts(model, tok, texts, BF16_TOKENS, batch_size=16)
    bf16 = encode_texts(model, tok, texts, BF16_TOKENS, batch_size=16, precision=Precision.bf16)
    assert bf16.dtype == torch.float32
    assert (fp32 * bf16).sum(-1).min().item() > 0.999


def test_corpus_encoder_holds_bf16_weights_and_stays_close_to_fp32(texts, minilm) -> None:
    """index.precision=bf16: the embed-only encoder (EncodeBatch, the query side too) holds bf16 weights instead of
    re-casting them under autocast on every forward; its vectors stay fp32 unit vectors close to fp32's."""
    from ragtrain.embed.encoders import EncodeBatch

    cfg, model, tok = minilm
    texts = texts[:BF16_TEXTS]
    fp32 = encode_texts(model, tok, texts, BF16_TOKENS, batch_size=16)
    enc = EncodeBatch(cfg, model.state_dict(), BF16_TOKENS, batch_size=16, precision="bf16")
    assert {p.dtype for p in enc.model.parameters()} == {torch.bfloat16}
    bf16 = torch.from_numpy(enc.encode(texts))
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16.norm(dim=-1), torch.ones(len(texts)))
    assert (fp32 * bf16).sum(-1).min().item() > 0.999
    assert not torch.equal(fp32, bf16)  # bf16 really ran
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the source model is untouched
    fp32_enc = EncodeBatch(cfg, model.state_dict(), BF16_TOKENS, batch_size=16, precision="fp32")
    assert {p.dtype for p in fp32_enc.model.parameters()} == {torch.float32}


def test_order_preserved_under_length_sorting(minilm) -> None:
    cfg, model, tok = minilm
    texts = ["a short one", "a much longer text " * 20, "medium length text here"]
    together = encode_texts(model, tok, texts, 64, batch_size=2)
    alone = torch.cat([encode_texts(model, tok, [t], 64) for t in texts])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-4)


def test_tiny_encoder_has_no_unused_parameters() -> None:
    torch.manual_seed(0)
    enc = build_encoder(RetrieverConfig(model="tiny"))
    ids = torch.randint(5, 100, (2, 7))
    enc(ids, torch.ones_like(ids)).sum().backward()
    assert all(p.grad is not None for p in enc.parameters())


def test_minilm_has_no_unused_parameters(minilm) -> None:
    """DDP needs every parameter to get a gradient: the unused [CLS] pooler is dropped."""
    _, model, _ = minilm
    ids = torch.randint(1000, 2000, (2, 5))
    model.zero_grad()
    model(ids, torch.ones_like(ids)).sum().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
