"""Generator models: BERT2BERT from one BERT checkpoint, any seq2seq (T5-style) or causal LM, tiny ones from a config.

`GenModel` gives every architecture (`generator.arch`, a class of ragtrain/generator/archs/) the same two calls:
`forward(batch)` -> summed token cross-entropy (fp32) and `generate(batch, ...)` -> answer token ids;
`model.arch.collate` builds the batch (padding, -100 label masking).
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

from ragtrain.config.generator import GeneratorConfig
from ragtrain.generator.archs.base import Architecture, build_arch, resolve_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from installed packages, local paths or the cache
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_tokenizer(g: GeneratorConfig):  # -> transformers.PreTrainedTokenizerBase
    """The generator's tokenizer (tiny models and BERT2BERT-from-MiniLM use MiniLM's WordPiece vocabulary)."""
    from transformers import AutoTokenizer  # lazy: transformers is heavy (~1 s); this module imports without it

    return AutoTokenizer.from_pretrained(resolve_path(g.tokenizer or g.model))


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

    def __init__(self, hf: PreTrainedModel, arch: str, tokenizer):
        super().__init__()
        self.hf, self.tokenizer = hf, tokenizer
        self.arch: Architecture = build_arch(arch)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_id = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
        # transformers' causal LMs take `logits_to_keep` (positions whose logits are computed) since 4.50
        self.keeps_logits = "logits_to_keep" in inspect.signature(hf.forward).parameters
        start = getattr(hf.config, "decoder_start_token_id", None)
        self.start_id: int = start if start is not None else self.pad_id

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of the target tokens' cross-entropy in fp32 (callers divide by the global token count)."""
        return -self.target_logprobs(input_ids, attention_mask, labels).sum()

    def target_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """Per sequence, the sum of its target tokens' log-probabilities in fp32 (shape [batch]): log p(target |
        source) with the target's EOS (the answer likelihood of joint training; -forward() summed)."""
        logits, target = self.arch.logits(self, input_ids, attention_mask, labels)
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

        prompt_len = self.arch.prompt_length(input_ids)
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
            stopping_criteria=StoppingCriteriaList(stop),
            **self.arch.generate_kwargs(self.start_id),
        )
        out = out[:, prompt_len:]  # decoder-only output repeats the (left-padded) prompt first
        if not prompt_len and out.shape[1] and bool((out[:, 0] == self.start_id).all()):
            out = out[:, 1:]
        answers = []
        for row in out.tolist():
            answers.append(row[: row.index(self.eos_id)] if self.eos_id in row else row)
        return answers


def build_generator(g: GeneratorConfig, tokenizer) -> GenModel:
    """Build the configured generator (call torch.manual_seed first: new layers get a seeded init)."""
    import transformers  # lazy: transformers is heavy (~1 s); this module imports without it

    transformers.logging.set_verbosity_error()  # partial-checkpoint load reports are expected here (decoder)
    hf = build_arch(g.arch).build(g, tokenizer)
    if g.dropout is not None:  # modules that read p at build time
        for m in hf.modules():
            if isinstance(m, nn.Dropout):
                m.p = g.dropout
    return GenModel(hf, g.arch, tokenizer)


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
