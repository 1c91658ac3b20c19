"""Validation during training (`retriever.train.val_every`): dev nDCG@10 of the encoder being trained.

A fixed sample, built once on the driver: the first `val_queries` dev queries, every passage of their relevant
documents, and seeded random passages up to `val_passages`. Rank 0 encodes the sample with its replica and ranks
it exactly (inner products); chunked corpora are scored per document (MaxP) as the final evaluation is. With the
whole corpus and every dev query in the sample, `val/ndcg@10` at the last step equals the trained index's dev
nDCG@10 (tested). The figure is logged with the training window and reported to Tune, so ASHA and searchers can
judge retrieval quality instead of the training loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ragtrain.data import RetrievalData
from ragtrain.embed.model import encode_texts
from ragtrain.eval.metrics import evaluate, maxp_run
from ragtrain.index.faiss_index import exact_search

VAL_DEPTH = 10  # nDCG@10 / Recall@10; MaxP retrieves this many documents from up to 10x as many passages


@dataclass
class ValSet:
    """What rank 0 needs to validate: texts and ids of the sample, qrels on documents, the chunk -> document map."""

    qids: list[str]
    queries: list[str]
    pids: list[str]
    passages: list[str]
    qrels: dict[str, dict[str, int]]
    doc_of: dict[str, str]


def make_val_set(data: RetrievalData, num_queries: int, num_passages: int, seed: int) -> ValSet:
    """The fixed validation sample (see the module docstring)."""
    qids = sorted(data.eval_qrels)[:num_queries]
    relevant = {d for q in qids for d, g in data.eval_qrels[q].items() if g > 0}
    doc = data.doc_of or {}
    gold = [p for p in data.corpus if doc.get(p, p) in relevant]  # every chunk of a relevant document
    others = [p for p in data.corpus if doc.get(p, p) not in relevant]
    rng = np.random.default_rng(seed)
    extra = max(0, num_passages - len(gold))
    picked = [others[i] for i in sorted(rng.permutation(len(others))[:extra])]
    pids = gold + picked
    return ValSet(
        qids,
        [data.queries[q] for q in qids],
        pids,
        [data.corpus[p].full_text() for p in pids],
        {q: dict(data.eval_qrels[q]) for q in qids},
        {p: doc[p] for p in pids if p in doc},
    )


@torch.no_grad()
def validate(
    encoder, tokenizer, val: ValSet, query_max_length: int, passage_max_length: int, precision, device: torch.device
) -> dict[str, float]:
    """val/ndcg@10 and val/recall@10 of `encoder` on the sample."""
    p = encode_texts(encoder, tokenizer, val.passages, passage_max_length, 32, precision, device, role="passage")
    q = encode_texts(encoder, tokenizer, val.queries, query_max_length, 32, precision, device, role="query")
    # chunks: the whole sample, so MaxP always finds VAL_DEPTH documents (one long document's chunks could fill any
    # fixed passage depth on their own)
    depth = len(val.pids) if val.doc_of else min(len(val.pids), VAL_DEPTH)
    top = exact_search(q.numpy(), p.numpy(), depth)[1].tolist()  # the index search, on the fixed sample
    run = {qid: [val.pids[i] for i in row] for qid, row in zip(val.qids, top)}
    if val.doc_of:
        run = maxp_run(run, val.doc_of, depth=VAL_DEPTH)
    m = evaluate(run, val.qrels)
    return {"val/ndcg@10": m["ndcg@10"], "val/recall@10": m["recall@10"]}
