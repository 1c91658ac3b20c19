"""Gradient reducers: DDP comm hooks that average a bucket's gradients over a process group, bytes counted.

allreduce (torch's allreduce_hook), fp16 / bf16 (torch's cast hooks: half the payload), PowerSGD (torch's hook:
rank-r factors P (n x r) and Q (m x r) of each compressed matrix plus the uncompressed vectors, which its state
tallies as `total_numel_after_compression`) and top-k with per-parameter error feedback (written here: each worker
adds its residual, keeps the k = ratio * n largest-magnitude entries, all-gathers values fp32 + indices int32 and
averages the sparse sum). `group=None` is every rank; a subgroup (e.g. one worker per node) is counted with its
own size. ComposedSync (composed.py) picks one per bucket.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ragtrain.sync.comm import STATS, all_gather_bytes, all_reduce_bytes, counted_future


def group_size(group: Any | None) -> int:
    """Ranks in `group` (None: the default group; 1 without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def done(t: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A completed future holding `t` (a hook that sends nothing)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(t)
    return fut


def counting_allreduce_hook(
    category: str, bucket: dist.GradBucket, group: Any | None = None
) -> torch.futures.Future[torch.Tensor]:
    """torch's allreduce_hook (mean of the bucket over `group`), plus bytes and in-flight time under `category`."""
    # lazy: torch.distributed's submodules import only where torch.distributed is built
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buf = bucket.buffer()
    nbytes = all_reduce_bytes(buf.numel() * buf.element_size(), group_size(group))
    return counted_future(allreduce_hook(group, bucket), category, nbytes)


def cast_hook(
    dtype: torch.dtype, category: str, bucket: dist.GradBucket, group: Any | None = None
) -> torch.futures.Future[torch.Tensor]:
    """torch's fp16 / bf16 compress hook over `group`: the bucket crosses the wire in 2 bytes per entry."""
    # lazy: torch.distributed's submodules import only where torch.distributed is built
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    fn = default_hooks.fp16_compress_hook if dtype == torch.float16 else default_hooks.bf16_compress_hook
    n = bucket.buffer().numel()
    return counted_future(fn(group, bucket), category, all_reduce_bytes(2 * n, group_size(group)))


def powersgd_hook(state: Any, bucket: dist.GradBucket, category: str) -> torch.futures.Future[torch.Tensor]:
    """torch's PowerSGD hook over `state.process_group`, the factors' bytes counted (the full bucket before
    start_iter, where PowerSGD runs a plain all-reduce and tallies nothing)."""
    # lazy: torch.distributed's submodules import only where torch.distributed is built
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

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
    return counted_future(fut, category, all_reduce_bytes(4 * sent, group_size(state.process_group)), start=start)


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


def powersgd_state_dict(s: Any) -> dict[str, Any]:
    """PowerSGD's memories and iteration: a restart continues exactly."""
    return {
        "iter": s.iter,
        "error": dict(s.error_dict),
        "p": dict(s.p_memory_dict),
        "q": dict(s.q_memory_dict),
        "numel_before": s.total_numel_before_compression,
        "numel_after": s.total_numel_after_compression,
    }


def load_powersgd_state(s: Any, saved: dict[str, Any], device: torch.device) -> None:
    """Restore `powersgd_state_dict`'s memories onto `device` (the gradient buckets' device)."""
    s.iter = int(saved["iter"])
    s.error_dict, s.p_memory_dict, s.q_memory_dict = (
        {k: v.to(device) for k, v in saved[name].items()} for name in ("error", "p", "q")
    )
    s.total_numel_before_compression = int(saved["numel_before"])
    s.total_numel_after_compression = int(saved["numel_after"])


class TopK:
    """Top-k sparsification state: one error-feedback residual per PARAMETER (index in model.parameters()).

    Not per DDP bucket: DDP puts every parameter in one bucket for the first step and rebuilds its buckets in
    gradient-ready order after it, so a bucket index (or a position in a bucket) names different parameters
    before and after the rebuild, and a residual kept by bucket would be added to another parameter's gradient.
    """

    def __init__(self, ratio: float, error_feedback: bool, group: Any | None = None, category: str = "grad"):
        self.ratio, self.error_feedback, self.group, self.category = ratio, error_feedback, group, category
        self.residuals: dict[int, torch.Tensor] = {}
        self.param_index: dict[int, int] = {}  # data_ptr of a parameter -> its index in model.parameters()

    def bind(self, params: list[nn.Parameter]) -> None:
        """Learn the parameters' stable indices (call once, with the model's parameters, before training)."""
        self.param_index = {p.data_ptr(): i for i, p in enumerate(params)}

    def hook(self, _: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        grad = bucket.buffer()
        w = group_size(self.group)
        params = bucket.parameters()
        keys = [self.param_index[p.data_ptr()] for p in params]
        sizes = [p.numel() for p in params]  # the bucket's buffer is these parameters' gradients, in this order
        if self.error_feedback and any(k in self.residuals for k in keys):
            grad = grad + torch.cat([self.residuals.get(k, grad.new_zeros(n)) for k, n in zip(keys, sizes)])
        k = max(1, int(self.ratio * grad.numel()))
        idx = grad.abs().topk(k, sorted=False).indices
        vals = grad[idx]
        if self.error_feedback:
            residual = grad.clone()
            residual[idx] = 0
            self.residuals.update(zip(keys, residual.split(sizes)))
        all_vals = [torch.empty_like(vals) for _ in range(w)]
        all_idx = [torch.empty_like(idx, dtype=torch.int32) for _ in range(w)]
        with STATS.timed(self.category, all_gather_bytes(k * (vals.element_size() + 4), w)):
            dist.all_gather(all_vals, vals, group=self.group)
            dist.all_gather(all_idx, idx.to(torch.int32), group=self.group)
        out = torch.zeros_like(grad)
        for v, i in zip(all_vals, all_idx):
            out.index_add_(0, i.long(), v)
        out /= w
        return done(out)


def reduce_slices(
    buf: torch.Tensor, slices: list[tuple[int, int]], kind: str, category: str, group: Any | None = None
) -> None:
    """Average `buf[o:o + n]` for each (o, n) in `slices` over `group`, in place, in ONE counted all-reduce
    (allreduce: fp32; fp16 / bf16: cast on the wire); the rest of `buf` stays this worker's own."""
    if not slices:
        return
    wire = torch.cat([buf[o : o + n] for o, n in slices])
    if kind in ("fp16", "bf16"):
        wire = wire.to(torch.float16 if kind == "fp16" else torch.bfloat16)
    w = group_size(group)
    with STATS.timed(category, all_reduce_bytes(wire.numel() * wire.element_size(), w)):
        dist.all_reduce(wire, group=group)
    mean = wire.to(buf.dtype) / w
    at = 0
    for o, n in slices:
        buf[o : o + n].copy_(mean[at : at + n])
        at += n
