"""The mixing period from the measured network (`sync.mixer.comm_share`, after AdaComm, Wang & Joshi 2019).

After each round a mixer that reads comm_share (average, diloco) sets its next period from two measurements: the
seconds its round's collective was in flight (round_s) and the compute seconds per optimizer step since the
previous round (compute_s). Over a period of p steps the round costs round_s / p per step; keeping that under
`share` of the step time,
    round_s / p <= share * (compute_s + round_s / p)   <=>   p >= round_s * (1 - share) / (share * compute_s),
so the period is the smallest such p, clamped to [1, max_period]: a slow link or fast steps sync less often.

The period decides when every rank joins a collective, so every rank must compute the same one: the ranks
exchange their two measurements (one all-reduce of two numbers) and apply the rule to the same figures.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ragtrain.sync.base import world_size


def comm_period(round_s: float, compute_s: float, share: float, max_period: int) -> int:
    """The smallest period whose amortised communication, round_s / period, is at most `share` of the step time
    (compute_s + round_s / period), clamped to [1, max_period]."""
    if round_s <= 0:
        return 1  # nothing to amortise
    if compute_s <= 0:
        return max_period  # steps cost nothing next to the round: sync as rarely as allowed
    return max(1, min(max_period, math.ceil(round_s * (1 - share) / (share * compute_s))))


def agree(round_s: float, compute_s: float, device: torch.device) -> tuple[float, float]:
    """The figures every rank applies the rule to: the shortest round and the longest compute per step.

    A rank that reaches the collective early waits in it for the last one, so its round seconds include that wait;
    the last rank to arrive waits for nobody, so the shortest is the link's own time. Every rank waits for the
    slowest one's steps, so the longest compute per step is the pace of training. One MAX all-reduce carries both
    (the round negated). Not counted as sync bytes: it is measurement traffic as comm.py defines it (like the
    divergence's 4 bytes in base.py), the same 16 bytes whatever the model, and counting it would make a measured
    period's rounds cost more bytes than the same rounds at a fixed period.
    """
    if world_size() == 1:
        return round_s, compute_s
    both = torch.tensor([-round_s, compute_s], dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    low_round, high_compute = both.tolist()
    return -low_round, high_compute


class NetworkPeriod:
    """A mixer's clock and period rule for comm_share: `tick` after every step it counts, its round's collective
    inside `collective(...)`, then `next_period(...)`."""

    def __init__(self, share: float, max_period: int) -> None:
        self.share, self.max_period = share, max_period
        self.mark: float | None = None  # when the compute since the last round began (the first tick, or a round's end)
        self.steps = 0  # optimizer steps since `mark`
        self.round_s: float | None = None  # this round's collective in flight, once measured
        self.compute_s: float | None = None  # compute seconds per step before this round (None: no step measured)
        self.figures: dict[str, float] = {}  # the last agreed measurements, for state()

    def tick(self) -> None:
        """After an optimizer step. The first tick only starts the clock: the step before it holds the set-up."""
        if self.mark is None:
            self.mark = time.perf_counter()
        else:
            self.steps += 1

    @contextmanager
    def collective(self, cuda: bool) -> Iterator[None]:
        """Time the round's collective. On a GPU a collective returns once its kernels are queued: synchronise
        before it (what is queued so far is the steps' compute) and after it (the collective is done)."""
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if self.mark is not None and self.steps:
            self.compute_s = (start - self.mark) / self.steps
        yield
        if cuda:
            torch.cuda.synchronize()
        self.round_s = time.perf_counter() - start

    def next_period(self, period: int, nbytes: int, device: torch.device) -> int:
        """After a round that sent `nbytes` (this worker's, as counted): the period every rank agrees on, or
        `period` where the round measured nothing (one worker, or no step since the clock started: every rank
        alike, their steps are the same). The compute clock restarts here, once the round is over."""
        round_s, compute_s = self.round_s, self.compute_s
        self.round_s = self.compute_s = None
        if round_s is not None and compute_s is not None:
            round_s, compute_s = agree(round_s, compute_s, device)
            period = comm_period(round_s, compute_s, self.share, self.max_period)
            self.figures = {
                "sync/round_s": round_s,
                "sync/step_compute_s": compute_s,
                "sync/link_bytes_per_s": nbytes / round_s if round_s > 0 else 0.0,
            }
        self.mark, self.steps = time.perf_counter(), 0
        return period

    def state(self) -> dict[str, Any]:
        return dict(self.figures)
