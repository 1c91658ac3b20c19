"""`topk`: top-k sparsification with per-parameter error feedback (ratio, error_feedback), written here.

Each worker adds its residual, keeps the k = ratio * n largest-magnitude entries of the bucket, all-gathers the
values (fp32) and indices (int32), and averages the sparse sum.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ragtrain.config.sync import ReducerConfig
from ragtrain.runtime.errors import filled
from ragtrain.sync.comm import STATS, all_gather_bytes
from ragtrain.sync.reducers.base import done, group_size


class TopK:
    """One error-feedback residual per PARAMETER (index in model.parameters()).

    Not per DDP bucket: DDP puts every parameter in one bucket for the first step and rebuilds its buckets in
    gradient-ready order after it, so a bucket index (or a position in a bucket) names different parameters
    before and after the rebuild, and a residual kept by bucket would be added to another parameter's gradient.
    """

    def __init__(self, cfg: ReducerConfig, group: Any | None, category: str):
        self.ratio = filled(cfg.ratio, "sync.reducer.ratio")
        self.error_feedback = filled(cfg.error_feedback, "sync.reducer.error_feedback")
        self.group, self.category = group, category
        self.residuals: dict[int, torch.Tensor] = {}
        self.param_index: dict[int, int] = {}  # data_ptr of a parameter -> its index in model.parameters()

    def bind(self, model: nn.Module) -> None:
        """Learn the parameters' stable indices."""
        self.param_index = {p.data_ptr(): i for i, p in enumerate(model.parameters())}

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
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

    def state_dict(self) -> dict[str, Any]:
        return {"topk_by_param": dict(self.residuals)}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        # older checkpoints keyed residuals by DDP bucket ("topk"): dropped
        self.residuals = {int(i): r.to(device) for i, r in state.get("topk_by_param", {}).items()}
