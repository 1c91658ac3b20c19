"""The small Protocol every sync strategy implements, and the helpers strategies share.

Strategies import this module; it imports none of them (build_sync in ragtrain/sync/composed.py builds one).
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ragtrain.sync.comm import STATS, all_reduce_bytes


class SyncStrategy(Protocol):
    """How one worker's replica stays consistent with the others'."""

    gather_negatives: bool  # score local queries against every worker's passages (a per-step collective)
    keeps_replicas: bool  # training returns every replica (consensus formed later, e.g. on the vectors)

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        """Return the module to call forward on (e.g. DDP with a comm hook, or the model itself)."""
        ...

    def gradient_groups(self, step: int) -> list[list[int]] | None:
        """The ranks grouped by whose gradients are averaged together at `step` (None: all ranks, like DDP); the
        gathered in-batch negatives of other groups are constants (ragtrain/retriever/loss.py)."""
        ...

    def clip_groups(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """The groups whose gradient norm is clipped separately: one global norm over gradients that are averaged
        for some parameters and local for others would scale the averaged ones differently on each rank."""
        ...

    def after_step(self, params: list[nn.Parameter], step: int) -> None:
        """Called after every optimizer step (0-based `step`): periodic averaging, gossip, ..."""
        ...

    def consensus(self, params: list[nn.Parameter]) -> None:
        """Make every replica equal to the consensus model (end of training): a no-op when already equal."""
        ...

    def state(self) -> dict[str, Any]:
        """Strategy-specific figures to log (e.g. the current averaging period)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to continue exactly (tensors and plain values only; after `wrap`)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output (called after `wrap`)."""
        ...


def world_size() -> int:
    """Workers in the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def flat_params(params: list[nn.Parameter]) -> torch.Tensor:
    """All parameters as one detached fp32 vector (a copy)."""
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def set_flat_params(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    """Write a flat vector back into the parameters, in place."""
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p).to(p.dtype))
            offset += n


def mean_and_divergence(
    params: list[nn.Parameter], count_as: str | None = None, timer: AbstractContextManager[Any] | None = None
) -> tuple[torch.Tensor, float]:
    """The replicas' flat parameter mean and their mean relative divergence ||theta_i - mean|| / ||mean||.

    The mean's all-reduce is counted under `count_as` (None: measurement traffic, not counted) and runs inside
    `timer` (a mixer that sets its period from the round's measured seconds: ragtrain/sync/network.py).
    """
    w = world_size()
    flat = flat_params(params)
    if w == 1:
        return flat, 0.0
    mean = flat.clone()
    nbytes = all_reduce_bytes(mean.numel() * mean.element_size(), w)
    with STATS.timed(count_as, nbytes) if count_as else nullcontext(), timer or nullcontext():
        dist.all_reduce(mean)
    mean /= w
    div = ((flat - mean).norm() / mean.norm().clamp(min=1e-12)).reshape(1)
    dist.all_reduce(div)  # measurement traffic (4 bytes): every worker must agree on the divergence
    return mean, div.item() / w


def average_params(
    params: list[nn.Parameter], category: str = "params", timer: AbstractContextManager[Any] | None = None
) -> float:
    """All-reduce the parameters to their mean (counted; inside `timer`, see mean_and_divergence); returns the
    replicas' mean relative divergence before."""
    if world_size() == 1:
        return 0.0
    mean, div = mean_and_divergence(params, count_as=category, timer=timer)
    set_flat_params(params, mean)
    return div


def ddp(model: nn.Module, device: torch.device, bucket_cap_mb: float = 25.0) -> DistributedDataParallel:
    """Wrap in DistributedDataParallel (buffers are constants here, so they are not re-broadcast each step)."""
    # Newer torch renamed the flag; either way buffers are synced once at construction, never per step.
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    flag = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    no_buffer_sync: dict[str, Any] = {flag: False}
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        **no_buffer_sync,
    )
