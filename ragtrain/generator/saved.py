"""The trained generator as a Hugging Face model folder: `save_generator` writes it (the generator and joint
recipes' final checkpoints), `load_generator` reads it back (`ragtrain.ask`, export's checks, the tests)."""

from __future__ import annotations

import functools
from pathlib import Path

from ragtrain.config import Config
from ragtrain.config.generator import Arch
from ragtrain.generator.model import GenModel, untie_encoder_decoder

# save_pretrained's weights: one file, or an index of shards for a large model
WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json")


def save_generator(model: GenModel, tokenizer, folder: str | Path) -> Path:
    """The generator as a Hugging Face model folder in `folder`: `save_pretrained` (safetensors) + its tokenizer,
    so it loads with plain transformers (AutoModelForCausalLM / AutoModelForSeq2SeqLM / EncoderDecoderModel and
    AutoTokenizer). BERT2BERT's encoder/decoder embedding tie is saved as two equal matrices (`untie_encoder_decoder`
    changes `model` in place: call it last). Returns the weights file (the final checkpoint's completeness mark)."""
    untie_encoder_decoder(model.hf)
    model.hf.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    for name in WEIGHTS_FILES:
        if (Path(folder) / name).exists():
            return Path(folder) / name
    raise FileNotFoundError(f"save_pretrained wrote none of {WEIGHTS_FILES} into {folder}")


@functools.cache
def bert2bert_class() -> type:
    """EncoderDecoderModel with the BERT encoder it was trained with (ragtrain/generator/model.py's `_bert2bert`):
    no pooler, which the decoder never reads (it cross-attends to the hidden states) and the saved weights lack.
    Plain EncoderDecoderModel builds one and reports its weights as missing and newly initialised, a load report a
    user can do nothing about."""
    # lazy: transformers is heavy (~1 s); this module imports without it
    from transformers import BertModel, EncoderDecoderModel

    class PoolerFreeBert2Bert(EncoderDecoderModel):
        def __init__(self, config, encoder=None, decoder=None):
            encoder = encoder if encoder is not None else BertModel(config.encoder, add_pooling_layer=False)
            super().__init__(config, encoder=encoder, decoder=decoder)

    return PoolerFreeBert2Bert


def load_generator(cfg: Config, folder: str | Path) -> GenModel:
    """A generator saved by `save_generator` (a trained run's <output_dir>/generator), with its own tokenizer, in
    eval mode; `cfg.generator` names its architecture."""
    # lazy: transformers is heavy (~1 s); this module imports without it (ask checks its arguments first)
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"no generator model at {folder} (config.json is missing)")
    arch = Arch(cfg.generator.arch)
    cls = {Arch.bert2bert: bert2bert_class(), Arch.seq2seq: AutoModelForSeq2SeqLM}.get(arch, AutoModelForCausalLM)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return GenModel(cls.from_pretrained(str(folder)), arch, tokenizer).eval()
