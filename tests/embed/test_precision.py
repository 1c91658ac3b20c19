"""precision=auto (ragtrain/embed/precision.py): bf16 only where the device runs it natively, fp32 elsewhere; said
once."""

from __future__ import annotations

import logging

import pytest
import torch

from ragtrain.embed import precision
from tests.conftest import REPO, compose, tiny_overrides

EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
# Kept at fp32 on purpose: it reproduces the published fp32 MTEB figures
EXPLICIT_FP32 = {("scifact_zeroshot", "index.precision"), ("squad_rag", "index.precision")}


def _torch_says_cpu_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.fixture
def lines(monkeypatch):
    """The ragtrain log lines of the test (each line is said once per process: start from a clean slate)."""
    monkeypatch.setattr(precision, "_said", set())
    got: list[tuple[int, str]] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append((record.levelno, record.getMessage()))

    handler = Grab()
    logging.getLogger("ragtrain").addHandler(handler)
    yield got
    logging.getLogger("ragtrain").removeHandler(handler)


@pytest.fixture
def no_native_bf16(monkeypatch):
    """A CPU whose oneDNN has no bf16 units (as an AVX2 CPU), whatever this one has."""
    monkeypatch.setattr(precision, "cpu_bf16_native", lambda: False)


def test_auto_on_this_cpu_is_what_torch_reports(lines) -> None:
    want = "bf16" if _torch_says_cpu_bf16() else "fp32"
    assert precision.resolve("auto", "cpu", "index.precision") == want
    assert precision.resolve("auto", "cpu", "index.precision") == want
    said = [m for _, m in lines]
    assert len(said) == 1, said  # once per process, not per call
    assert said[0].startswith(f"[precision] index.precision auto -> {want} (CPU: ")
    assert torch.backends.cpu.get_cpu_capability() in said[0]  # why: the ISA torch dispatches to


def test_explicit_values_pass_through() -> None:
    for value in ("fp32", "bf16", "fp16"):
        assert precision.resolve(value, "cpu", announce=False) == value


def test_auto_without_native_bf16_is_fp32(lines, no_native_bf16) -> None:
    assert precision.resolve("auto", "cpu", "retriever.train.precision") == "fp32"
    assert "no native bf16" in lines[0][1]


@pytest.mark.skipif(_torch_says_cpu_bf16(), reason="this CPU runs bf16 natively (no warning due)")
def test_explicit_bf16_on_this_cpu_warns_once(lines) -> None:
    for _ in range(3):
        assert precision.resolve("bf16", "cpu", "index.precision") == "bf16"
    warnings = [m for lvl, m in lines if lvl == logging.WARNING]
    assert len(warnings) == 1 and "0.17x" in warnings[0] and "index.precision=auto picks fp32" in warnings[0]


def test_explicit_bf16_on_a_cpu_without_bf16_units_warns_once(lines, no_native_bf16) -> None:
    for _ in range(3):
        assert precision.resolve("bf16", "cpu", "retriever.train.precision") == "bf16"
    warnings = [m for lvl, m in lines if lvl == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("[precision] retriever.train.precision=bf16 on a CPU without native bf16")
    assert "0.17x" in warnings[0] and "0.21x" in warnings[0]


def test_bf16_on_a_cpu_with_bf16_units_is_quiet(lines, monkeypatch) -> None:
    monkeypatch.setattr(precision, "cpu_bf16_native", lambda: True)
    assert precision.resolve("bf16", "cpu", "index.precision") == "bf16"
    assert lines == []


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_composed_experiments_default_to_auto(experiment: str) -> None:
    cfg = compose([f"experiment={experiment}"])
    for key in ("retriever.train.precision", "index.precision", "generator.train.precision"):
        node = cfg
        for part in key.split("."):
            node = node[part]
        want = "fp32" if (experiment, key) in EXPLICIT_FP32 else "auto"
        assert getattr(node, "value", node) == want, (experiment, key)


def test_plain_config_defaults_to_auto() -> None:
    cfg = compose([])
    got = (cfg.retriever.train.precision, cfg.index.precision, cfg.generator.train.precision)
    assert [p.value for p in got] == ["auto"] * 3


def _encode(prec: str) -> torch.Tensor:
    from ragtrain.config.retriever import RetrieverConfig
    from ragtrain.embed.encoders import EncodeBatch
    from ragtrain.embed.model import build_encoder

    retriever = RetrieverConfig(model="tiny")
    torch.manual_seed(0)
    weights = build_encoder(retriever).state_dict()
    enc = EncodeBatch(retriever, weights, 32, batch_size=4, precision=prec)  # in-process: the CPU
    texts = [f"passage {i} about topic {i % 3} " * (1 + i % 4) for i in range(9)]
    return torch.from_numpy(enc.encode(texts))


def test_auto_encodes_as_the_resolved_precision_on_this_cpu() -> None:
    want = "bf16" if _torch_says_cpu_bf16() else "fp32"
    assert torch.equal(_encode("auto"), _encode(want))


def test_auto_encodes_in_fp32_on_a_cpu_without_bf16_units(no_native_bf16) -> None:
    auto, fp32 = _encode("auto"), _encode("fp32")
    assert torch.equal(auto, fp32)
    assert not torch.equal(auto, _encode("bf16"))  # bf16 weights would give other vectors


def test_trainer_autocast_follows_auto(no_native_bf16) -> None:
    from ragtrain.embed.model import autocast

    with autocast("auto", torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
    with autocast("bf16", torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu")


def test_index_config_is_resolved_for_the_encode_actors(no_native_bf16, tmp_path) -> None:
    from ragtrain.config import to_typed

    auto = ["retriever.train.precision=auto", "index.precision=auto", "generator.train.precision=auto"]
    cfg = to_typed(compose([*tiny_overrides(tmp_path), *auto]))  # tiny_overrides pins fp32 for the other tests
    assert cfg.index.precision.value == "auto"
    assert precision.resolved_index(cfg).precision.value == "fp32"
    assert precision.resolved_params(cfg)["precision/index"] == "fp32"
    cfg.stages = ["retriever", "index", "generator"]
    assert precision.resolved_params(cfg) == {
        "precision/index": "fp32",
        "precision/retriever_train": "fp32",
        "precision/generator_train": "fp32",
    }


def test_generator_autocast_follows_auto(no_native_bf16) -> None:
    from ragtrain.generator.steps import autocast

    with autocast("auto", torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
    with autocast("bf16", torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu")


def test_per_batch_calls_stay_quiet(lines, no_native_bf16) -> None:
    """autocast / inference_weights run every batch: the driver or rank 0 speaks for them, once."""
    from ragtrain.embed.model import autocast

    for _ in range(3):
        with autocast("bf16", torch.device("cpu")), autocast("auto", torch.device("cpu")):
            pass
    assert lines == []
