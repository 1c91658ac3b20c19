"""`compressed`: DDP with a gradient-compression comm hook — fp16 / bf16 casts, PowerSGD, or top-k + error feedback.

fp16/bf16 and PowerSGD are torch's own hooks (torch.distributed.algorithms.ddp_comm_hooks); bytes are counted
around them: the cast halves the payload; PowerSGD all-reduces the rank-r factors P (n x r) and Q (m x r) of each
compressed matrix plus the uncompressed vectors, which its state tallies as `total_numel_after_compression`.
Top-k is written here: each worker adds its error-feedback residual, keeps the k = ratio * n largest-magnitude
entries, all-gathers (values fp32, indices int32) and averages the sparse sum; what it did not send stays in
its residual (one per parameter) for the next step.
"""


from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ragtrain.config import SyncConfig
from ragtrain.sync.base import ddp, world_size
from ragtrain.sync.comm import STATS, all_gather_bytes, all_reduce_bytes, counted_future


class TopK:
    """Top-k sparsification state: one error-feedback residual per PARAMETER (index in model.parameters()).

    Not per DDP bucket: DDP puts every parameter in one bucket for the first step and rebuilds its buckets in
    gradient-ready order after it, so a bucket index (or a position in a bucket) names different parameters
    before and after the rebuild, and a residual kept by bucket would be added to another parameter's gradient.
    """

    def __init__(self, ratio: float, error_feedback: bool):
        self.ratio, self.error_feedback = ratio, error_feedback
        self.residuals: dict[int, torch.Tensor] = {}
        self.param_index: dict[int, int] = {}  # data_ptr of a parameter -> its index in model.parameters()

    def bind(self, params: list[nn.Parameter]) -> None:
        """Learn the parameters' stable indices (call once, with the model's parameters, before training)."""
        self.param_index = {p.data_ptr(): i for i, p in enumerate(params)}

    def hook(self, _: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        grad = bucket.buffer()
        w = world_size()
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
        start = STATS.clock()
        all_vals = [torch.empty_like(vals) for _ in range(w)]
        all_idx = [torch.empty_like(idx, dtype=torch.int32) for _ in range(w)]
        dist.all_gather(all_vals, vals)
        dist.all_gather(all_idx, idx.to(torch.int32))
        STATS.add("grad", all_gather_bytes(k * (vals.element_size() + 4), w), start=start)
        out = torch.zeros_like(grad)
        for v, i in zip(all_vals, all_idx):
            out.index_add_(0, i.long(), v)
        out /= w
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(out)
        return fut


class CompressedSync:
    """DDP whose gradient all-reduce is compressed by the configured hook."""

    gather_negatives = True
    keeps_replicas = False

    def __init__(self, cfg: SyncConfig):
        self.cfg = cfg
        self.powersgd = None
        self.topk = TopK(cfg.ratio, cfg.error_feedback)

    def _cast_hook(self, dtype: torch.dtype):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        fn = default_hooks.fp16_compress_hook if dtype == torch.float16 else default_hooks.bf16_compress_hook

        def hook(_: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            n = bucket.buffer().numel()
            return counted_future(fn(None, bucket), "grad", all_reduce_bytes(2 * n, world_size()))

        return hook

    def _powersgd_hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
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
        # Before start_iter PowerSGD runs a plain all-reduce and does not tally it: count the full bucket then.
        sent = state.total_numel_after_compression - before or full
        return counted_future(fut, "grad", all_reduce_bytes(4 * sent, world_size()), start=start)

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        if world_size() == 1:
            return model
        wrapped = ddp(model, device, self.cfg.bucket_cap_mb)
        c = self.cfg.compression
        if c == "fp16":
            wrapped.register_comm_hook(None, self._cast_hook(torch.float16))
        elif c == "bf16":
            wrapped.register_comm_hook(None, self._cast_hook(torch.bfloat16))
        elif c == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

            start = max(self.cfg.start_iter, 2) if self.cfg.error_feedback else self.cfg.start_iter
            self.powersgd = PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.cfg.rank,
                start_powerSGD_iter=start,
                use_error_feedback=self.cfg.error_feedback,
                warm_start=True,
                random_seed=0,
            )
            wrapped.register_comm_hook(self.powersgd, self._powersgd_hook)
        elif c == "topk":
            self.topk.bind(list(model.parameters()))
            wrapped.register_comm_hook(None, self.topk.hook)
        else:
            raise ValueError(f"sync.compression={c!r} is unknown; valid choices: fp16, bf16, powersgd, topk")
        return wrapped

    def gradient_groups(self, step: int) -> Optional[list[list[int]]]:
        return None  # every step averages (compressed) gradients: the global mean loss

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        pass  # every worker applied the same decompressed gradient

    def consensus(self, params: list[nn.Parameter]) -> None:
        pass  # replicas stay identical: all apply the same (approximate) gradient

    def state(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Error-feedback residuals (top-k) and PowerSGD's memories and iteration: a restart continues exactly."""
        out: dict[str, Any] = {"topk_by_param": dict(self.topk.residuals)}
        if self.powersgd is not None:
            s = self.powersgd
            out["powersgd"] = {"iter": s.iter, "error": dict(s.error_dict), "p": dict(s.p_memory_dict),
                               "q": dict(s.q_memory_dict), "numel_before": s.total_numel_before_compression,
                               "numel_after": s.total_numel_after_compression}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Older checkpoints keyed residuals by DDP bucket ("topk"): they cannot be mapped back, so they are dropped.
        self.topk.residuals = {int(i): r for i, r in state.get("topk_by_param", {}).items()}
        if self.powersgd is not None and "powersgd" in state:  # wrap() has created PowerSGD's state
            s, saved = self.powersgd, state["powersgd"]
            s.iter = int(saved["iter"])
            s.error_dict, s.p_memory_dict, s.q_memory_dict = dict(saved["error"]), dict(saved["p"]), dict(saved["q"])
            s.total_numel_before_compression = int(saved["numel_before"])
            s.total_numel_after_compression = int(saved["numel_after"])
