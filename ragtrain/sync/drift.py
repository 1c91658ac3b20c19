"""Drift: how far the workers' replicas (and so their vectors) disagree. Every worker calls these together.

Definitions (W replicas, probe set of N passages and Q queries fixed for the run):
- `drift/param_divergence`: mean over replicas i of ||theta_i - theta_mean|| / ||theta_mean|| (flat parameters).
- `drift/replica_cosine`: e_i(p) = replica i's embedding of probe passage p, e_mean(p) their mean; the mean over
  passages and replicas of 1 - cos(e_i(p), e_mean(p)). 0 when all replicas agree.
- `drift/replica_topk_jaccard`: each replica ranks the N probe passages for each probe query; the mean over
  queries and replica pairs of |top10_i ∩ top10_j| / |top10_i ∪ top10_j|. 1 when all replicas agree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ragtrain.index.faiss_index import exact_search
from ragtrain.sync.base import mean_and_divergence, world_size


def param_divergence(params: list[nn.Parameter]) -> float:
    """Mean relative L2 distance of the replicas' parameters from their mean (measurement: not counted)."""
    return mean_and_divergence(params)[1]


def replica_cosine(emb: torch.Tensor) -> float:
    """Mean 1 - cos(replica embedding, mean embedding) over probe passages and replicas; emb: [N, d] local."""
    w = world_size()
    if w == 1:
        return 0.0
    mean = emb.clone()
    dist.all_reduce(mean)
    mean /= w
    drift = (1 - F.cosine_similarity(emb, mean, dim=-1)).clamp(min=0).mean().reshape(1)  # no -1e-8 from rounding
    dist.all_reduce(drift)
    return drift.item() / w


def topk_jaccard(q: torch.Tensor, p: torch.Tensor, k: int = 10) -> float:
    """Mean top-k overlap (Jaccard) between replicas' rankings of the probe passages for the probe queries."""
    w = world_size()
    if w == 1:
        return 1.0

    rows = exact_search(q.float().cpu().numpy(), p.float().cpu().numpy(), k)[1]  # [Q, k], as every index ranks
    top = torch.from_numpy(rows).to(q.device).contiguous()  # NCCL gathers device tensors
    parts = [torch.empty_like(top) for _ in range(w)]
    dist.all_gather(parts, top)
    scores = []
    for i in range(w):
        for j in range(i + 1, w):
            for a, b in zip(parts[i].tolist(), parts[j].tolist()):
                sa, sb = set(a), set(b)
                scores.append(len(sa & sb) / len(sa | sb))
    return sum(scores) / len(scores)


@torch.no_grad()
def drift_metrics(params: list[nn.Parameter], q: torch.Tensor, p: torch.Tensor) -> dict[str, float]:
    """All three drift figures for this step, from this replica's vectors of the probe queries `q` and passages
    `p` (ragtrain.embed.model.encode_texts, in eval mode: the replicas, not the dropout noise), on the device the
    process group's collectives run on."""
    return {
        "drift/param_divergence": param_divergence(params),
        "drift/replica_cosine": replica_cosine(p),
        "drift/replica_topk_jaccard": topk_jaccard(q, p),
    }
