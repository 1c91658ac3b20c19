"""The learning-rate schedule every training recipe uses."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def warmup_linear_decay(
    optim: torch.optim.Optimizer, warmup: int | Sequence[int], steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over `warmup` steps, then linear decay to 0 at `steps` (the BERT/sentence-transformers one).
    A sequence gives each parameter group its own warm-up (joint training: the retriever's and the generator's)."""

    def schedule(w: int) -> Callable[[int], float]:
        return lambda s: (s + 1) / max(1, w) if s < w else max(0.0, (steps - s) / max(1, steps - w))

    if isinstance(warmup, Sequence):
        return torch.optim.lr_scheduler.LambdaLR(optim, [schedule(w) for w in warmup])
    return torch.optim.lr_scheduler.LambdaLR(optim, schedule(warmup))
