"""GradCache (retriever.train.cache_chunk_size) gives the gradients of the uncached gathered loss, to 1e-5.

1 worker: cached == uncached for several chunk sizes (uneven last chunk, chunk = 1); dropout masks are replayed.
2 workers (ONE gloo spawn runs every case): under DDP cached == uncached == 1 worker x 2B on both ranks, with the
same gradient bytes (one all-reduce per step: no_sync on all chunks but the last); with replicas that train apart
(gradient groups of one rank each, no DDP) cached == uncached per rank.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ragtrain.config.retriever import RetrieverConfig, RetrieverTrainConfig, TinyEncoderConfig
from ragtrain.embed.model import build_encoder
from ragtrain.retriever.gradcache import cached_step, split
from ragtrain.retriever.loss import contrastive_loss
from ragtrain.retriever.train import QPEncoder
from ragtrain.runtime.errors import ConfigError
from tests.conftest import spawn
from tests.retriever.test_loss import H, _free_port, _pad, global_batch

B = 4  # per-worker queries (test_loss.global_batch: 2B queries, H negatives each)
TOL = dict(atol=1e-5, rtol=1e-5)


_MODELS: dict[float, QPEncoder] = {}


def _model(dropout: float = 0.0) -> QPEncoder:
    """A fresh copy of one seeded tiny encoder (built once per process: building loads the tokenizer)."""
    if dropout not in _MODELS:
        torch.manual_seed(0)
        cfg = RetrieverConfig(
            model="tiny",
            tiny=TinyEncoderConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, dropout=dropout),
        )
        _MODELS[dropout] = QPEncoder(build_encoder(cfg))
    return copy.deepcopy(_MODELS[dropout])


def _inputs(rank: int, world: int):
    q, pos, neg, gold, neg_ids = global_batch()
    b = len(q) // world
    sl, nsl = slice(rank * b, (rank + 1) * b), slice(rank * b * H, (rank + 1) * b * H)
    gmax = max(len(g) for g in gold)
    q_gold = torch.tensor([g + [-1] * (gmax - len(g)) for g in gold[sl]])
    p_ids = torch.tensor(list(range(len(q)))[sl] + neg_ids[nsl])
    return _pad(q[sl]), _pad(pos[sl] + neg[nsl]), q_gold, p_ids


def counting_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """Plain DDP whose all-reduce hook counts the gradient bytes it sends (in `model.grad_bytes`)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.grad_bytes = 0

    def hook(state, bucket):
        ddp.grad_bytes += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return ddp


def _step(model, encoder, rank, world, chunk, groups=None) -> dict:
    """One forward/backward (cached when chunk > 0); this rank's loss, gradients and gradient bytes."""
    q, p, q_gold, p_ids = _inputs(rank, world)

    def loss_fn(qe, pe):
        return contrastive_loss(qe, pe, 0.05, q_gold, p_ids, gather=world > 1, grad_groups=groups)

    encoder.zero_grad(set_to_none=True)
    if chunk:
        loss = cached_step(model, q, p, chunk, loss_fn)
    else:
        loss = loss_fn(*model(q, p))
        loss.backward()
    return {
        "loss": loss.detach(),
        "grad_bytes": getattr(model, "grad_bytes", 0),
        "grads": {k: v.grad.clone() for k, v in encoder.named_parameters() if v.grad is not None},
    }


CASES = [("ddp", 0), ("ddp", 1), ("ddp", 3), ("apart", 0), ("apart", 3)]


def _two_workers(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for kind, chunk in CASES:
        model = _model()
        encoder = model.encoder
        if kind == "ddp":  # DDP, counting the bytes its all-reduce hook sends
            model = counting_ddp(model)
            results[(kind, chunk)] = _step(model, encoder, rank, world, chunk)
        else:  # replicas that train apart: each rank's own loss, the other's passages constant
            results[(kind, chunk)] = _step(model, encoder, rank, world, chunk, groups=[[0], [1]])
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("gradcache") / "w2")
    spawn(_two_workers, (2, _free_port(), out), 2)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]


def _close(a: dict, b: dict) -> None:
    torch.testing.assert_close(a["loss"], b["loss"], **TOL)
    assert set(a["grads"]) == set(b["grads"]) and len(a["grads"]) > 10
    for k in a["grads"]:
        torch.testing.assert_close(a["grads"][k], b["grads"][k], **TOL, msg=lambda m: f"{k}: {m}")
    assert max(g.abs().max().item() for g in a["grads"].values()) > 1e-3  # not vacuous


def _one_worker(chunk: int) -> dict:
    model = _model()
    return _step(model, model.encoder, 0, 1, chunk)


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_one_worker_cached_equals_uncached(chunk: int) -> None:
    _close(_one_worker(chunk), _one_worker(0))


@pytest.mark.parametrize("chunk", [1, 3])
def test_two_workers_cached_equal_uncached_and_one_worker_double_batch(two, chunk: int) -> None:
    one = _one_worker(0)  # 1 worker x 2B
    for rank in range(2):
        _close(two[rank][("ddp", chunk)], two[rank][("ddp", 0)])
        for k, g in one["grads"].items():  # DDP's mean of the workers' gradients == the 2B batch's gradient
            torch.testing.assert_close(two[rank][("ddp", chunk)]["grads"][k], g, **TOL)
    # one gradient all-reduce per step, as without the cache (no_sync on every chunk but the last)
    assert two[0][("ddp", chunk)]["grad_bytes"] == two[0][("ddp", 0)]["grad_bytes"] > 0


def test_replicas_training_apart_get_their_own_cached_gradients(two) -> None:
    for rank in range(2):
        _close(two[rank][("apart", 3)], two[rank][("apart", 0)])
    k = next(iter(two[0][("apart", 0)]["grads"]))
    assert not torch.allclose(two[0][("apart", 0)]["grads"][k], two[1][("apart", 0)]["grads"][k])  # they differ


def test_dropout_masks_are_replayed() -> None:
    """With dropout, the cached gradients are those of the embeddings the loss saw: the reference embeds the same
    chunks in the same order with autograd (the same RNG draws) and back-propagates the loss directly."""
    chunk = 3
    q, p, q_gold, p_ids = _inputs(0, 1)

    def loss_fn(qe, pe):
        return contrastive_loss(qe, pe, 0.05, q_gold, p_ids, gather=False)

    model = _model(dropout=0.2)
    torch.manual_seed(123)
    cached = cached_step(model, q, p, chunk, loss_fn)
    after = torch.get_rng_state()  # the replay leaves the generator where the first pass left it
    got = {k: v.grad.clone() for k, v in model.encoder.named_parameters() if v.grad is not None}

    def reference(seed: int):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        qe = torch.cat([model(c, None)[0] for c in split(q, chunk)])
        pe = torch.cat([model(None, c)[1] for c in split(p, chunk)])
        loss = loss_fn(qe, pe)
        loss.backward()
        return loss.detach(), {k: v.grad.clone() for k, v in model.encoder.named_parameters() if v.grad is not None}

    loss, want = reference(123)
    assert torch.equal(torch.get_rng_state(), after)
    _close({"loss": cached, "grads": got}, {"loss": loss, "grads": want})
    _, other = reference(7)  # other dropout masks give other gradients: the check is not vacuous
    assert any(not torch.allclose(other[k], want[k], atol=1e-4) for k in want)


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"cache_chunk_size": -1}, "retriever.train.cache_chunk_size must be > 0"),
        (
            {"cache_chunk_size": 17, "batch_size": 16},
            "retriever.train.cache_chunk_size must be <= retriever.train.batch_size",
        ),
    ],
)
def test_bad_cache_chunk_size_names_the_key(kwargs, key) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        RetrieverTrainConfig(**kwargs)


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    from tests.conftest import REPO

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ragtrain",
            "experiment=quickstart",
            f"output_dir={tmp_path}",
            "logger=none",
            "retriever.train.cache_chunk_size=1000",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "retriever.train.cache_chunk_size must be <= retriever.train.batch_size" in lines[0]
