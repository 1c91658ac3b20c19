"""The learning-rate schedule both training recipes use."""

from __future__ import annotations

import torch


def warmup_linear_decay(optim: torch.optim.Optimizer, warmup: int, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over `warmup` steps, then linear decay to 0 at `steps` (the BERT/sentence-transformers one)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: (s + 1) / max(1, warmup) if s < warmup else max(0.0, (steps - s) / max(1, steps - warmup))
    )
