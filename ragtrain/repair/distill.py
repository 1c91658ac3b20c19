"""`distill` (post hoc): train one student encoder to reproduce a reference encoder's embeddings.

Every worker can then serve the same student, so queries and index agree by construction. The student may be
smaller and may output fewer dimensions: the reference vectors are then projected onto their top principal
directions (fitted on the anchor texts) and the student learns that projected space through a linear head.
Loss: mean squared error between unit vectors, i.e. 2 - 2 cos(student(x), reference(x)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ragtrain.embed.model import BiEncoder, build_encoder, load_tokenizer, tokenize
from ragtrain.index.vector_ops import DRIFT_SAMPLE, drift, sample_ids


class StudentEncoder(nn.Module):
    """A bi-encoder followed by an optional linear head to `out_dim`, L2-normalised."""

    def __init__(self, encoder: BiEncoder, out_dim: int | None = None):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.dim, out_dim, bias=False) if out_dim and out_dim != encoder.dim else None

    @property
    def dim(self) -> int:
        return self.head.out_features if self.head is not None else self.encoder.dim

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.encoder(input_ids, attention_mask)
        return F.normalize(self.head(x) if self.head is not None else x, dim=-1)


@dataclass
class Projection:
    """Reference space -> the student's (possibly smaller) space: top principal directions, re-normalised."""

    components: np.ndarray | None  # [d_ref, d_out] or None (identity)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.components is None:
            return x
        y = x @ self.components
        return y / np.clip(np.linalg.norm(y, axis=1, keepdims=True), 1e-12, None)


def fit_projection(reference: np.ndarray, out_dim: int) -> Projection:
    """PCA directions of the reference vectors (no centring: inner products are what retrieval uses)."""
    if out_dim >= reference.shape[1]:
        return Projection(None)
    _, _, vt = np.linalg.svd(reference, full_matrices=False)
    return Projection(vt[:out_dim].T.astype(np.float32))


def distill(
    student: StudentEncoder,
    tokenizer,
    texts: Sequence[str],
    reference: np.ndarray,
    max_length: int,
    steps: int = 200,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    roles: Sequence[str] | None = None,
) -> tuple[Projection, list[float]]:
    """Fit `student` to the reference vectors of `texts`; returns the projection used and the loss curve.
    `roles` ("query" / "passage" per text) applies retriever.query_prefix / passage_prefix as encoding does."""
    proj = fit_projection(reference, student.dim)
    target = torch.from_numpy(proj(reference)).float()
    opt = torch.optim.AdamW(student.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    losses = []
    student.train()
    for _ in range(steps):
        idx = rng.choice(len(texts), size=min(batch_size, len(texts)), replace=False)
        # one tokenize call per role, so each text gets its own prefix; rows are then in `order` of idx
        groups: dict[str | None, list[int]] = {}  # role -> positions in idx
        for i in idx:
            groups.setdefault(roles[i] if roles is not None else None, []).append(int(i))
        order = [i for g in groups.values() for i in g]
        out = torch.cat(
            [student(**tokenize(tokenizer, [texts[i] for i in g], max_length, role)) for role, g in groups.items()]
        )
        loss = (out - target[order]).pow(2).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    student.eval()
    return proj, losses


def distill_consensus(
    retrieval: Any, consensus: Any, mean_weights: dict[str, torch.Tensor], step: int
) -> tuple[Any, dict[str, float]]:
    """Pipeline phase `distilled` (sync=vector_avg, index.distill_steps > 0), from the consensus build `consensus`.

    The reference is the consensus: the re-normalised mean of every replica's vectors, for the corpus (the
    consensus index's shards) and the training queries. One student, initialised from the replicas' parameter
    mean, learns it on the driver; the corpus is then indexed with the student alone and the split evaluated
    with it. The student sees at most distill_steps x distill_batch_size texts, so only a seeded sample of that
    many passages is read (texts and vectors), never the whole corpus. Returns (the student's BuiltIndex, its
    metrics incl. drift_vs_consensus: mean 1 - cos of its corpus vectors to the consensus vectors, on a sample)."""
    cfg = retrieval.cfg
    idx, r = cfg.index, cfg.retriever
    qids = sorted(retrieval.data.train_qrels)
    ids = sample_ids(retrieval.doc_ids, idx.distill_steps * idx.distill_batch_size, cfg.seed)
    corpus_vecs = consensus.shards.vectors_of(ids)
    qvecs = retrieval.encode_queries(consensus, qids) if qids else corpus_vecs[:0]
    pos, passages = retrieval.positions, retrieval.passages()
    rows = [pos[d] for d in ids]  # a store's view reads several positions in one take; a list one by one
    sampled = list(passages[rows]) if not isinstance(passages, list) else [passages[i] for i in rows]
    texts = sampled + [retrieval.data.queries[q] for q in qids]
    roles = ["passage"] * len(ids) + ["query"] * len(qids)
    reference = np.concatenate([corpus_vecs, qvecs]).astype(np.float32)

    encoder = build_encoder(r)
    encoder.load_state_dict(mean_weights)
    student = StudentEncoder(encoder)
    torch.manual_seed(cfg.seed)
    _, losses = distill(
        student,
        load_tokenizer(r),
        texts,
        reference,
        r.passage_max_length,
        steps=idx.distill_steps,
        batch_size=idx.distill_batch_size,
        lr=idx.distill_lr,
        seed=cfg.seed,
        roles=roles,
    )
    weights = {k: v.detach().clone() for k, v in student.encoder.state_dict().items()}
    built, metrics = retrieval.build_and_evaluate("distilled", [weights], f"{r.model}@distilled", step)
    measured = sample_ids(retrieval.doc_ids, DRIFT_SAMPLE, cfg.seed + 1)
    return built, {
        **metrics,
        "drift_vs_consensus": drift(built.shards, consensus.shards, measured),
        "loss_first": float(np.mean(losses[:10])),
        "loss_last": float(np.mean(losses[-10:])),
        "steps": float(idx.distill_steps),
        "texts": float(len(texts)),
    }
