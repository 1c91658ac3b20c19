"""retriever.lora: only the adapters train and cross the wire; merged weights are a plain encoder's, same vectors."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ragtrain.config.retriever import LoraConfig, RetrieverConfig, TinyEncoderConfig
from ragtrain.embed.model import build_encoder
from ragtrain.retriever.lora import apply_lora, has_lora, plain_state_dict, trainable
from ragtrain.retriever.loss import contrastive_loss
from ragtrain.retriever.train import QPEncoder
from ragtrain.runtime.errors import ConfigError
from ragtrain.sync.comm import all_reduce_bytes
from tests.conftest import spawn
from tests.retriever.test_gradcache import _inputs, counting_ddp
from tests.retriever.test_loss import _free_port

HIDDEN, LAYERS, RANK = 32, 2, 4
CFG = RetrieverConfig(
    model="tiny", tiny=TinyEncoderConfig(hidden_size=HIDDEN, num_layers=LAYERS, num_heads=2, intermediate_size=64)
)
_BASE: list = []


def _encoder(rank: int = 0):
    """A copy of one seeded tiny encoder (built once per process), with LoRA adapters of `rank` (0: none)."""
    if not _BASE:
        torch.manual_seed(0)
        _BASE.append(build_encoder(CFG))
    enc = copy.deepcopy(_BASE[0])
    torch.manual_seed(1)
    return apply_lora(enc, LoraConfig(rank=rank)) if rank else enc


def _train(enc, steps: int = 3) -> None:
    """A few SGD steps on the contrastive loss, so the adapters' B matrices are no longer zero."""
    q, p, q_gold, p_ids = _inputs(0, 1)
    opt = torch.optim.SGD(trainable(enc), lr=0.5)
    for _ in range(steps):
        opt.zero_grad()
        contrastive_loss(enc(**q), enc(**p), 0.05, q_gold, p_ids, gather=False).backward()
        opt.step()


def test_only_the_adapters_train() -> None:
    enc = _encoder(RANK)
    # query and value projections (HIDDEN x HIDDEN) of every layer: A is RANK x HIDDEN, B is HIDDEN x RANK
    assert sum(p.numel() for p in trainable(enc)) == LAYERS * 2 * (2 * RANK * HIDDEN)
    assert all("lora_" in n for n, p in enc.named_parameters() if p.requires_grad)
    full = sum(p.numel() for p in _encoder(0).parameters())
    assert sum(p.numel() for p in trainable(_encoder(0))) == full
    assert sum(p.numel() for p in trainable(enc)) < 0.01 * full


def test_merged_weights_load_strictly_into_a_plain_encoder_with_the_same_vectors() -> None:
    enc = _encoder(RANK)
    _train(enc)
    state = plain_state_dict(enc)
    plain = _encoder(0)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    plain.load_state_dict(state, strict=True)  # no lora_ keys, no base_model. prefixes
    assert any(not torch.equal(before[k], state[k]) for k in before)  # training changed the merged weights
    assert has_lora(enc)  # merging worked on a copy: the training model keeps its adapters
    q, p, _, _ = _inputs(0, 1)
    enc.eval(), plain.eval()
    with torch.no_grad():
        for batch in (q, p):
            torch.testing.assert_close(plain(**batch), enc(**batch), atol=1e-5, rtol=1e-5)


def test_lora_settings_fail_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"retriever\.lora\.rank must be > 0"):
        LoraConfig(rank=-1)
    with pytest.raises(ConfigError, match=r"retriever\.lora\.dropout"):
        LoraConfig(rank=4, dropout=1.0)
    with pytest.raises(ValueError, match=r"retriever\.lora\.target_modules"):
        apply_lora(_encoder(0), LoraConfig(rank=4, target_modules=["no_such_module"]))


def _job(rank: int, kind: str, lora: int, chunk: int) -> dict:
    """One step on 2 workers: `ddp` (gradients all-reduced in backward) or `average` (local steps, then the
    parameters the recipe passes to a mixer averaged, as local SGD does); the bytes sent and the gradients."""
    from ragtrain.retriever.gradcache import cached_step
    from ragtrain.sync.base import average_params
    from ragtrain.sync.comm import STATS

    enc = _encoder(lora)
    model = counting_ddp(QPEncoder(enc)) if kind == "ddp" else QPEncoder(enc)
    params = trainable(enc)  # what the recipe gives the optimizer and the sync strategy
    q, p, q_gold, p_ids = _inputs(rank, 2)
    groups = None if kind == "ddp" else [[0], [1]]

    def loss_fn(qe, pe):
        return contrastive_loss(qe, pe, 0.05, q_gold, p_ids, grad_groups=groups)

    STATS.reset()
    if chunk:
        cached_step(model, q, p, chunk, loss_fn)
    else:
        loss_fn(*model(q, p)).backward()
    grads = {n: v.grad.clone() for n, v in enc.named_parameters() if v.grad is not None}
    torch.optim.SGD(params, lr=0.1).step()
    if kind == "average":
        average_params(params)
    sent = getattr(model, "grad_bytes", 0) + STATS.bytes.get("params", 0)
    return {"bytes": sent, "grads": grads, "n": sum(v.numel() for v in params)}


JOBS = [("ddp", 0, 0), ("ddp", RANK, 0), ("ddp", RANK, 3), ("average", 0, 0), ("average", RANK, 0)]


def _workers(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {job: _job(rank, *job) for job in JOBS}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def test_sync_strategies_send_only_the_adapters(tmp_path: Path) -> None:
    out = str(tmp_path / "lora.pt")
    spawn(_workers, (2, _free_port(), out), 2)
    r = torch.load(out, weights_only=False)
    for kind in ("ddp", "average"):
        full, lora = r[(kind, 0, 0)], r[(kind, RANK, 0)]
        assert lora["n"] == LAYERS * 2 * 2 * RANK * HIDDEN and full["n"] > 100 * lora["n"]
        # gradients (ddp: the raw bucket bytes) / parameters (average: ring all-reduce bytes) of what trains only
        assert lora["bytes"] == (4 * lora["n"] if kind == "ddp" else all_reduce_bytes(4 * lora["n"], 2)), kind
        assert full["bytes"] == (4 * full["n"] if kind == "ddp" else all_reduce_bytes(4 * full["n"], 2)), kind
    # GradCache with LoRA under DDP: the same adapter gradients as without the cache
    a, b = r[("ddp", RANK, 3)], r[("ddp", RANK, 0)]
    assert set(a["grads"]) == set(b["grads"]) and all("lora_" in k for k in a["grads"])
    for k in a["grads"]:
        torch.testing.assert_close(a["grads"][k], b["grads"][k], atol=1e-5, rtol=1e-5)
    assert a["bytes"] == b["bytes"]
