"""Scopes: which ranks a reducer or mixer spans (node groups from Ray node ids) and which parameters (by name)."""

from __future__ import annotations

import re

from torch import nn


def node_groups(node_ids: list[str]) -> list[list[int]]:
    """Ranks grouped by node, nodes ordered by their lowest rank."""
    groups: dict[str, list[int]] = {}
    for rank, node in enumerate(node_ids):
        groups.setdefault(node, []).append(rank)
    return list(groups.values())


def counterparts(groups: list[list[int]]) -> list[list[int]]:
    """Cross-node groups: the workers of equal local rank, one per node (every node must hold as many workers)."""
    sizes = sorted({len(g) for g in groups})
    if len(sizes) != 1:
        raise ValueError(
            f"sync.scope.reducer=two_level needs as many workers on every node, got {sizes} "
            f"(nodes: {groups}); use scope.reducer=all or resources that place workers evenly"
        )
    return [[g[i] for g in groups] for i in range(sizes[0])]


def matching_params(model: nn.Module, patterns: list[str]) -> set[int]:
    """data_ptrs of the parameters whose name matches any of the regexes (re.search); every pattern must match."""
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
