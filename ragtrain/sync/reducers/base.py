"""The Protocol every gradient reducer implements, and what reducers share.

A reducer is a DDP comm hook: inside backward it averages one bucket of gradients over its process group and
counts the bytes it puts on the wire (ragtrain/sync/comm.py's definition). A reducer scope (ragtrain/sync/scopes/)
builds it with `build_reducer(cfg, group, category)`: `group=None` is every rank; a subgroup (e.g. one worker per
node) is counted with its own size, under `category` (grad, or grad_inter across nodes).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ragtrain.config.sync import REDUCERS, ReducerConfig
from ragtrain.sync.comm import STATS, all_reduce_bytes


class Reducer(Protocol):
    """Averages gradient buckets over a process group. Built as `cls(cfg, group, category)`."""

    def bind(self, model: nn.Module) -> None:
        """Called once when DDP wraps `model` (more than one worker), before the first step."""
        ...

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The bucket's gradients averaged over the group (a future of the bucket-sized tensor)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to continue exactly (error feedback, compression memories); keys unique to
        this reducer, since they sit beside the mixer's in one dict."""
        ...

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore `state_dict()` output onto `device` (checkpoints load on the CPU)."""
        ...


class SliceReducer(Reducer, Protocol):
    """A reducer that can also average some parameters' slices of a bucket (registry flag `slices`)."""

    def reduce_slices(self, buf: torch.Tensor, slices: list[tuple[int, int]]) -> None:
        """Average `buf[o:o + n]` for each (o, n) in `slices` over the group, in place; the rest stays local."""
        ...


def build_reducer(cfg: ReducerConfig, group: Any | None, category: str) -> Reducer:
    """The reducer `cfg.kind` names in the REDUCERS registry, over `group`, its bytes counted under `category`."""
    return REDUCERS[cfg.kind].load()(cfg, group, category)


class Stateless:
    """For reducers that keep nothing between steps: no binding, nothing to checkpoint."""

    def bind(self, model: nn.Module) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        pass


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


def reduce_slices(
    buf: torch.Tensor,
    slices: list[tuple[int, int]],
    wire: torch.dtype | None,
    category: str,
    group: Any | None = None,
) -> None:
    """Average `buf[o:o + n]` for each (o, n) in `slices` over `group`, in place, in ONE counted all-reduce with
    the entries cast to `wire` on the wire (None: as they are); the rest of `buf` stays this worker's own."""
    if not slices:
        return
    payload = torch.cat([buf[o : o + n] for o, n in slices])
    if wire is not None:
        payload = payload.to(wire)
    w = group_size(group)
    with STATS.timed(category, all_reduce_bytes(payload.numel() * payload.element_size(), w)):
        dist.all_reduce(payload, group=group)
    mean = payload.to(buf.dtype) / w
    at = 0
    for o, n in slices:
        buf[o : o + n].copy_(mean[at : at + n])
        at += n
