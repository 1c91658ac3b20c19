"""GradCache: the contrastive loss of a large batch in the memory of a small one (`retriever.train.cache_chunk_size`).

The gathered InfoNCE (ragtrain/retriever/loss.py) couples every query with every passage of the global batch, so
plain gradient accumulation (a loss per micro-batch) would change the objective: fewer negatives. GradCache
(Gao et al. 2021; tevatron's GradCache, sentence-transformers' CachedMultipleNegativesRankingLoss) keeps the
objective and splits only the encoder's work:

1. embed: every chunk of at most N queries / N passages through the encoder WITHOUT autograd (no activations
   kept), recording torch's RNG state before each chunk;
2. loss: the full-batch loss over those embeddings (leaf tensors), gathered across workers exactly as without
   the cache; its backward gives d loss / d embedding for every local query and passage (with the autograd
   gather, the passage gradients already hold every worker's share);
3. replay: each chunk again WITH autograd, the RNG state of step 1 restored (dropout draws the same masks, so
   the embeddings are those the loss saw), and backward of sum(embedding * cached gradient). By the chain rule
   the parameter gradients accumulated over the chunks are the full batch's.

Peak activation memory is that of one chunk; the price is a second forward pass. In fp32 the gradients are the
uncached loss's to 1e-5 (tests/retriever/test_gradcache.py); under bf16 autocast only to bf16 rounding, since
chunks change the shapes the matmuls round over (as any change of batch composition does).

Under DDP the chunk backwards must all-reduce ONCE per step: every chunk but the last runs under
`model.no_sync()` (gradients accumulate locally), the last one's backward all-reduces the accumulated sum, so
comm hooks (counting, PowerSGD, top-k with error feedback) see one step as one step. Step 1 runs on the
unwrapped module: it has no backward, and DDP should not see a forward without one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

Batch = dict[str, torch.Tensor]


class RngState:
    """torch's CPU RNG state (and the CUDA one of `device`), captured now and replayable later."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.devices = [device.index if device.index is not None else torch.cuda.current_device()] if self.cuda else []
        self.cpu_state = torch.get_rng_state()
        self.cuda_state = torch.cuda.get_rng_state(self.devices[0]) if self.cuda else None

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block with the captured state; the current state is back afterwards (fork_rng)."""
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu_state)
            if self.cuda_state is not None:  # captured on a CUDA device
                torch.cuda.set_rng_state(self.cuda_state, self.devices[0])
            yield


def split(batch: Batch, chunk_size: int) -> list[Batch]:
    """Row chunks of a tokenised batch, each cut to its own longest sequence (trailing all-padding columns go)."""
    out = []
    n = batch["attention_mask"].shape[0]
    for start in range(0, n, chunk_size):
        chunk = {k: v[start : start + chunk_size] for k, v in batch.items()}
        used = chunk["attention_mask"].any(dim=0).nonzero()
        length = int(used.max()) + 1 if used.numel() else 1
        out.append({k: v[:, :length] for k, v in chunk.items()})
    return out


def cached_step(
    model: nn.Module,
    q: Batch,
    p: Batch,
    chunk_size: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    autocast: Callable[[], AbstractContextManager[object]] = nullcontext,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Forward + backward of `loss_fn(q_emb, p_emb)` in chunks of `chunk_size` texts; returns the (detached) loss.

    `model(q, p) -> (q_emb, p_emb)` (ragtrain.retriever.train.QPEncoder, possibly DDP-wrapped; either side may be
    None); gradients accumulate into the parameters' `.grad` as `loss.backward()` would put them there.
    """
    if chunk_size <= 0:
        raise ValueError(f"cache_chunk_size must be > 0, got {chunk_size}")
    device = device or q["input_ids"].device
    inner = getattr(model, "module", model)  # DDP -> the QPEncoder it wraps
    chunks = [("q", c) for c in split(q, chunk_size)] + [("p", c) for c in split(p, chunk_size)]

    # 1. embed without autograd, remembering each chunk's RNG state
    states, embs = [], []
    with torch.no_grad():
        for side, c in chunks:
            states.append(RngState(device))
            with autocast():
                embs.append(_embed(inner, side, c))
    q_emb = torch.cat([e for (side, _), e in zip(chunks, embs) if side == "q"]).requires_grad_()
    p_emb = torch.cat([e for (side, _), e in zip(chunks, embs) if side == "p"]).requires_grad_()

    # 2. the full-batch loss over the cached embeddings (collectives of the gathered loss run here)
    loss = loss_fn(q_emb, p_emb)
    loss.backward()
    assert q_emb.grad is not None and p_emb.grad is not None  # leaves that require grad: backward filled both
    grads = {
        "q": list(q_emb.grad.split([c["input_ids"].shape[0] for s, c in chunks if s == "q"])),
        "p": list(p_emb.grad.split([c["input_ids"].shape[0] for s, c in chunks if s == "p"])),
    }

    # 3. replay each chunk with autograd and push the cached gradients through it; DDP reduces on the last one
    no_sync = getattr(model, "no_sync", None)
    for i, ((side, c), state) in enumerate(zip(chunks, states)):
        last = i == len(chunks) - 1
        with no_sync() if no_sync is not None and not last else nullcontext():
            with state.replay(), autocast():
                emb = _embed(model, side, c)
            (emb * grads[side].pop(0)).sum().backward()
    return loss.detach()


def _embed(model: nn.Module, side: str, chunk: Batch) -> torch.Tensor:
    q_emb, p_emb = model(chunk, None) if side == "q" else model(None, chunk)
    return q_emb if side == "q" else p_emb
