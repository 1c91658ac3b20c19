"""`powersgd`: torch's PowerSGD hook (matrix_rank, start_iter, error_feedback), the factors' bytes counted.

Rank-r factors P (n x r) and Q (m x r) of each compressed matrix cross the wire, plus the uncompressed vectors;
PowerSGD's state tallies them as `total_numel_after_compression`. Before `start_iter` it runs a plain all-reduce
and tallies nothing: then the full bucket is counted.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ragtrain.config.sync import ReducerConfig
from ragtrain.runtime.errors import filled
from ragtrain.sync.comm import STATS, all_reduce_bytes, counted_future
from ragtrain.sync.reducers.base import group_size


class PowerSGD:
    def __init__(self, cfg: ReducerConfig, group: Any | None, category: str):
        self.cfg, self.group, self.category = cfg, group, category
        self.state: Any = None  # PowerSGD's state: created by bind, when DDP runs (torch checks start_iter there)

    def bind(self, model: nn.Module) -> None:
        r = self.cfg
        self.state = powersgd_state(
            filled(r.matrix_rank, "sync.reducer.matrix_rank"),
            filled(r.start_iter, "sync.reducer.start_iter"),
            filled(r.error_feedback, "sync.reducer.error_feedback"),
            self.group,
        )

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # lazy: torch.distributed's submodules import only where torch.distributed is built
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

        state = self.state
        before = state.total_numel_after_compression
        full = bucket.buffer().numel()
        start = STATS.clock()  # before the hook issues its first all-reduce (on gloo it also finishes below)
        fut = powerSGD_hook(state, bucket)
        if dist.get_backend() == "gloo":
            # PowerSGD chains its all-reduces (vectors, then P, then Q) through future callbacks, which gloo runs
            # on its own thread: they can interleave with the next bucket's collectives in a different order on
            # each rank (a collective mismatch, seen with MiniLM's 4 buckets). Finish this bucket first.
            fut.wait()
        sent = state.total_numel_after_compression - before or full
        nbytes = all_reduce_bytes(4 * sent, group_size(state.process_group))
        return counted_future(fut, self.category, nbytes, start=start)

    def state_dict(self) -> dict[str, Any]:
        """PowerSGD's memories and iteration: a restart continues exactly."""
        if self.state is None:
            return {}
        s = self.state
        return {
            "powersgd": {
                "iter": s.iter,
                "error": dict(s.error_dict),
                "p": dict(s.p_memory_dict),
                "q": dict(s.q_memory_dict),
                "numel_before": s.total_numel_before_compression,
                "numel_after": s.total_numel_after_compression,
            }
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        if self.state is not None and "powersgd" in state:  # bind() has created PowerSGD's state
            load_powersgd_state(self.state, state["powersgd"], device)


def powersgd_state(matrix_rank: int, start_iter: int, error_feedback: bool, group: Any | None = None) -> Any:
    """PowerSGD's state (warm start, seed 0); start_iter is at least 2 with error feedback (torch requires it)."""
    # lazy: torch.distributed's submodules import only where torch.distributed is built
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    return PowerSGDState(
        process_group=group,
        matrix_approximation_rank=matrix_rank,
        start_powerSGD_iter=max(start_iter, 2) if error_feedback else start_iter,
        use_error_feedback=error_feedback,
        warm_start=True,
        random_seed=0,
    )


def load_powersgd_state(s: Any, saved: dict[str, Any], device: torch.device) -> None:
    """Restore a checkpoint's PowerSGD memories onto `device` (the gradient buckets' device)."""
    s.iter = int(saved["iter"])
    s.error_dict, s.p_memory_dict, s.q_memory_dict = (
        {k: v.to(device) for k, v in saved[name].items()} for name in ("error", "p", "q")
    )
    s.total_numel_before_compression = int(saved["numel_before"])
    s.total_numel_after_compression = int(saved["numel_after"])
