"""Encoder weights on disk: safetensors files `<name>.safetensors` in a folder (no pickle). The retriever and joint
recipes write them; the index pool, search, export and the generator's retrieval client read them."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn


def load_state(encoder: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load weights strictly: a key mismatch means a different architecture, which must not pass silently."""
    encoder.load_state_dict(state, strict=True)


def save_weights(state: dict[str, torch.Tensor], folder: str | Path, name: str = "encoder") -> Path:
    """Save encoder weights as safetensors (no pickle) in `folder` as `<name>.safetensors`."""
    path = Path(folder) / f"{name}.safetensors"
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(path))
    return path


def load_weights(folder: str | Path, name: str = "encoder") -> dict[str, torch.Tensor]:
    """Load weights saved by `save_weights`."""
    path = Path(folder) / f"{name}.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"no encoder weights at {path} (expected a ragtrain retriever checkpoint)")
    return load_file(str(path))
