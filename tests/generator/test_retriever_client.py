"""The generator's encoder check against a saved index: it compares vectors as the index stores them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ragtrain.config.retriever import RetrieverConfig
from ragtrain.embed.encoders import QueryEncoder
from ragtrain.generator.retriever_client import check_encoder
from ragtrain.index.faiss_index import IndexMismatchError, build_index

CFG = RetrieverConfig(model="tiny")
WORDS = "alpha beta gamma delta river mountain archive protein lattice quantum harbor violet ledger orbit".split()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    from ragtrain.embed.model import build_encoder

    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in build_encoder(CFG).state_dict().items()}


@pytest.mark.parametrize("factory", ["Flat", "IVF2,Flat", "IVF2,PQ8x4np"])
def test_a_matching_encoder_passes_and_another_fails_whatever_the_index_type(factory: str) -> None:
    """IVF lists and PQ codes too: before, an IVF index skipped the check (no row map) and a raw comparison with PQ
    codes would have failed a matching encoder."""
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 30))).tolist()) for _ in range(300)]
    ours, other = _weights(0), _weights(1)
    vectors = QueryEncoder(CFG, [ours]).encode(texts, CFG.passage_max_length, "passage")
    index = build_index(vectors, [f"p{i}" for i in range(300)], factory, "fp", "tiny", 0, "fp32", 0)
    assert check_encoder(CFG, [ours], "fp32", texts[:8], index, 8) > 0.99
    with pytest.raises(IndexMismatchError, match="does not match the index"):
        check_encoder(CFG, [other], "fp32", texts[:8], index, 8)
