"""sync.mixer.comm_share: the period rule, and ranks with different step times agreeing on one period (real gloo)."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ragtrain.runtime.errors import ConfigError
from ragtrain.sync.comm import STATS, all_reduce_bytes
from ragtrain.sync.composed import build_sync
from ragtrain.sync.network import NetworkPeriod, comm_period
from tests.conftest import spawn, sync_config

SLOW = 0.03  # seconds rank 1 sleeps in every step; rank 0 does not


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_period_keeps_communication_under_its_share_of_the_step() -> None:
    assert comm_period(round_s=1.0, compute_s=1.0, share=0.2, max_period=64) == 4  # 0.8 / 0.2
    assert comm_period(round_s=1.0, compute_s=4.0, share=0.5, max_period=64) == 1  # a fast link: every step
    assert comm_period(round_s=10.0, compute_s=0.01, share=0.2, max_period=64) == 64  # clamped
    assert comm_period(round_s=0.0, compute_s=1.0, share=0.2, max_period=64) == 1
    assert comm_period(round_s=1.0, compute_s=0.0, share=0.2, max_period=64) == 64
    gen = torch.Generator().manual_seed(0)
    for round_s, compute_s, share in torch.rand(200, 3, generator=gen).tolist():
        round_s, compute_s, share = round_s + 1e-3, compute_s + 1e-3, 0.05 + 0.9 * share
        p = comm_period(round_s, compute_s, share, max_period=10**9)

        def comm_share(period: int) -> float:
            return (round_s / period) / (compute_s + round_s / period)

        assert comm_share(p) <= share + 1e-12  # under the share ...
        assert p == 1 or comm_share(p - 1) > share  # ... and the shortest period that is


@pytest.mark.parametrize("share", [1.0, 1.5, -0.2])
def test_comm_share_outside_0_1_is_refused_naming_the_key(share: float) -> None:
    with pytest.raises(ConfigError) as e:
        sync_config("local_sgd_network", mixer={"comm_share": share})
    assert "sync.mixer.comm_share" in str(e.value) and "(0, 1)" in str(e.value) and "\n" not in str(e.value)


def test_comm_share_reads_as_off_at_zero_and_cannot_join_the_divergence_rule() -> None:
    assert sync_config("local_sgd").mixer.comm_share == 0.0 and sync_config("local_sgd").label == "local_sgd"
    assert sync_config("diloco", mixer={"comm_share": 0.5}).label == "diloco_network"
    with pytest.raises(ConfigError, match=r"sync\.mixer\.comm_share and sync\.mixer\.adaptive=true"):
        sync_config("local_sgd_adaptive", mixer={"comm_share": 0.2})
    with pytest.raises(ConfigError, match=r"sync\.mixer\.comm_share is set .* \['average', 'diloco'\]"):
        sync_config("gossip", mixer={"comm_share": 0.2})


def _measure(rank: int, steps: int) -> dict:
    """The clock alone around one all-reduce after `steps` steps: this rank's own figures, then the agreed period."""
    clock = NetworkPeriod(share=0.2, max_period=64)
    for _ in range(steps + 1):  # the first tick starts the clock
        time.sleep(SLOW * rank)
        clock.tick()
    with clock.collective(cuda=False):
        dist.all_reduce(torch.ones(1000))
    assert clock.round_s is not None and clock.compute_s is not None
    own = comm_period(clock.round_s, clock.compute_s, 0.2, 64)
    return {"own": own, "own_round_s": clock.round_s, "agreed": clock.next_period(1, 0, torch.device("cpu"))}


def _train(rank: int, sync, steps: int) -> dict:
    """A small model trained with `sync`, rank 1 sleeping SLOW in every step: the period and bytes after each step."""
    STATS.reset()
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    strategy = build_sync(sync)
    strategy.wrap(model, torch.device("cpu"))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    periods, sent, states = [], [], []
    for step in range(steps):
        x = torch.randn(8, 64, generator=gen)
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        opt.step()
        time.sleep(SLOW * rank)
        strategy.after_step(params, step)
        periods.append(strategy.state()["sync/period"])
        sent.append(STATS.total_bytes())
        states.append(strategy.state())
    return {"periods": periods, "bytes": sent, "states": states}


def _ranks(rank: int, port: int, out: str, syncs: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # ranks that disagreed on the period would wait in different collectives: fail in a minute, not hang
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    result = {"clock": _measure(rank, steps=3), "runs": [_train(rank, sync, steps=12) for sync in syncs]}
    torch.save(result, f"{out}.{rank}")
    dist.destroy_process_group()


def test_ranks_with_different_step_times_agree_on_one_period(tmp_path: Path) -> None:
    """Rank 1 sleeps in every step. Alone, the ranks would pick different periods (rank 0 waits in the collective for
    rank 1, so its round looks long and its steps free); agreed, both take the shortest round and the longest
    step, and train through the same rounds."""
    out = str(tmp_path / "ranks")
    syncs = [sync_config("local_sgd_network"), sync_config("diloco_network")]
    spawn(_ranks, (_free_port(), out, syncs), 2)
    fast, slow = (torch.load(f"{out}.{r}", weights_only=True) for r in range(2))
    assert fast["clock"]["own"] != slow["clock"]["own"]  # the agreement has something to settle
    assert fast["clock"]["own_round_s"] > 3 * SLOW  # rank 0 waited for rank 1's three slow steps
    assert fast["clock"]["agreed"] == slow["clock"]["agreed"] == slow["clock"]["own"]
    p = 64 * 32 + 32
    for f, s in zip(fast["runs"], slow["runs"]):
        assert f["periods"] == s["periods"]
        last = f["states"][-1]
        assert last == s["states"][-1] and last["sync/step_compute_s"] >= SLOW
        assert last["sync/period"] == comm_period(last["sync/round_s"], last["sync/step_compute_s"], 0.2, 64)
        # the bytes of the rounds alone: the two measured numbers the ranks exchange are not counted
        per_round = f["bytes"][0]
        assert per_round in (all_reduce_bytes(4 * p, 2), all_reduce_bytes(2 * p, 2))
        assert f["bytes"][-1] == per_round * len({b for b in f["bytes"]})
