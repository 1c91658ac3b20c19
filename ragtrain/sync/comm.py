"""Communication accounting: bytes each worker puts on the wire, counted at the call site of each collective.

Definition (used by every strategy, so their figures compare): a worker's bytes for one collective are the bytes
it sends under the bandwidth-optimal ring algorithm for that collective (what gloo and NCCL use for large
tensors), with payload P bytes and W workers:
  all_reduce   2 (W - 1) / W * P      (reduce-scatter + all-gather)
  all_gather   (W - 1) * P            (P = this worker's chunk)
  send         P                      (point-to-point, per peer)
Seconds are wall time from issuing a collective to its completion ("in flight"); DDP overlaps them with the
backward pass, so `comm/time_share` (in-flight seconds / step seconds) is an upper bound on the exposed cost.
Measurement traffic (drift metrics, loss logging) is not counted.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch


def all_reduce_bytes(payload: int, world: int) -> int:
    """Bytes one worker sends in a ring all-reduce of `payload` bytes."""
    return 0 if world <= 1 else int(2 * (world - 1) * payload / world)


def all_gather_bytes(chunk: int, world: int) -> int:
    """Bytes one worker sends in a ring all-gather of its `chunk` bytes."""
    return 0 if world <= 1 else (world - 1) * chunk


class CommStats:
    """Cumulative bytes and in-flight seconds per category (grad, params, embeddings, ...)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, category: str, nbytes: int, seconds: float = 0.0) -> None:
        """Record `nbytes` sent (and optionally time in flight) under `category`."""
        self.bytes[category] += int(nbytes)
        self.seconds[category] += seconds

    @contextmanager
    def timed(self, category: str, nbytes: int) -> Iterator[None]:
        """Record a blocking collective: its bytes and the wall time of the block."""
        start = time.perf_counter()
        yield
        self.add(category, nbytes, time.perf_counter() - start)

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.seconds.clear()


def counted_future(fut: torch.futures.Future, category: str, nbytes: int) -> torch.futures.Future:
    """Record `nbytes` and the time until `fut` completes under `category`; the result is `fut`'s value."""
    start = time.perf_counter()

    def done(f: torch.futures.Future):
        STATS.add(category, nbytes, time.perf_counter() - start)
        return f.value()

    return fut.then(done)


# One per process: a Ray Train worker is one process, so this is "this worker's" traffic.
STATS = CommStats()
