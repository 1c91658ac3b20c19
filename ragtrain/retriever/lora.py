"""Parameter-efficient tuning: PEFT LoRA adapters on the bi-encoder's transformer (`retriever.lora.rank > 0`).

Only the adapters train (peft freezes the rest), so the optimizer, DDP's buckets (DDP skips parameters that do
not require gradients) and every parameter mixer (local SGD, gossip, async_ps: they get `trainable(encoder)`
from the recipe) move adapter-sized tensors. Whatever leaves training (the final weights, live-index snapshots,
vector_avg replicas) is `plain_state_dict`: the adapters merged into the base weights (`merge_and_unload`), keyed
like a plain `BiEncoder`, so the index pool, export and evaluation never see LoRA. Mid-run checkpoints keep the
adapter form, so a restart continues training the same adapters.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from ragtrain.config.retriever import LoraConfig, RetrieverConfig
from ragtrain.embed.model import BiEncoder, build_backbone
from ragtrain.runtime.errors import ConfigError


def apply_lora(encoder: BiEncoder, cfg: LoraConfig) -> BiEncoder:
    """Wrap `encoder.backbone` in a PEFT LoRA model (base weights frozen); a no-op when cfg.rank == 0."""
    if cfg.rank <= 0:
        return encoder
    # lazy: peft only serves retriever.lora
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules), bias="none"
    )
    try:
        with warnings.catch_warnings():  # transformers 5 deprecates an attribute peft still reads
            warnings.simplefilter("ignore", FutureWarning)
            encoder.backbone = get_peft_model(encoder.backbone, peft_cfg)
    except ValueError as e:  # e.g. target modules that this architecture does not have
        raise ValueError(f"retriever.lora.target_modules={list(cfg.target_modules)}: {e}") from None
    return encoder


def check_lora_targets(cfg: RetrieverConfig) -> None:
    """retriever.lora.target_modules against the model's own Linear layers, on the driver before any work (PEFT
    would refuse them in every trainer worker, after the zero-shot encode). PEFT matches a name to a module whose
    dotted path is the name or ends with '.' + name."""
    if cfg.lora.rank <= 0:
        return
    linear = [n for n, m in build_backbone(cfg).named_modules() if isinstance(m, nn.Linear)]
    missing = [t for t in cfg.lora.target_modules if not any(n == t or n.endswith("." + t) for n in linear)]
    if missing:
        valid = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise ConfigError(
            f"retriever.lora.target_modules names {missing}, which this model "
            f"({cfg.model}) has no Linear layer for; valid module names: {valid}"
        )


def has_lora(encoder: nn.Module) -> bool:
    backbone = getattr(encoder, "backbone", None)
    return backbone is not None and hasattr(backbone, "merge_and_unload") and hasattr(backbone, "peft_config")


def trainable(module: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer and the sync strategy work on (all of them without LoRA)."""
    return [p for p in module.parameters() if p.requires_grad]


def plain_state_dict(encoder: BiEncoder) -> dict[str, torch.Tensor]:
    """The encoder's weights as a plain BiEncoder holds them: LoRA merged into the base weights (on a copy; the
    training model keeps its adapters)."""
    if not has_lora(encoder):
        return encoder.state_dict()
    merged = copy.deepcopy(encoder)
    merged.backbone = merged.backbone.merge_and_unload()
    return {k: v.detach().clone() for k, v in merged.state_dict().items()}
