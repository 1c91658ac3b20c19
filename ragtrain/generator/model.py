"""Generator models: BERT2BERT from one BERT checkpoint, any seq2seq (T5-style) or causal LM, tiny ones from a config.

`GenModel` gives every architecture the same two calls: `forward(batch)` -> summed token cross-entropy (fp32)
and `generate(batch, ...)` -> answer token ids. `collate` builds the batch (padding, -100 label masking).
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ragtrain.config.generator import PACKAGED, Arch, GeneratorConfig
from ragtrain.embed.model import minilm_path
from ragtrain.generator.packaged import packaged_folder

if TYPE_CHECKING:
    from transformers import PreTrainedModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from installed packages, local paths or the cache
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Config keys that hold a dropout probability, across the model families we build (BERT, T5, GPT-2, Llama, ...).
_DROPOUT_KEYS = (
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "dropout_rate",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "attention_dropout",
    "dropout",
    "activation_dropout",
    "classifier_dropout",
)


def resolve_path(name: str) -> str:
    """ "minilm"/"tiny" -> the shipped all-MiniLM-L6-v2 folder; a packaged model ("smollm2") -> its dequantised
    HF folder (made on first use); anything else is a local path or cached name."""
    if name in PACKAGED:
        return packaged_folder(name)
    return minilm_path() if name in ("minilm", "tiny") else name


def load_tokenizer(g: GeneratorConfig):  # -> transformers.PreTrainedTokenizerBase
    """The generator's tokenizer (tiny models and BERT2BERT-from-MiniLM use MiniLM's WordPiece vocabulary)."""
    from transformers import AutoTokenizer  # lazy: transformers is heavy (~1 s); this module imports without it

    return AutoTokenizer.from_pretrained(resolve_path(g.tokenizer or g.model))


def _set_dropout(config: Any, p: float | None) -> None:
    if p is None:
        return
    for key in _DROPOUT_KEYS:
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, p)


def _bert2bert(g: GeneratorConfig, tok) -> PreTrainedModel:
    """EncoderDecoderModel with both sides from one BERT checkpoint (Rothe et al. 2020's BERT2BERT)."""
    # lazy: transformers is heavy (~1 s); this module imports without it
    from transformers import BertConfig, BertLMHeadModel, BertModel, EncoderDecoderModel

    path = resolve_path(g.model)
    enc_cfg = BertConfig.from_pretrained(path)
    if enc_cfg.model_type != "bert":
        raise ValueError(f"generator.arch=bert2bert needs a BERT checkpoint, {path} is {enc_cfg.model_type!r}")
    if g.bert2bert("encoder_layers"):
        enc_cfg.num_hidden_layers = min(g.bert2bert("encoder_layers"), enc_cfg.num_hidden_layers)
    _set_dropout(enc_cfg, g.dropout)
    encoder = BertModel.from_pretrained(path, config=enc_cfg, add_pooling_layer=False)  # no pooler: DDP-unused
    dec_cfg = BertConfig.from_pretrained(path, is_decoder=True, add_cross_attention=True)
    # A shallow decoder: answers are a few tokens copied from the source, so depth buys little and costs time.
    dec_cfg.num_hidden_layers = min(g.bert2bert("decoder_layers"), dec_cfg.num_hidden_layers)
    _set_dropout(dec_cfg, g.dropout)
    decoder = BertLMHeadModel.from_pretrained(path, config=dec_cfg)  # cross-attention: new, seeded init
    # pretrained Q/K/V/output instead of noise: the new block starts useful
    if g.bert2bert("cross_attention_init") == "self":
        for layer in decoder.bert.encoder.layer:
            layer.crossattention.load_state_dict(layer.attention.state_dict())
    # one 30k x d matrix for encoder input, decoder input and output: fewer params to sync
    if g.bert2bert("tie_embeddings"):
        decoder.bert.embeddings.word_embeddings = encoder.embeddings.word_embeddings
        decoder.cls.predictions.decoder.weight = encoder.embeddings.word_embeddings.weight
    model = EncoderDecoderModel(encoder=encoder, decoder=decoder)
    model.config.decoder_start_token_id = tok.cls_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.sep_token_id
    return model


def _tiny(g: GeneratorConfig, tok) -> PreTrainedModel:
    """A small T5 (seq2seq) or GPT-2 (causal) built from a config with the tokenizer's vocabulary: no download."""
    # lazy: transformers is heavy (~1 s); this module imports without it
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        T5Config,
        T5ForConditionalGeneration,
    )

    t, p = g.tiny, 0.1 if g.dropout is None else g.dropout
    eos = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
    if g.arch == Arch.seq2seq:
        cfg = T5Config(
            vocab_size=len(tok),
            d_model=t.d_model,
            d_kv=t.d_model // t.num_heads,
            d_ff=t.d_ff,
            num_layers=t.num_layers,
            num_decoder_layers=t.num_layers,
            num_heads=t.num_heads,
            dropout_rate=p,
            pad_token_id=tok.pad_token_id,
            eos_token_id=eos,
            decoder_start_token_id=tok.pad_token_id,
        )
        return T5ForConditionalGeneration(cfg)
    cfg = GPT2Config(
        vocab_size=len(tok),
        n_embd=t.d_model,
        n_layer=t.num_layers,
        n_head=t.num_heads,
        n_inner=t.d_ff,
        n_positions=max(512, g.max_source_length + g.max_target_length),
        resid_pdrop=p,
        embd_pdrop=p,
        attn_pdrop=p,
        bos_token_id=tok.cls_token_id,
        eos_token_id=eos,
        pad_token_id=tok.pad_token_id,
    )
    return GPT2LMHeadModel(cfg)


def _pretrained(g: GeneratorConfig) -> PreTrainedModel:
    """Any HF seq2seq or causal LM by local path or cached name."""
    # lazy: transformers is heavy (~1 s); this module imports without it
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    path = resolve_path(g.model)
    cfg = AutoConfig.from_pretrained(path)
    _set_dropout(cfg, g.dropout)
    cls = AutoModelForSeq2SeqLM if g.arch == Arch.seq2seq else AutoModelForCausalLM
    return cls.from_pretrained(path, config=cfg)


class FirstLineDone:
    """Generation stops for a sequence once its answer has a finished first line: text, then a newline.
    `AnswerDecoder` keeps only that line, so what follows would be generated for nothing (a model may go on after
    its answer line without EOS; a batch runs until its last sequence stops). Leading whitespace and newlines do
    not count: the decoder skips them too. A transformers `StoppingCriteria` (duck-typed: one bool per sequence)."""

    def __init__(self, tokenizer, prompt_len: int):
        self.tok, self.prompt_len = tokenizer, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        done = [
            "\n" in self.tok.decode(row, skip_special_tokens=True).lstrip()
            for row in input_ids[:, self.prompt_len :].tolist()
        ]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class GenModel(nn.Module):
    """One interface over the three architectures: summed target cross-entropy, and generation."""

    def __init__(self, hf: PreTrainedModel, arch: Arch, tokenizer):
        super().__init__()
        self.hf, self.arch, self.tokenizer = hf, Arch(arch), tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_id = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
        cfg = hf.config
        # transformers' causal LMs take `logits_to_keep` (positions whose logits are computed) since 4.50
        self.keeps_logits = self.arch == Arch.causal and "logits_to_keep" in inspect.signature(hf.forward).parameters
        start = getattr(cfg, "decoder_start_token_id", None)
        self.start_id: int = start if start is not None else self.pad_id

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of the target tokens' cross-entropy in fp32 (callers divide by the global token count)."""
        return -self.target_logprobs(input_ids, attention_mask, labels).sum()

    def target_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """Per sequence, the sum of its target tokens' log-probabilities in fp32 (shape [batch]): log p(target |
        source) with the target's EOS (the answer likelihood of joint training; -forward() summed)."""
        if self.arch == Arch.causal:  # labels already hold -100 over the prompt; predict token t+1 from t
            target = labels[:, 1:]
            if self.keeps_logits:
                # Only the positions that predict a target token (in any row) go through the LM head: over a
                # whole prompt, SmolLM2's 49k x 576 head is a fifth of the step and its fp32 logits hundreds of MB.
                keep = (target >= 0).any(dim=0).nonzero().flatten()
                logits = self.hf(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits
                target = target[:, keep]
            else:
                logits = self.hf(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        else:
            dec_in = labels.new_full(labels.shape, self.pad_id)
            dec_in[:, 0] = self.start_id
            dec_in[:, 1:] = labels[:, :-1].masked_fill(labels[:, :-1] < 0, self.pad_id)
            logits = self.hf(
                input_ids=input_ids,
                attention_mask=attention_mask,
                decoder_input_ids=dec_in,
                decoder_attention_mask=(labels >= 0).long(),
            ).logits
            target = labels
        nll = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="none"
        )
        return -nll.view(target.shape).sum(dim=1)

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_beams: int = 1, max_new_tokens: int = 16
    ) -> list[list[int]]:
        """Greedy (num_beams=1) or beam-search answers: token ids after the prompt, up to and excluding EOS (greedy
        sequences stop at the end of their first line, see FirstLineDone)."""
        from transformers import StoppingCriteriaList  # lazy, as in build_generator

        prompt_len = input_ids.shape[1] if self.arch == Arch.causal else 0
        # Greedy only: there a stopped sequence's first line is what it would have been. A beam ended at its newline
        # would compete as a finished hypothesis, scored at that length, and could change which beam wins.
        stop = [FirstLineDone(self.tokenizer, prompt_len)] if num_beams == 1 else []
        out = self.hf.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            num_beams=num_beams,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            decoder_start_token_id=self.start_id if self.arch != Arch.causal else None,
            stopping_criteria=StoppingCriteriaList(stop),
        )
        if self.arch == Arch.causal:  # decoder-only output repeats the (left-padded) prompt first
            out = out[:, input_ids.shape[1] :]
        elif out.shape[1] and bool((out[:, 0] == self.start_id).all()):
            out = out[:, 1:]
        answers = []
        for row in out.tolist():
            answers.append(row[: row.index(self.eos_id)] if self.eos_id in row else row)
        return answers


def build_generator(g: GeneratorConfig, tokenizer) -> GenModel:
    """Build the configured generator (call torch.manual_seed first: new layers get a seeded init)."""
    import transformers  # lazy: transformers is heavy (~1 s); this module imports without it

    transformers.logging.set_verbosity_error()  # partial-checkpoint load reports are expected here (decoder)
    if g.arch == Arch.bert2bert:
        hf = _bert2bert(g, tokenizer)
    elif g.model == "tiny":
        hf = _tiny(g, tokenizer)
    else:
        hf = _pretrained(g)
    if g.dropout is not None:  # modules that read p at build time
        for m in hf.modules():
            if isinstance(m, nn.Dropout):
                m.p = g.dropout
    return GenModel(hf, g.arch, tokenizer)


def collate(
    sources: Sequence[list[int]], targets: Sequence[list[int]], arch: Arch, pad_id: int, for_generation: bool = False
) -> dict[str, torch.Tensor]:
    """Pad a batch. Seq2seq: sources right-padded, labels = targets (-100 pad). Causal: prompt + target in one
    sequence with -100 over the prompt (right-padded), or the prompt alone left-padded for generation."""
    if arch == Arch.causal:
        seqs = list(sources) if for_generation else [s + t for s, t in zip(sources, targets)]
        n = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), n), dtype=torch.long)
        labels = torch.full((len(seqs), n), -100, dtype=torch.long)
        for i, s in enumerate(seqs):
            if for_generation:  # left padding: the next token follows the prompt's last token directly
                ids[i, n - len(s) :], mask[i, n - len(s) :] = torch.tensor(s), 1
            else:
                ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
                labels[i, len(sources[i]) : len(s)] = torch.tensor(targets[i])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    n = max(len(s) for s in sources)
    ids = torch.full((len(sources), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sources), n), dtype=torch.long)
    for i, s in enumerate(sources):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    m = max((len(t) for t in targets), default=1)
    labels = torch.full((len(sources), max(1, m)), -100, dtype=torch.long)
    for i, t in enumerate(targets):
        labels[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def untie_encoder_decoder(hf: Any) -> None:
    """BERT2BERT with generator.tie_embeddings shares one word-embedding matrix between the encoder and the decoder,
    a tie `save_pretrained` does not know and refuses to save: give the decoder its own copy (same values, so the
    exported model computes the same logits) and keep the decoder's own input/output tie, which transformers
    declares."""
    # lazy: transformers is heavy (~1 s); this module imports without it
    from transformers import EncoderDecoderModel

    if not isinstance(hf, EncoderDecoderModel):
        return
    enc, dec = hf.encoder.get_input_embeddings(), hf.decoder.get_input_embeddings()
    if dec.weight is not enc.weight:
        return
    copy = torch.nn.Embedding.from_pretrained(enc.weight.detach().clone(), freeze=False, padding_idx=enc.padding_idx)
    hf.decoder.set_input_embeddings(copy)
    out = hf.decoder.get_output_embeddings()
    if out is not None and out.weight is enc.weight:
        out.weight = copy.weight


class AnswerDecoder:
    """Token ids -> answer text: the first non-empty line (an answer is a span; a pretrained chat model goes on
    with explanations on later lines). WordPiece splits punctuation ("hurdy-gurdy" -> "hurdy - gurdy"), which SQuAD
    normalisation would then score as two words against the gold's one; re-join where the tokenizer is lossy."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        probe = tokenizer.decode(tokenizer("a-b o'c", add_special_tokens=False)["input_ids"])
        self.rejoin = probe.replace(" ", "") == "a-bo'c" and probe != "a-b o'c"

    def __call__(self, ids: Sequence[int]) -> str:
        text = self.tok.decode(list(ids), skip_special_tokens=True).strip().split("\n", 1)[0].strip()
        return re.sub(r" ?([-'/]) ?", r"\1", text) if self.rejoin else text
