"""`local_sgd`: workers step alone and average parameters every `period` steps (optionally adaptive).

Warm-up: the first `warmup_steps` steps all-reduce gradients like DDP (post-local SGD, Lin et al. 2020), through a
DDP comm hook that stops communicating afterwards. Averaging uses one flat all-reduce of the parameters; torch's
PeriodicModelAverager does the same flat all-reduce but hides the pre-average divergence the adaptive mode
needs, so the schedule lives here.

Adaptive period ("dynamic sync frequency"): at each averaging round the replicas' mean relative divergence
d = mean_i ||theta_i - theta_mean|| / ||theta_mean|| is measured (all workers agree on it); if d > 2 * target the
period halves (down to 1), if d < target / 2 it doubles (up to max_period).

Note: with period 1 this equals DDP exactly only for optimizers that are linear in the gradient (SGD, momentum):
Adam's per-worker normalisation makes "average of Adam steps" differ from "Adam step of the average".
"""


from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ragtrain.config import SyncConfig
from ragtrain.sync.base import average_params, ddp, world_size
from ragtrain.sync.ddp import counting_allreduce_hook


class LocalSGDSync:
    """Periodic parameter averaging after an optional DDP warm-up."""

    gather_negatives = True
    keeps_replicas = False

    def __init__(self, cfg: SyncConfig):
        self.cfg = cfg
        self.period = cfg.period
        self.next_sync = cfg.warmup_steps + cfg.period  # step count (1-based) of the next averaging round
        self.steps_done = 0
        self.last_divergence = 0.0

    def _hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self.steps_done < self.cfg.warmup_steps:
            return counting_allreduce_hook("grad", bucket)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())  # local step: keep this worker's own gradient, send nothing
        return fut

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        if world_size() == 1:
            return model
        wrapped = ddp(model, device, self.cfg.bucket_cap_mb)
        wrapped.register_comm_hook(None, self._hook)
        return wrapped

    def gradient_groups(self, step: int) -> Optional[list[list[int]]]:
        # The warm-up hook all-reduces gradients (DDP: the global mean loss); afterwards each replica its own loss.
        return None if step < self.cfg.warmup_steps else [[r] for r in range(world_size())]

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        self.steps_done = step + 1
        if self.steps_done < self.next_sync:
            return
        self.last_divergence = average_params(params)
        if self.cfg.adaptive:
            if self.last_divergence > 2 * self.cfg.target_divergence:
                self.period = max(1, self.period // 2)
            elif self.last_divergence < self.cfg.target_divergence / 2:
                self.period = min(self.cfg.max_period, self.period * 2)
        self.next_sync = self.steps_done + self.period

    def consensus(self, params: list[nn.Parameter]) -> None:
        average_params(params)

    def state(self) -> dict[str, Any]:
        return {"sync/period": self.period, "sync/divergence_at_sync": self.last_divergence}

    def state_dict(self) -> dict[str, Any]:
        return {"period": self.period, "next_sync": self.next_sync, "steps_done": self.steps_done,
                "last_divergence": self.last_divergence}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.period, self.next_sync = int(state["period"]), int(state["next_sync"])
        self.steps_done, self.last_divergence = int(state["steps_done"]), float(state["last_divergence"])
