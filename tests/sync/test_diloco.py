"""The diloco mixer on real 2-process gloo: its outer Nesterov step against the formula, and a checkpoint restart."""

from __future__ import annotations

import io
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ragtrain.config.sync import MixerConfig
from ragtrain.sync.base import flat_params, set_flat_params
from ragtrain.sync.composed import build_sync
from ragtrain.sync.mixers.base import build_mixer
from ragtrain.sync.scopes.base import build_mixer_scope, layout
from tests.conftest import spawn, sync_config

LR, MU = 0.5, 0.9  # an outer step other than the paper's, so that the defaults are not what is checked


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a rank that skipped a collective fails the test in a minute instead of hanging it
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))


def _moves(steps: int) -> torch.Tensor:
    """[rank, step, 8]: what each rank's inner steps add to its nn.Linear(3, 2), the same on every rank."""
    return torch.randn(2, steps, 8, generator=torch.Generator().manual_seed(7)) * 0.1


def _outer_steps(rank: int, port: int, out: str) -> None:
    """nn.Linear(3, 2) under diloco (warm-up 1, period 2, fp32 on the wire), its inner steps replaced by known moves:
    step 0 (the warm-up) moves both replicas alike, steps 1-4 each by its own; records the parameters per step.
    The replicas are drawn with different seeds: the mixer starts both from rank 0's."""
    _join(rank, port)
    torch.manual_seed(rank)  # replicas start apart: bind starts both from rank 0's weights
    model = nn.Linear(3, 2)
    cfg = MixerConfig(kind="diloco", period=2, warmup_steps=1, outer_lr=LR, outer_momentum=MU, pseudo_grad_dtype="fp32")
    mixer = build_mixer(cfg, build_mixer_scope(layout(None, False), "all"))
    mixer.bind(model)
    params, moves, seen = list(model.parameters()), _moves(5), []
    for step in range(5):
        with torch.no_grad():
            flat = flat_params(params) + (moves[0, 0] if step == 0 else moves[rank, step])
            set_flat_params(params, flat)
        mixer.after_step(params, step)
        seen.append(flat_params(params))
    torch.save({"seen": seen, "state": mixer.state()}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_two_outer_nesterov_steps_match_the_hand_computed_update(tmp_path: Path) -> None:
    out = str(tmp_path / "outer")
    spawn(_outer_steps, (_free_port(), out), 2)
    runs = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    torch.manual_seed(0)
    start = flat_params(list(nn.Linear(3, 2).parameters())).double()
    moves = _moves(5).double()
    # by hand, in float64: the anchor is the replica after the warm-up step, not the initial one
    anchor = start + moves[0, 0]
    replicas = [anchor + moves[r, 1] + moves[r, 2] for r in range(2)]
    delta = sum(anchor - x for x in replicas) / 2
    buf = delta  # the momentum starts at zero
    anchor = anchor - LR * (delta + MU * buf)
    first = anchor
    replicas = [anchor + moves[r, 3] + moves[r, 4] for r in range(2)]
    delta = sum(anchor - x for x in replicas) / 2
    buf = MU * buf + delta
    anchor = anchor - LR * (delta + MU * buf)
    for r, run in enumerate(runs):
        expected = [start + moves[0, 0], start + moves[0, 0] + moves[r, 1], first, first + moves[r, 3], anchor]
        for step, want in enumerate(expected):
            torch.testing.assert_close(run["seen"][step].double(), want, atol=1e-6, rtol=0, msg=f"step {step}")
        assert run["state"]["sync/outer_rounds"] == 2
    # the momentum moved the second round: without it the anchor lands elsewhere (the check is not vacuous)
    without = first - LR * delta
    assert (without - anchor).abs().max() > 1e-3


def _train(rank: int, steps: range, strategy, model: nn.Module, optim, gen: torch.Generator) -> None:
    """`steps` of AdamW on random regression batches (this rank's own data), the strategy after each step."""
    params = list(model.parameters())
    for step in steps:
        x = torch.randn(8, 3, generator=gen)
        loss = ((model(x) - x[:, :2] * (rank + 1)) ** 2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        strategy.after_step(params, step)


def _build(seed: int, sync):
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    strategy = build_sync(sync)
    strategy.wrap(model, torch.device("cpu"))
    return model, strategy, torch.optim.AdamW(model.parameters(), lr=0.05)


def _restart(rank: int, port: int, out: str, sync) -> None:
    """Eight steps straight, and five steps, a checkpoint (through torch.save), new objects restored from it and
    three more; also a restart that restores everything but the mixer's anchor and momentum."""
    _join(rank, port)
    model, strategy, optim = _build(0, sync)
    gen = torch.Generator().manual_seed(100 + rank)
    _train(rank, range(8), strategy, model, optim, gen)
    straight = flat_params(list(model.parameters()))

    model, strategy, optim = _build(0, sync)
    gen = torch.Generator().manual_seed(100 + rank)
    _train(rank, range(5), strategy, model, optim, gen)
    buffer = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(),
            "optim": optim.state_dict(),
            "sync": strategy.state_dict(),
            "gen": gen.get_state(),
        },
        buffer,
    )
    finals = []
    for outer_state in ("saved", "fresh"):
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        model, strategy, optim = _build(1, sync)  # other weights until the restore
        model.load_state_dict(saved["model"])
        optim.load_state_dict(saved["optim"])
        state = saved["sync"]
        if outer_state == "fresh":  # the schedule alone: anchored at the restored replica, no momentum
            anchor = flat_params(list(model.parameters()))
            state = {**state, "diloco_anchor": anchor, "diloco_momentum": torch.zeros_like(anchor)}
        strategy.load_state_dict(state)
        gen = torch.Generator()
        gen.set_state(saved["gen"])
        _train(rank, range(5, 8), strategy, model, optim, gen)
        finals.append(flat_params(list(model.parameters())))
    torch.save({"straight": straight, "restored": finals[0], "schedule_only": finals[1]}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_a_restart_from_the_state_dict_continues_exactly(tmp_path: Path) -> None:
    """Rounds after steps 3 and 6 (period 3): the checkpoint after step 5 holds an anchor the replicas have left and
    a momentum from the first round, and the run restored from it ends bit for bit where the straight run does."""
    out = str(tmp_path / "restart")
    sync = sync_config("diloco", mixer={"period": 3})
    spawn(_restart, (_free_port(), out, sync), 2)
    for rank in range(2):
        r = torch.load(f"{out}.{rank}", weights_only=True)
        assert torch.equal(r["restored"], r["straight"])
        assert (r["schedule_only"] - r["straight"]).abs().max() > 1e-4  # the mixer's state is what made it exact
