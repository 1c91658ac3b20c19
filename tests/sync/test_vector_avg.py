"""sync=vector_avg end to end: replicas kept apart, the index holds the re-normalised mean of their vectors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ragtrain.config import to_typed
from ragtrain.data import make_synthetic
from ragtrain.embed.model import build_encoder, encode_texts, load_tokenizer
from ragtrain.index.sharded import open_saved
from ragtrain.pipeline.stages import run
from tests.conftest import compose, tiny_overrides


@pytest.mark.slow(
    reason="4 index builds (param mean, 2 replicas, student): the distill and consensus math is unit-tested"
)
def test_vector_avg_index_is_mean_of_replica_vectors(ray_session, tmp_path) -> None:
    cfg = to_typed(
        compose(
            [
                "experiment=quickstart",
                *tiny_overrides(tmp_path),
                "sync=vector_avg",
                "zeroshot_eval=false",
                "retriever.train.lr=5e-3",
                "index.distill_steps=100",
                "index.distill_lr=1e-4",
            ]
        )
    )
    results = run(cfg)
    assert {"param_avg", "trained", "train", "distilled"} <= set(results)
    # distilled: one student, started from the parameter mean, moves its vectors toward the consensus vectors
    start, end = results["param_avg"]["drift_vs_consensus"], results["distilled"]["drift_vs_consensus"]
    assert start > 0 and end < 0.5 * start, (start, end)
    assert results["distilled"]["loss_last"] < results["distilled"]["loss_first"]

    enc_dir = tmp_path / "out" / "encoder"
    replicas = [load_file(str(enc_dir / f"replica_{r}.safetensors")) for r in range(2)]
    diff = max((replicas[0][k] - replicas[1][k]).abs().max().item() for k in replicas[0])
    assert diff > 1e-4  # the replicas really trained apart
    mean = load_file(str(enc_dir / "encoder.safetensors"))
    for k in mean:
        torch.testing.assert_close(mean[k], (replicas[0][k] + replicas[1][k]) / 2)

    data = make_synthetic(num_entities=cfg.data.num_entities, seed=cfg.data.seed)
    index = open_saved(tmp_path / "out" / "index", expect_corpus=data.fingerprint())
    assert "vector_avg" in index.meta.encoder  # the saved index is the consensus one, not the student's
    texts = [p.full_text() for p in data.corpus.values()][:10]
    tok = load_tokenizer(cfg.retriever)
    vecs = []
    for state in replicas:
        model = build_encoder(cfg.retriever)
        model.load_state_dict(state)
        vecs.append(encode_texts(model, tok, texts, cfg.retriever.passage_max_length).numpy())
    expected = vecs[0] + vecs[1]
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    stored = index.index.reconstruct_n(0, 10)
    np.testing.assert_allclose(stored, expected, atol=1e-5)


def test_query_encoder_of_several_replicas_is_their_renormalised_mean() -> None:
    """The consensus index's queries: every replica encodes, the unit vectors are averaged and re-normalised."""
    from ragtrain.config.retriever import RetrieverConfig
    from ragtrain.embed.encoders import QueryEncoder

    cfg = RetrieverConfig(model="tiny")
    replicas = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        replicas.append({k: v.detach().clone() for k, v in build_encoder(cfg).state_dict().items()})
    texts = ["which mill stands on the river?", "the archive of the harbour"]
    each = [QueryEncoder(cfg, [w]).encode(texts, role="query") for w in replicas]
    mean = (each[0] + each[1]) / np.linalg.norm(each[0] + each[1], axis=1, keepdims=True)
    both = QueryEncoder(cfg, replicas).encode(texts, role="query")
    np.testing.assert_allclose(both, mean, rtol=0, atol=1e-6)
    assert np.abs(each[0] - each[1]).max() > 1e-3  # the replicas differ, so the mean is not either one
