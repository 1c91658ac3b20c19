"""Contrastive InfoNCE with in-batch negatives gathered from every worker, gradients flowing through the gather.

Why the loss is obviously worker-count invariant:
- every worker scores its OWN queries against ALL passages of the global batch (all_gather with autograd, so
  the gradient w.r.t. a worker's passages comes back from every worker that scored them: a reduce-scatter SUM);
- each worker's loss is the MEAN over its own queries, and DDP (or any averaging strategy) takes the mean of the
  workers' gradients, so the update is the gradient of the mean over the global batch;
- with equal local batch sizes, mean-of-means == global mean: 2 workers x B == 1 worker x 2B exactly.
No x world_size factor is needed anywhere (cf. tevatron #30).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def gather_with_grad(t: torch.Tensor) -> torch.Tensor:
    """Concatenate `t` from all ranks in rank order; backward sums the gradients to each owner."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    import warnings

    from torch.distributed.nn.functional import all_gather

    from ragtrain.sync.comm import STATS, all_gather_bytes

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
    from ragtrain.sync.comm import STATS, all_gather_bytes

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    STATS.add("embeddings", all_gather_bytes(t.numel() * t.element_size(), dist.get_world_size()))
    dist.all_gather(parts, t)
    return torch.cat(parts, dim=0)


def contrastive_loss(
    q: torch.Tensor,
    p: torch.Tensor,
    temperature: float,
    q_gold: torch.Tensor | None = None,
    p_ids: torch.Tensor | None = None,
    gather: bool = True,
) -> torch.Tensor:
    """InfoNCE of local queries against the gathered passages of all workers (mean over local queries).

    q: [B, d] local query embeddings. p: [B * (1 + H), d] local passages: the B positives first (positive of
    query i at row i), then the H hard negatives of each query. q_gold: [B, G] corpus positions of each query's
    gold passages (padded with -1); p_ids: [B * (1 + H)] corpus positions of the local passages. With both given,
    any gathered passage that is gold for a query (other than its own positive) is masked out: a duplicate or
    second gold passage in the batch is not a negative. gather=False scores against local passages only (for
    strategies that must not synchronise workers every step, e.g. async_ps).
    """
    b = q.shape[0]
    p_all = gather_with_grad(p) if gather else p
    scores = q @ p_all.T / temperature  # [B, W * B * (1 + H)]
    rank = dist.get_rank() if gather and dist.is_available() and dist.is_initialized() else 0
    labels = torch.arange(b, device=q.device) + rank * p.shape[0]
    if q_gold is not None and p_ids is not None:
        ids_all = gather_no_grad(p_ids) if gather else p_ids
        is_gold = (q_gold.unsqueeze(-1) == ids_all.view(1, 1, -1)).any(dim=1)  # [B, W*B*(1+H)]
        is_gold[torch.arange(b, device=q.device), labels] = False
        scores = scores.masked_fill(is_gold, float("-inf"))
    return F.cross_entropy(scores, labels)
