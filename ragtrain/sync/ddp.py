"""`ddp`: gradient all-reduce every step (the strongly consistent baseline), bytes counted in a comm hook."""


from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ragtrain.config import SyncConfig
from ragtrain.sync.base import ddp, world_size
from ragtrain.sync.comm import all_reduce_bytes, counted_future


def counting_allreduce_hook(category: str, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's allreduce_hook (mean of the bucket), plus bytes and in-flight time recorded under `category`."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buf = bucket.buffer()
    nbytes = all_reduce_bytes(buf.numel() * buf.element_size(), world_size())
    return counted_future(allreduce_hook(None, bucket), category, nbytes)


class DDPSync:
    """DistributedDataParallel with a counting all-reduce hook; replicas are identical after every step."""

    gather_negatives = True
    keeps_replicas = False

    def __init__(self, cfg: SyncConfig):
        self.cfg = cfg

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        if world_size() == 1:
            return model
        wrapped = ddp(model, device, self.cfg.bucket_cap_mb)
        wrapped.register_comm_hook("grad", counting_allreduce_hook)
        return wrapped

    def gradient_groups(self, step: int) -> Optional[list[list[int]]]:
        return None  # gradients are averaged every step: the global mean loss

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        pass  # gradients were averaged during backward

    def consensus(self, params: list[nn.Parameter]) -> None:
        pass  # replicas never diverge

    def state(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing beyond the model and optimizer

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
