"""The code paths that only run on a GPU: skipped without CUDA (the CPU suite), run by benchmarks/gpu_smoke.sh.

One process, one GPU: NCCL cannot put two ranks on one device, so these run the world-1 cases of each path
(a world-1 NCCL group still refuses CPU tensors, which is what broke the live index's broadcast).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def nccl_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield torch.device("cuda", 0)
    dist.destroy_process_group()


def test_gpu_collectives_are_timed_to_completion(nccl_group) -> None:
    """NCCL returns before the kernels finish: the comm figures wait for them (events / synchronisation)."""
    import time

    from ragtrain.sync.comm import STATS, counted_future

    STATS.reset()
    STATS.cuda = True
    try:
        # Out of place: a world-1 group copies 1 GiB per call, real work on the GPU. (A world-1 in-place all-reduce
        # is no work at all for NCCL, and would time nothing but the enqueue.)
        x = torch.ones(1 << 28, device=nccl_group)
        y = torch.empty_like(x)
        dist.all_gather_into_tensor(y, x)  # NCCL's first call sets up its communicator: not timed below
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            dist.all_gather_into_tensor(y, x)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / 5  # one collective, to completion
        fut = counted_future(dist.all_gather_into_tensor(y, x, async_op=True).get_future(), "grad", x.numel() * 4)
        fut.wait()
        with STATS.timed("params", 8):
            dist.all_gather_into_tensor(y, x)
        seconds = STATS.seconds
        assert set(seconds) == {"grad", "params"}
        # to completion, not to the enqueue (which takes microseconds whatever the size)
        assert all(s > 0.3 * wall for s in seconds.values()), (seconds, wall)
        assert STATS.bytes["grad"] == x.numel() * 4
    finally:
        STATS.reset()
        STATS.cuda = False


def test_live_index_broadcast_runs_on_the_workers_gpu(nccl_group) -> None:
    from ragtrain.index.live_client import LiveIndexClient

    class Service:  # the VersionBook side of the service: what begin_step asks
        def latest(self):
            from types import SimpleNamespace

            return SimpleNamespace(version=3)

        def version_for_step(self, step: int) -> int:
            return 3

    client = LiveIndexClient(Service(), refresh=None, rank=0, broadcast=True, device=nccl_group)
    assert client.begin_step(0) == 3


def test_async_ps_pushes_and_pulls_a_gpu_replica(ray_session) -> None:
    from ragtrain.sync.composed import build_sync
    from tests.conftest import sync_config

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = nn.Linear(16, 4).to(device)
    strategy = build_sync(sync_config("async_ps", mixer={"max_staleness": 1}))
    model = strategy.wrap(model, device)
    params = list(model.parameters())
    for _ in range(3):
        with torch.no_grad():
            for p in params:
                p.add_(0.1)
        strategy.after_step(params, 0)
    strategy.consensus(params)
    assert all(p.device == device for p in params)
    strategy.load_state_dict(strategy.state_dict())  # a checkpoint round trip on the GPU replica


def test_a_gpu_checkpoint_restores_on_the_cpu(tmp_path) -> None:
    """Checkpoints load with map_location=cpu: a GPU run resumes where the GPU index changed, or on a CPU."""
    from ragtrain.train.checkpoint import load_train_state, save_train_state

    model = nn.Linear(8, 2).cuda()
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 8, device="cuda")).sum().backward()
    optim.step()
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    save_train_state(tmp_path, 0, 1, 5, model, optim, sched, {"residual": torch.ones(3, device="cuda")})
    cpu_model = nn.Linear(8, 2)
    cpu_optim = torch.optim.AdamW(cpu_model.parameters())
    step, extra = load_train_state(
        tmp_path, 0, 1, cpu_model, cpu_optim, torch.optim.lr_scheduler.LambdaLR(cpu_optim, lambda s: 1.0)
    )
    assert step == 5 and extra["residual"].device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available() or not torch.cuda.is_bf16_supported(), reason="needs a bf16 GPU")
def test_auto_precision_is_bf16_on_a_bf16_gpu() -> None:
    """precision=auto on a GPU with bf16 (as a Ray worker given one resolves it): bf16, and autocast is on."""
    from ragtrain.embed.model import autocast
    from ragtrain.embed.precision import resolve

    assert resolve("auto", "cuda", "retriever.train.precision") == "bf16"
    with autocast("auto", torch.device("cuda", 0)):
        assert torch.is_autocast_enabled("cuda")
