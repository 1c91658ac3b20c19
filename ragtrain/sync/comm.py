"""Communication accounting: bytes each worker puts on the wire, counted at the call site of each collective.

Definition (used by every strategy, so their figures compare): a worker's bytes for one collective are the bytes
it sends under the bandwidth-optimal ring algorithm for that collective (what gloo and NCCL use for large
tensors), with payload P bytes and W workers:
  all_reduce   2 (W - 1) / W * P      (reduce-scatter + all-gather)
  all_gather   (W - 1) * P            (P = this worker's chunk)
  send         P                      (point-to-point, per peer)
  pull         P                      (async_ps: the server sends the parameters on this worker's behalf)
Seconds are wall time from issuing a collective to its completion ("in flight"), kept as intervals: collectives
in flight at the same time (DDP's buckets) count once, so the in-flight seconds never exceed the wall time.
DDP overlaps them with the backward pass, so `comm/time_share` (in-flight seconds / step seconds, <= 1) is an
upper bound on the exposed cost. Measurement traffic (drift metrics, loss logging) is not counted.

On a GPU (NCCL) a collective returns to the CPU, and its future's callback runs, once its kernels are queued, not
done: there every interval is measured with CUDA events on the stream (a blocking collective's between the block's
start and end, a future's from its issue to the stream its callback runs on), read back when the figures are asked
for, so timing adds no wait to training.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


def all_reduce_bytes(payload: int, world: int) -> int:
    """Bytes one worker sends in a ring all-reduce of `payload` bytes."""
    return 0 if world <= 1 else int(2 * (world - 1) * payload / world)


def all_gather_bytes(chunk: int, world: int) -> int:
    """Bytes one worker sends in a ring all-gather of its `chunk` bytes."""
    return 0 if world <= 1 else (world - 1) * chunk


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals (overlaps counted once)."""
    return sum(e - s for s, e in merge_intervals(intervals))


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as `intervals`."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


class CommStats:
    """Cumulative bytes and in-flight time intervals per category (grad, params, embeddings, ...)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.bytes: dict[str, int] = defaultdict(int)
        self.intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self._lock = threading.Lock()  # counted futures complete on the backend's own thread
        self.cuda = False  # the collectives run on a GPU (set by the training loop from its device)
        self._pending: list[tuple[str, float, torch.cuda.Event, torch.cuda.Event]] = []  # GPU futures' spans

    def add(self, category: str, nbytes: int, start: float | None = None, end: float | None = None) -> None:
        """Record `nbytes` sent under `category`, and with `start` the in-flight interval [start, end or now]."""
        stop = self.clock() if end is None else end
        with self._lock:
            self.bytes[category] += int(nbytes)
            if start is not None:
                spans = self.intervals[category]
                spans.append((start, stop))
                if len(spans) > 4096:  # a long run: keep the list short, the union is unchanged
                    self.intervals[category] = merge_intervals(spans)

    @contextmanager
    def timed(self, category: str, nbytes: int) -> Iterator[None]:
        """Record a blocking collective: its bytes and the wall time of the block."""
        start = self.clock()
        if self.cuda:  # the kernels are only queued when the block ends: time them on the stream, without a wait
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.add_gpu(category, nbytes, start, begin, end)
            return
        yield
        self.add(category, nbytes, start=start)

    def add_gpu(self, category: str, nbytes: int, start: float, begin: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """Record a GPU collective: its bytes now, its interval [start, start + time from `begin` to `end`] once
        the events have completed (`_settle`)."""
        with self._lock:
            self.bytes[category] += int(nbytes)
            self._pending.append((category, start, begin, end))

    def _settle(self) -> None:
        """Turn the GPU collectives' events into intervals (waits for the last of them); under the lock."""
        for category, start, begin, end in self._pending:
            end.synchronize()
            self.intervals[category].append((start, start + begin.elapsed_time(end) / 1000.0))
        self._pending.clear()

    @property
    def seconds(self) -> dict[str, float]:
        """In-flight seconds per category (overlapping collectives of one category counted once)."""
        with self._lock:
            self._settle()
            return {c: union_seconds(spans) for c, spans in self.intervals.items()}

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def total_seconds(self) -> float:
        """Seconds with any collective in flight (the union over categories: never more than the wall time)."""
        with self._lock:
            self._settle()
            return union_seconds([iv for spans in self.intervals.values() for iv in spans])

    def reset(self) -> None:
        with self._lock:
            self.bytes.clear()
            self.intervals.clear()
            self._pending.clear()


def counted_future(
    fut: torch.futures.Future, category: str, nbytes: int, start: float | None = None
) -> torch.futures.Future:
    """Record `nbytes` and the interval from `start` (default: now) until `fut` completes under `category`;
    the result is `fut`'s value. Pass `start` when the collective was issued before this call."""
    begin = STATS.clock() if start is None else start
    if STATS.cuda:
        first = torch.cuda.Event(enable_timing=True)
        first.record()  # on the stream the collective was queued from

        def done_gpu(f: torch.futures.Future):
            last = torch.cuda.Event(enable_timing=True)
            last.record()  # the callback runs on streams that wait for the collective
            STATS.add_gpu(category, nbytes, begin, first, last)
            return f.value()

        return fut.then(done_gpu)

    def done(f: torch.futures.Future):
        STATS.add(category, nbytes, start=begin)
        return f.value()

    return fut.then(done)


# One per process: a Ray Train worker is one process, so this is "this worker's" traffic.
STATS = CommStats()
