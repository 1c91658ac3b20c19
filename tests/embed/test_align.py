"""Procrustes / least-squares alignment: recovers a known rotation exactly and reduces real replica drift."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ragtrain.embed.align import embedding_drift, fit_alignment


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_recovers_random_rotation_exactly() -> None:
    rng = np.random.default_rng(0)
    ref = _unit(rng.normal(size=(500, 32)))
    q, _ = np.linalg.qr(rng.normal(size=(32, 32)))
    rotated = ref @ q.T  # the "other replica": same geometry, rotated space
    assert embedding_drift(rotated, ref) > 0.5
    for method in ("orthogonal", "lstsq"):
        aligned = fit_alignment(rotated[:100], ref[:100], method).apply(rotated)  # fit on anchors, apply to all
        assert embedding_drift(aligned, ref) < 1e-6


def test_orthogonal_map_is_orthogonal() -> None:
    rng = np.random.default_rng(1)
    a = fit_alignment(rng.normal(size=(50, 8)), rng.normal(size=(50, 8)))
    np.testing.assert_allclose(a.weight @ a.weight.T, np.eye(8), atol=1e-10)


def test_reduces_drift_between_real_replicas() -> None:
    """Two tiny encoders fine-tuned apart from one init: alignment on anchors shrinks drift on held-out texts."""
    from ragtrain.config.retriever import RetrieverConfig
    from ragtrain.embed.model import build_encoder

    torch.manual_seed(0)
    base = build_encoder(RetrieverConfig(model="tiny"))
    replicas = []
    for seed in (1, 2):
        m = build_encoder(RetrieverConfig(model="tiny"))
        m.load_state_dict(base.state_dict())
        g = torch.Generator().manual_seed(seed)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        for _ in range(5):  # a few divergent steps: each replica pulls toward random targets
            ids = torch.randint(5, 1000, (16, 10), generator=g)
            target = torch.nn.functional.normalize(torch.randn(16, m.dim, generator=g), dim=-1)
            loss = -(m(ids, torch.ones_like(ids)) * target).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        replicas.append(m.eval())
    ids = torch.randint(5, 1000, (400, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        a, b = (r(ids, torch.ones_like(ids)).numpy() for r in replicas)
    before = embedding_drift(a[200:], b[200:])
    after = embedding_drift(fit_alignment(a[:200], b[:200]).apply(a[200:]), b[200:])
    assert before > 1e-3
    assert after < 0.5 * before


def test_bad_method_and_shapes() -> None:
    with pytest.raises(ValueError, match="valid choices"):
        fit_alignment(np.zeros((3, 2)), np.zeros((3, 2)), "cca")
    with pytest.raises(ValueError, match="same N"):
        fit_alignment(np.zeros((3, 2)), np.zeros((4, 2)))


@pytest.mark.slow(reason="a run of its own; the default suite aligns in the shared quickstart (zero-shot on")
def test_align_anchors_work_without_the_zeroshot_evaluation(ray_session, tmp_path) -> None:
    """zeroshot_eval=false (sync_compare's later variants): the stale index is still built, aligned and evaluated."""
    from ragtrain.config import to_typed
    from ragtrain.pipeline.stages import run
    from tests.conftest import compose, tiny_overrides

    cfg = to_typed(
        compose(
            [
                "experiment=quickstart",
                *tiny_overrides(tmp_path),
                "zeroshot_eval=false",
                "index.align_anchors=32",
                "logger=none",
            ]
        )
    )
    results = run(cfg)
    assert "zeroshot" not in results  # not evaluated ...
    assert results["stale_aligned"]["anchors"] == 32 and "ndcg@10" in results["stale"]  # ... but aligned
