"""The Protocol every generator architecture implements: what differs between a decoder-only LM and an
encoder-decoder (building or loading the model, padding a batch, the forward pass that scores the answer, where a
generated answer starts), and the loading functions they share.

`GenModel` (ragtrain/generator/model.py) holds one and gives every architecture the same calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ragtrain.config.generator import GENERATOR_ARCHS, PACKAGED, GeneratorConfig
from ragtrain.embed.model import minilm_path
from ragtrain.generator.packaged import packaged_folder

if TYPE_CHECKING:
    from transformers import PreTrainedModel

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


class Architecture(Protocol):
    """Built as `cls()`."""

    causal: bool  # decoder-only: prompt and answer are one sequence (the prompt builder adds answer_prefix)
    hf_class: str  # the transformers class that loads a saved model of this kind (load_generator, the export)
    pipeline_tag: str  # the Hugging Face pipeline of an exported model
    warm_start: str | None  # what a model card calls a model built from a checkpoint of another kind (bert2bert)

    def build(self, g: GeneratorConfig, tokenizer: Any) -> PreTrainedModel:
        """The configured transformers model (call torch.manual_seed first: new layers get a seeded init)."""
        ...

    def load(self, folder: str) -> PreTrainedModel:
        """A model of this kind saved in `folder` (`save_generator`), loaded as it was trained."""
        ...

    def mismatch(self, g: GeneratorConfig, hf_config: Any) -> str | None:
        """What generator.model must be when its transformers config does not fit this architecture, else None."""
        ...

    def positions(self, g: GeneratorConfig) -> tuple[int, str]:
        """The input positions a prompt (and answer) takes, and the keys that set it (for the message)."""
        ...

    def collate(
        self, sources: Sequence[list[int]], targets: Sequence[list[int]], pad_id: int, for_generation: bool = False
    ) -> dict[str, torch.Tensor]:
        """Pad a batch: input_ids, attention_mask and labels (-100 where no target token is)."""
        ...

    def logits(self, model: Any, input_ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> tuple:
        """(logits, target ids) of the answer tokens: the forward pass that scores the answer (`model`: GenModel)."""
        ...

    def prompt_length(self, input_ids: torch.Tensor) -> int:
        """Where the generated tokens start in what `generate` returns."""
        ...

    def generate_kwargs(self, start_id: int) -> dict[str, Any]:
        """Arguments of transformers' `generate` that differ by architecture."""
        ...


def build_arch(name: str) -> Architecture:
    """The architecture `name` names in the GENERATOR_ARCHS registry."""
    return GENERATOR_ARCHS[name].load()()


def resolve_path(name: str) -> str:
    """ "minilm"/"tiny" -> the shipped all-MiniLM-L6-v2 folder; a packaged model ("smollm2") -> its dequantised
    HF folder (made on first use); anything else is a local path or cached name."""
    if name in PACKAGED:
        return packaged_folder(name)
    return minilm_path() if name in ("minilm", "tiny") else name


def set_dropout(config: Any, p: float | None) -> None:
    """Every dropout probability of a transformers config to `p` (None: the model's own)."""
    if p is None:
        return
    for key in _DROPOUT_KEYS:
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, p)


def pretrained(g: GeneratorConfig, auto_class: str) -> PreTrainedModel:
    """Any HF model of the `transformers.<auto_class>` kind by local path or cached name."""
    import transformers  # lazy: transformers is heavy (~1 s); this module imports without it

    path = resolve_path(g.model)
    cfg = transformers.AutoConfig.from_pretrained(path)
    set_dropout(cfg, g.dropout)
    return getattr(transformers, auto_class).from_pretrained(path, config=cfg)


def load_saved(hf_class: str, folder: str) -> PreTrainedModel:
    """A saved model folder through `transformers.<hf_class>`."""
    import transformers  # lazy: transformers is heavy (~1 s); this module imports without it

    return getattr(transformers, hf_class).from_pretrained(folder)


def end_of_answer(tok: Any) -> int:
    """The token that ends an answer: [SEP] where the vocabulary has one (BERT's), else EOS."""
    return tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id


class EncoderDecoder:
    """What every encoder-decoder shares: sources right-padded, labels = targets, the decoder fed the shifted
    answer from its start token."""

    causal = False
    pipeline_tag = "text2text-generation"
    warm_start: str | None = None

    hf_class: str

    def load(self, folder: str) -> PreTrainedModel:
        return load_saved(self.hf_class, folder)

    def positions(self, g: GeneratorConfig) -> tuple[int, str]:
        return g.max_source_length, "generator.max_source_length"

    def collate(
        self, sources: Sequence[list[int]], targets: Sequence[list[int]], pad_id: int, for_generation: bool = False
    ) -> dict[str, torch.Tensor]:
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

    def logits(self, model: Any, input_ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> tuple:
        dec_in = labels.new_full(labels.shape, model.pad_id)
        dec_in[:, 0] = model.start_id
        dec_in[:, 1:] = labels[:, :-1].masked_fill(labels[:, :-1] < 0, model.pad_id)
        out = model.hf(
            input_ids=input_ids,
            attention_mask=mask,
            decoder_input_ids=dec_in,
            decoder_attention_mask=(labels >= 0).long(),
        )
        return out.logits, labels

    def prompt_length(self, input_ids: torch.Tensor) -> int:
        return 0  # the decoder's output holds the answer alone (after its start token)

    def generate_kwargs(self, start_id: int) -> dict[str, Any]:
        return {"decoder_start_token_id": start_id}
