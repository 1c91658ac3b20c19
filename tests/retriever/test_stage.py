"""The retriever stage's zero-shot phase and saved weights, on a stand-in for the run's retrieval facade."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from ragtrain.config import to_typed
from ragtrain.retriever.stage import RetrieverRun, parameter_mean, save_trained, zeroshot_phase
from tests.conftest import compose, tiny_overrides


class FakeRetrieval:
    """Records what the phase asks of the index: builds (evaluated or not) and mining."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def build_and_evaluate(self, phase, weights, name, step):
        self.calls.append(f"evaluate {phase}")
        return SimpleNamespace(phase=phase), {"ndcg@10": 0.5}

    def build(self, phase, weights, name, step):
        self.calls.append(f"build {phase}")
        return SimpleNamespace(phase=phase)

    def mine_negatives(self, built):
        self.calls.append("mine")
        return {"q": [1]}


def _run(tmp_path: Path, *overrides: str) -> RetrieverRun:
    cfg = to_typed(compose(tiny_overrides(tmp_path) + list(overrides)))
    return RetrieverRun(cfg, None, tmp_path, None, FakeRetrieval(), {"w": torch.zeros(2)}, "tiny@init")


def test_static_negatives_are_mined_once_from_the_evaluated_zero_shot_index(tmp_path) -> None:
    r = _run(tmp_path, "retriever.train.hard_negatives=1", "refresh.enabled=false", "index.align_anchors=0")
    zeroshot_phase(r)
    assert r.retrieval.calls == ["evaluate zeroshot", "mine"]
    assert r.negatives == {"q": [1]} and r.results["zeroshot"] == {"ndcg@10": 0.5} and r.stale is None


def test_alignment_alone_builds_the_zero_shot_vectors_without_evaluating(tmp_path) -> None:
    r = _run(tmp_path, "zeroshot_eval=false", "retriever.train.hard_negatives=0", "index.align_anchors=8")
    zeroshot_phase(r)
    assert r.retrieval.calls == ["build zeroshot"] and r.stale is r.zeroshot and "zeroshot" not in r.results


def test_nothing_needs_the_zero_shot_index(tmp_path) -> None:
    r = _run(tmp_path, "zeroshot_eval=false", "retriever.train.hard_negatives=0", "index.align_anchors=0")
    zeroshot_phase(r)
    assert r.retrieval.calls == [] and r.zeroshot is None


def test_vector_avg_saves_every_replica_and_their_parameter_mean(tmp_path) -> None:
    from ragtrain.embed.weights import load_weights

    r = _run(tmp_path)
    reps = [
        {"w": torch.tensor([1.0, 3.0]), "n": torch.tensor([7])},
        {"w": torch.tensor([3.0, 5.0]), "n": torch.tensor([9])},
    ]
    fit = SimpleNamespace(weights=reps[0], steps=4, seconds=1.0, metrics={"train/loss": 0.1}, replicas=reps)
    save_trained(r, fit)
    assert torch.equal(r.weights["w"], torch.tensor([2.0, 4.0])) and torch.equal(r.weights["n"], torch.tensor([7]))
    assert torch.equal(load_weights(tmp_path / "encoder")["w"], parameter_mean(reps)["w"])
    assert torch.equal(load_weights(tmp_path / "encoder", "replica_1")["w"], reps[1]["w"])
    assert r.step == 4 and r.encoder_name.endswith("encoder.safetensors") and r.results["train"]["steps"] == 4
