"""The trained generator as a Hugging Face model folder: `save_generator` writes it (the generator and joint
recipes' final checkpoints), `load_generator` reads it back (`ragtrain.commands.ask`, export's checks, the tests)."""

from __future__ import annotations

from pathlib import Path

from ragtrain.config import Config
from ragtrain.generator.archs.base import build_arch
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


def load_generator(cfg: Config, folder: str | Path) -> GenModel:
    """A generator saved by `save_generator` (a trained run's <output_dir>/generator), with its own tokenizer, in
    eval mode; `cfg.generator` names its architecture."""
    # lazy: transformers is heavy (~1 s); this module imports without it (ask checks its arguments first)
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"no generator model at {folder} (config.json is missing)")
    arch = cfg.generator.arch
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return GenModel(build_arch(arch).load(str(folder)), arch, tokenizer).eval()
