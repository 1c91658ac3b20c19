"""Generator models: the three architectures' loss / generate calls, batching, answer decoding, checkpoints."""

from __future__ import annotations

import pytest
import torch

from ragtrain.config import Config
from ragtrain.config.generator import GeneratorConfig
from ragtrain.generator.archs.base import build_arch
from ragtrain.generator.model import (
    AnswerDecoder,
    build_generator,
    load_tokenizer,
)
from ragtrain.generator.prompt import PromptBuilder, Template
from ragtrain.generator.saved import WEIGHTS_FILES, load_generator, save_generator


def _batch(g: GeneratorConfig, tok, for_generation: bool = False) -> dict[str, torch.Tensor]:
    arch = build_arch(g.arch)
    b = PromptBuilder(tok, 48, 0, Template("question:", "context:"), causal=arch.causal)
    src = [b.source("who plays the oboe?", ["ann plays the oboe."]), b.source("when?", [])]
    tgt = [b.target("oboe", 8), b.target("in 1859", 8)]
    return arch.collate(src, tgt, tok.pad_token_id, for_generation)


@pytest.mark.parametrize("arch", ["seq2seq", "causal"])
def test_tiny_models_loss_and_generate(arch: str) -> None:
    g = GeneratorConfig(arch=arch, model="tiny", dropout=0.0)
    tok = load_tokenizer(g)
    torch.manual_seed(0)
    m = build_generator(g, tok).eval()
    b = _batch(g, tok)
    n_target = int((b["labels"] >= 0).sum())
    assert n_target == 2 + 3  # oboe [SEP] | in 1859 [SEP]: -100 everywhere else
    loss = m(**b) / n_target
    assert 5 < loss.item() < 15  # ~ln(30522) = 10.3 at init
    gb = _batch(g, tok, for_generation=True)
    for beams in (1, 2):
        out = m.generate(gb["input_ids"], gb["attention_mask"], num_beams=beams, max_new_tokens=4)
        assert len(out) == 2 and all(len(o) <= 4 for o in out)
    if arch == "causal":  # generation input is left-padded; training input right-padded with -100 over the prompt
        assert gb["attention_mask"][1, 0] == 0 and b["attention_mask"][1, -1] == 0
        assert (b["labels"][0, : int(b["attention_mask"][0].sum()) - 2] == -100).all()


def test_bert2bert_shares_one_embedding_matrix() -> None:
    g = GeneratorConfig(arch="bert2bert", model="minilm", decoder_layers=1, encoder_layers=2)
    tok = load_tokenizer(g)
    m = build_generator(g, tok)
    hf = m.hf
    w = hf.encoder.embeddings.word_embeddings.weight
    assert hf.decoder.bert.embeddings.word_embeddings.weight is w
    assert hf.decoder.cls.predictions.decoder.weight is w
    assert len(hf.encoder.encoder.layer) == 2 and len(hf.decoder.bert.encoder.layer) == 1
    # the decoder's self-attention comes from MiniLM's layer 0; its cross-attention is new
    assert torch.equal(
        hf.decoder.bert.encoder.layer[0].attention.self.query.weight,
        hf.encoder.encoder.layer[0].attention.self.query.weight,
    )


@pytest.mark.parametrize("arch,model", [("seq2seq", "tiny"), ("causal", "tiny"), ("bert2bert", "minilm")])
def test_saved_generator_is_a_transformers_folder_that_round_trips(tmp_path, arch: str, model: str) -> None:
    """save_generator writes save_pretrained's safetensors + the tokenizer (no pickle); plain transformers loads it,
    and load_generator gives the same weights and answers."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, EncoderDecoderModel

    cfg = Config()
    layers = {"decoder_layers": 1, "encoder_layers": 1} if arch == "bert2bert" else {}
    cfg.generator = GeneratorConfig(arch=arch, model=model, dropout=0.0, **layers)
    tok = load_tokenizer(cfg.generator)
    torch.manual_seed(0)
    m = build_generator(cfg.generator, tok)
    with torch.no_grad():  # move off the init so a reload of fresh weights could not pass by accident
        for p in m.parameters():
            p.add_(0.01 * torch.randn_like(p))
    want = {k: v.clone() for k, v in m.state_dict().items()}
    path = save_generator(m, tok, tmp_path)
    assert path.name in WEIGHTS_FILES and path.read_bytes()[:1] != b"\x80"  # safetensors, not a pickle stream
    cls = {"seq2seq": AutoModelForSeq2SeqLM, "causal": AutoModelForCausalLM, "bert2bert": EncoderDecoderModel}[arch]
    plain = cls.from_pretrained(str(tmp_path))
    assert AutoTokenizer.from_pretrained(str(tmp_path)).vocab == tok.vocab
    torch.manual_seed(1)
    loaded = load_generator(cfg, tmp_path)
    got = loaded.state_dict()
    for k, v in want.items():
        assert torch.equal(v, got[k]), k
    assert all(torch.equal(v, plain.state_dict()[k.removeprefix("hf.")]) for k, v in want.items())
    if arch == "bert2bert":  # the encoder/decoder tie is saved as two equal matrices, the decoder's own tie kept
        dec = loaded.hf.decoder
        assert dec.cls.predictions.decoder.weight is dec.bert.embeddings.word_embeddings.weight
        assert torch.equal(
            dec.bert.embeddings.word_embeddings.weight, loaded.hf.encoder.embeddings.word_embeddings.weight
        )
    gb = _batch(cfg.generator, tok, for_generation=True)
    m.eval()
    assert m.generate(gb["input_ids"], gb["attention_mask"]) == loaded.generate(gb["input_ids"], gb["attention_mask"])


def test_answer_decoder_rejoins_wordpiece_punctuation() -> None:
    tok = load_tokenizer(GeneratorConfig())
    dec = AnswerDecoder(tok)
    assert dec.rejoin
    for text, want in [
        ("Hurdy-gurdy", "hurdy-gurdy"),
        ("Graqui Shipping Company", "graqui shipping company"),
        ("O'Neil", "o'neil"),
        ("1859", "1859"),
    ]:
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.sep_token_id]
        assert dec(ids) == want
