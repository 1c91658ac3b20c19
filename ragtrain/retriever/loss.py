"""Contrastive InfoNCE with in-batch negatives gathered from every worker.

Every worker scores its OWN queries against ALL passages of the global batch. Which gathered passages carry a
gradient depends on how the sync strategy combines gradients (`SyncStrategy.gradient_groups(step)`, a partition of
the ranks):

- None (ddp, compressed, hierarchical on one node, local SGD during its DDP warm-up): the gradients of every
  worker are averaged every step. The gather keeps autograd, so the gradient w.r.t. a worker's passages comes
  back from every worker that scored them (a reduce-scatter SUM); each worker's loss is the MEAN over its own
  queries and the strategy averages the workers' gradients, so the update is the gradient of the global mean
  loss: with equal local batches, 2 workers x B == 1 worker x 2B exactly. No x world_size factor is needed
  anywhere (cf. tevatron #30).
- one group per rank (local SGD after warm-up, gossip, vector_avg): replicas train apart between syncs, so each replica
  optimises its OWN local loss, with the other workers' passages as constant negatives. Keeping the autograd
  gather here would add the passage-side gradients of every other worker's loss into this replica while its
  query side saw only its own loss: a differently weighted objective than DDP's, which is what this avoids.
- one group per node (hierarchical across nodes): gradients are averaged inside the node every step, so each node
  optimises the mean loss of its ranks; passages of the node's ranks carry gradients, other nodes' are constants.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ragtrain.sync.comm import STATS, all_gather_bytes


def gather_with_grad(t: torch.Tensor) -> torch.Tensor:
    """Concatenate `t` from all ranks in rank order; backward sums the gradients to each owner."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t

    # lazy: torch.distributed's submodules import only where torch.distributed is built
    from torch.distributed.nn.functional import all_gather

    # Forward all-gather + backward reduce-scatter (gloo: all-to-all) each move (W - 1) chunks per worker;
    # both are counted here because every training forward is followed by its backward.
    chunk = t.numel() * t.element_size()
    STATS.add("embeddings", 2 * all_gather_bytes(chunk, dist.get_world_size()))
    with warnings.catch_warnings():
        # Deprecated in favour of a private functional-collectives API; this public one is still the documented
        # autograd all_gather (backward = reduce-scatter SUM), which is exactly the semantics we need.
        warnings.simplefilter("ignore", FutureWarning)
        return torch.cat(all_gather(t), dim=0)


def gather_no_grad(t: torch.Tensor) -> torch.Tensor:
    """Concatenate a (non-differentiable) tensor from all ranks in rank order."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    STATS.add("embeddings", all_gather_bytes(t.numel() * t.element_size(), dist.get_world_size()))
    dist.all_gather(parts, t)
    return torch.cat(parts, dim=0)


def gather_passages(p: torch.Tensor, groups: Sequence[Sequence[int]] | None) -> torch.Tensor:
    """All ranks' passages in rank order; only those of my gradient group (None: one group of all) keep autograd."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return p
    if groups is None:
        return gather_with_grad(p)
    rank = dist.get_rank()
    if all(len(g) == 1 for g in groups):  # every rank alone (the same answer on all ranks): no backward collective
        parts = list(gather_no_grad(p.detach()).split(p.shape[0]))
        parts[rank] = p
        return torch.cat(parts, dim=0)
    # Every rank joins the autograd gather (its backward is a collective); other groups' chunks are detached.
    mine = next(set(g) for g in groups if rank in g)
    parts = gather_with_grad(p).split(p.shape[0])
    return torch.cat([c if r in mine else c.detach() for r, c in enumerate(parts)], dim=0)


def contrastive_loss(
    q: torch.Tensor,
    p: torch.Tensor,
    temperature: float,
    q_gold: torch.Tensor | None = None,
    p_ids: torch.Tensor | None = None,
    gather: bool = True,
    grad_groups: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """InfoNCE of local queries against the gathered passages of all workers (mean over local queries).

    q: [B, d] local query embeddings. p: [B * (1 + H), d] local passages: the B positives first (positive of
    query i at row i), then the H hard negatives of each query. q_gold: [B, G] corpus positions of each query's
    gold passages (padded with -1); p_ids: [B * (1 + H)] corpus positions of the local passages. With both given,
    any gathered passage that is gold for a query (other than its own positive) is masked out: a duplicate or
    second gold passage in the batch is not a negative. gather=False scores against local passages only (for
    strategies that must not synchronise workers every step, e.g. async_ps). grad_groups: the strategy's
    `gradient_groups(step)`; passages of my group carry gradients, the others are constants (module docstring).
    """
    b = q.shape[0]
    p_all = gather_passages(p, grad_groups) if gather else p
    scores = q @ p_all.T / temperature  # [B, W * B * (1 + H)]
    rank = dist.get_rank() if gather and dist.is_available() and dist.is_initialized() else 0
    labels = torch.arange(b, device=q.device) + rank * p.shape[0]
    if q_gold is not None and p_ids is not None:
        ids_all = gather_no_grad(p_ids) if gather else p_ids
        is_gold = (q_gold.unsqueeze(-1) == ids_all.view(1, 1, -1)).any(dim=1)  # [B, W*B*(1+H)]
        is_gold[torch.arange(b, device=q.device), labels] = False
        scores = scores.masked_fill(is_gold, float("-inf"))
    return F.cross_entropy(scores, labels)
