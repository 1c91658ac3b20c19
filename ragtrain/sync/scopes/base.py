"""The Protocols of reducer and mixer scopes, the workers' node layout they share, and the parameter scope.

Node groups come from the workers' Ray node ids; every subgroup is created by every rank in the same order (a
collective call): the node groups once in `layout`, a scope's own groups (two_level's cross-node groups) when
it is built, right after.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ragtrain.config.sync import MIXER_SCOPES, REDUCER_SCOPES, ReducerConfig
from ragtrain.sync.base import world_size
from ragtrain.sync.reducers.base import Reducer


@dataclass
class Layout:
    """This worker's place among the workers: its rank and the ranks grouped by node."""

    rank: int
    world: int
    groups: list[list[int]]  # ranks by node, nodes ordered by their lowest rank
    node_group: Any | None  # this node's process subgroup (None where no scope needs one, or one worker)

    @property
    def my_group(self) -> list[int]:
        return next(g for g in self.groups if self.rank in g)

    @property
    def local_rank(self) -> int:
        return self.my_group.index(self.rank)

    @property
    def num_nodes(self) -> int:
        return len(self.groups)


def layout(node_ids: list[str] | None, by_node: bool) -> Layout:
    """The workers' layout; `by_node`: create the per-node process subgroups (every rank calls this together)."""
    w = world_size()
    groups = node_groups(node_ids or ["local"] * w)
    node_group = None
    if w > 1 and by_node:
        node_group, _ = dist.new_subgroups_by_enumeration(ranks_per_subgroup_list=groups)
    return Layout(dist.get_rank() if w > 1 else 0, w, groups, node_group)


class ReducerScope(Protocol):
    """Which ranks the reducer averages over, each step inside backward. Built as `cls(layout, reducer_cfg)`."""

    by_node: ClassVar[bool]  # needs the per-node process subgroups

    @property
    def reducer(self) -> Reducer | None:
        """The reducer it runs (None: its own all-reduce only, or nothing to run); read-only here, so a scope that
        always runs one may declare it as `Reducer`."""
        ...

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The bucket averaged as this scope says (a DDP comm hook's result)."""
        ...

    def gradient_groups(self) -> list[list[int]] | None:
        """The ranks whose gradients it averages together (None: all of them; see SyncStrategy)."""
        ...


class MixerScope(Protocol):
    """Which ranks a mixer mixes among. Built as `cls(layout)`."""

    by_node: ClassVar[bool]  # needs the per-node process subgroups
    category: str  # the bytes' category (params, params_inter)
    mixes: bool  # False where there is nobody to mix with (e.g. across nodes on one node)

    def position(self) -> tuple[int, int]:
        """This worker's place in the mixer's ring and the ring's size (gossip picks neighbours on it)."""
        ...

    def ranks(self, positions: list[int]) -> list[int]:
        """The workers at `positions` of the ring that this worker exchanges with."""
        ...


def build_reducer_scope(lay: Layout, cfg: ReducerConfig, name: str) -> ReducerScope:
    """The reducer scope `name` in REDUCER_SCOPES, running the reducer `cfg` names."""
    return REDUCER_SCOPES[name].load()(lay, cfg)


def build_mixer_scope(lay: Layout, name: str) -> MixerScope:
    """The mixer scope `name` in MIXER_SCOPES."""
    return MIXER_SCOPES[name].load()(lay)


def node_groups(node_ids: list[str]) -> list[list[int]]:
    """Ranks grouped by node, nodes ordered by their lowest rank."""
    groups: dict[str, list[int]] = {}
    for rank, node in enumerate(node_ids):
        groups.setdefault(node, []).append(rank)
    return list(groups.values())


def matching_params(model: nn.Module, patterns: list[str]) -> set[int]:
    """data_ptrs of the parameters whose name matches any of the regexes (re.search); every pattern must match.
    The parameter scope (scope.reducer_params): the reducer averages these, the mixer all the others."""
    named = list(model.named_parameters())
    compiled = [re.compile(p) for p in patterns]
    for pat in compiled:
        if not any(pat.search(n) for n, _ in named):
            sample = [n for n, _ in named[:4]] + ["..."] + [n for n, _ in named[-2:]]
            raise ValueError(
                f"sync.scope.reducer_params pattern {pat.pattern!r} matches no parameter of this model; "
                f"its names look like {sample}"
            )
    return {p.data_ptr() for n, p in named if any(pat.search(n) for pat in compiled)}
