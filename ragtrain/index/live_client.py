"""Live index refresh, the trainer's side: the index shards re-encode the corpus with a recent encoder snapshot
while training keeps stepping.

The refresh service (`RefreshService`, index/refresh_service.py) publishes live versions: the hard-negative
candidates the live index yields for every training query (ANCE-style) and the stored vectors of a fixed staleness
probe. `refresh(step, [weights_ref])` runs a round in a background thread of the service; a failed round keeps
what is live and says why. `LiveIndexClient` is the worker side; `VersionBook` the versions the service keeps.

Which version a step mines from is decided once per step, by rank 0 (`begin_step`): it asks the service for the
step's version (`version_for_step`: the newest, recorded in a `VersionBook`; a step replayed after a worker
restart gets the version it had the first time) and broadcasts it; every rank fetches that version's negatives.
So all ranks of a step mine from one version, even when a refresh swaps in between their calls. A trainer that
searches the live index instead of taking mined negatives (joint training) pins the same way (`search_step`):
rank 0 searches every rank's queries in one call, which returns the version it read (the service publishes each
state before pinned searches may read it), and broadcasts rows and version. Rank 0 also
decides when to refresh (every N steps, or when the measured drift passes a threshold) and measures staleness.
Training never waits for a refresh, unless `refresh.max_lag_steps` bounds the live index's staleness: then a step
whose live version is that many steps behind waits for the round in flight.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist

from ragtrain.config.index import RefreshConfig
from ragtrain.index.faiss_index import exact_search
from ragtrain.runtime.console import get_logger

log = get_logger(__name__)


@dataclass
class Probe:
    """The fixed staleness probe: corpus rows, and training queries whose gold passages are among those rows."""

    rows: list[int]  # corpus positions of the probe passages
    queries: list[str]
    gold: list[list[int]]  # per probe query: positions *within* `rows` of its gold passages


@dataclass
class LiveVersion:
    """One published index version: what workers pull (the FAISS index itself stays in the service)."""

    version: int
    step: int  # training step of the encoder snapshot that built it
    negatives: list[list[int]]  # per training query: hard-negative candidates (corpus positions)
    probe_vectors: np.ndarray  # [len(probe.rows), dim] stored vectors of the probe passages
    build_seconds: float
    version_skew: float = 0.0  # newest - oldest encoder version of the rows it was mined from (index shards)


class VersionBook:
    """Published versions (the newest `keep`) and the version each training step used (the first caller decides).

    A plain object: the service holds one, and tests use it directly as the service (same methods).
    """

    def __init__(self, keep: int = 8, first: int = 0):
        self.keep, self.first = keep, first  # `first`: the number of the first version published (a resumed run's)
        self.versions: dict[int, LiveVersion] = {}
        self.used: dict[int, int] = {}  # training step -> version its negatives came from

    def publish(self, live: LiveVersion) -> None:
        """Add a new version (the newest from now on); the oldest beyond `keep` are dropped."""
        self.versions[live.version] = live
        for v in sorted(self.versions)[: -self.keep]:
            del self.versions[v]

    def version(self) -> int:
        """The newest version number (`first` - 1 before the first publish)."""
        return max(self.versions, default=self.first - 1)

    def latest(self) -> LiveVersion | None:
        """The newest version."""
        return self.versions.get(self.version())

    def version_for_step(self, step: int) -> int:
        """The version `step` mines from: the one recorded for it (a step replayed after a restart), else the
        newest, recorded now."""
        v = self.used.get(step)
        if v is None or v not in self.versions:  # first time here (or that version is gone: take the newest)
            v = self.used[step] = self.version()
        return v

    def get(self, version: int) -> LiveVersion:
        """A kept version."""
        if version not in self.versions:
            raise KeyError(f"index version {version} is no longer kept (kept: {sorted(self.versions)})")
        return self.versions[version]


def make_probe(
    train_gold: Sequence[Sequence[int]],
    queries: Sequence[str],
    corpus_size: int,
    num_queries: int,
    num_passages: int,
    seed: int,
) -> Probe:
    """First `num_queries` training queries, their gold passages, and seeded random passages up to `num_passages`."""
    n = min(num_queries, len(queries))
    rows: list[int] = []
    for g in train_gold[:n]:
        rows.extend(r for r in g if r not in rows)
    others = [int(r) for r in np.random.default_rng(seed).permutation(corpus_size) if int(r) not in set(rows)]
    rows.extend(others[: max(0, num_passages - len(rows))])
    where = {r: i for i, r in enumerate(rows)}
    return Probe(rows, list(queries[:n]), [[where[r] for r in g] for g in train_gold[:n]])


def staleness(
    stale: np.ndarray, fresh: np.ndarray, queries: np.ndarray, gold: Sequence[Sequence[int]], k: int = 10
) -> dict[str, float]:
    """How far the live index lags the current encoder, on the probe (vectors unit-norm, rows aligned).

    - index/drift_cosine: mean over probe passages of 1 - cos(stored vector, current encoder's vector).
    - index/stale_recall@10, index/fresh_recall@10: mean recall@k of the current encoder's probe-query vectors
      against the probe passages' stored vectors vs their freshly encoded vectors; index/stale_vs_fresh_recall
      is fresh - stale (> 0: refreshing the index would retrieve better right now).
    """
    cos = (stale * fresh).sum(1) / (np.linalg.norm(stale, axis=1) * np.linalg.norm(fresh, axis=1)).clip(min=1e-12)

    def recall(passages: np.ndarray) -> float:
        top = exact_search(queries, passages, k)[1]
        return float(np.mean([len(set(top[i].tolist()) & set(g)) / len(g) for i, g in enumerate(gold) if g]))

    rs, rf = recall(stale), recall(fresh)
    return {
        "index/drift_cosine": float(np.mean(1.0 - cos)),
        "index/stale_recall@10": rs,
        "index/fresh_recall@10": rf,
        "index/stale_vs_fresh_recall": rf - rs,
    }


def _call(service, name: str, *args):
    """Call a service method: a Ray actor handle (ray.get of .remote) or a plain object such as a VersionBook."""
    method = getattr(service, name)
    return ray.get(method.remote(*args)) if hasattr(method, "remote") else method(*args)


class LiveIndexClient:
    """Worker side of the live index: the step's version (rank 0 decides); on rank 0 also schedules refreshes.

    broadcast=True (several workers in a process group): rank 0's choice reaches the others as an 8-byte
    broadcast (on `device`: the worker's GPU under NCCL); False (one worker, or async_ps where a per-step
    collective would make workers wait for each other): every rank asks the service, and the first to reach a step
    fixes its version for all.
    """

    def __init__(
        self,
        service,
        refresh: RefreshConfig,
        rank: int,
        broadcast: bool = False,
        device: torch.device | None = None,
    ):
        self.service, self.refresh, self.rank, self.broadcast = service, refresh, rank, broadcast
        self.device = device or torch.device("cpu")  # NCCL broadcasts only tensors on the worker's GPU
        self.live: LiveVersion = _call(service, "latest")
        self.switched = False
        if self.live is None:
            raise RuntimeError("the index service has no published version: publish() must run before training")
        self.pending: ray.ObjectRef | None = None
        self.pending_since = 0.0
        self.refreshes = 0
        self.failures = 0
        self.late_commits = 0  # rounds that committed (searches switched) but failed after it: counted, not failed
        self.seconds: list[float] = []  # each finished refresh's wall time
        self.round_metrics: list[dict[str, float]] = []  # each finished round's metrics
        self.steps: list[tuple[float, int, bool]] = []  # (seconds, samples, a refresh was running) per step
        self.mixed_steps = 0  # steps whose negatives came from a version that mixed encoder versions
        self.lag_wait_s = 0.0  # rank 0's time waiting for rounds held back by refresh.max_lag_steps
        self.snapshot_mb = 0.0  # the size of the last snapshot sent to the shards
        # shards that encode in bf16 cast the snapshot on load: sent as bf16 it is half the bytes and the same vectors
        self.snapshot_bf16: bool | None = None  # asked at the first refresh (only rank 0 starts them)

    def begin_step(self, step: int) -> int:
        """Switch to the version `step` mines from: rank 0 asks the service (a ~1 ms actor call) and broadcasts
        it; every rank then holds that version. Returns the version."""
        if self.broadcast:
            v = torch.tensor(
                [_call(self.service, "version_for_step", step) if self.rank == 0 else -1],
                dtype=torch.int64,
                device=self.device,
            )
            dist.broadcast(v, src=0)  # tiny, and the step's first collective: every rank waits here anyway
            version = int(v.item())
        else:
            version = _call(self.service, "version_for_step", step)
        if version != self.live.version:
            self.live = _call(self.service, "get", version)
            self.switched = True
        return version

    def search_step(self, queries: np.ndarray, k: int) -> np.ndarray:
        """A training step's top-k rows of the live index for this rank's `queries` ([n, dim], the same n on every
        rank), all read from ONE version: rank 0 searches every rank's queries at once (`search_pinned`) and
        broadcasts the rows with the version they were read from; every rank then holds that version (a trainer
        that searches instead of mining: joint training). Searched by each rank alone, a refresh landing between
        two ranks' searches would give one step two versions."""
        if not self.broadcast:
            _, rows, version = _call(self.service, "search_pinned", queries, k)
            self._hold(int(version))
            return np.asarray(rows)
        q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32)).to(self.device)
        world, n = dist.get_world_size(), q.shape[0]
        everyone = [torch.empty_like(q) for _ in range(world)]
        dist.all_gather(everyone, q)  # the step's first collective: every rank waits here anyway
        out = torch.full((world * n * k + 1,), -1, dtype=torch.int64, device=self.device)
        if self.rank == 0:
            _, rows, version = _call(self.service, "search_pinned", torch.cat(everyone).cpu().numpy(), k)
            out[:-1] = torch.from_numpy(np.asarray(rows, dtype=np.int64).reshape(-1))
            out[-1] = int(version)
        dist.broadcast(out, src=0)
        self._hold(int(out[-1].item()))
        return out[:-1].view(world, n, k)[self.rank].cpu().numpy()

    def _hold(self, version: int) -> None:
        """This step's version (a switch is reported by `after_step`)."""
        if version != self.live.version:
            self.live = _call(self.service, "get", version)
            self.switched = True

    def pull(self) -> bool:
        """Swap to the newest published version (end of training, rank 0); True when it changed."""
        if _call(self.service, "version") == self.live.version:
            return False
        self.live = _call(self.service, "latest")
        return True

    def negatives(self) -> list[list[int]]:
        """Hard-negative candidates per training query from the live version."""
        return self.live.negatives

    def in_flight(self) -> bool:
        """True while a refresh started by this client is running."""
        return self.pending is not None and not ray.wait([self.pending], timeout=0)[0]

    def finished(self) -> dict[str, Any] | None:
        """The stats of a refresh that has just completed (once), else None."""
        if self.pending is None or self.in_flight():
            return None
        stats = ray.get(self.pending)
        self.pending = None
        if stats.get("ok"):
            self.refreshes += 1
            self.seconds.append(float(stats.get("seconds", 0.0)))
            self.round_metrics.append(stats.get("metrics", {}))
            if stats.get("committed_late"):
                self.late_commits += 1
                log.warning(
                    f"[index] refresh from step {stats['step']} committed late: searches switched to encoder version "
                    f"{stats['encoder_version']}, and a shard that has not applied it finishes it: {stats['late']}"
                )
        elif "error" in stats:
            self.failures += 1
            log.warning(f"[index] refresh from step {stats['step']} failed, the old index stays live: {stats['error']}")
        return stats

    def due(self, step: int, drift: float | None) -> bool:
        """Whether rank 0 should start a refresh now: none running, and the schedule (steps or drift) says so."""
        r = self.refresh
        if self.pending is not None:
            return False
        if r.every_steps and step - self.live.step >= r.every_steps:
            return True
        return bool(r.drift_threshold) and drift is not None and drift > r.drift_threshold

    def after_step(self, step: int, state_dict_fn, measure_fn, step_seconds: float, samples: int) -> dict[str, float]:
        """Per-step upkeep: report a version switch; on rank 0 log finished refreshes, measure staleness every
        refresh.check_every steps and start a refresh when due. Returns metrics for rank 0 to log."""
        refreshing = self.in_flight() if self.rank == 0 else False
        self.steps.append((step_seconds, samples, refreshing))
        self.mixed_steps += self.live.version_skew > 0
        out: dict[str, float] = {}
        if self.switched:
            out["index/version"] = self.live.version
            self.switched = False
        if self.rank != 0:
            return out
        self._bound_staleness(step)
        out.update(self._done_metrics(self.finished()))
        drift = None
        if step % self.refresh.check_every == 0:
            out["index/lag_steps"] = step - self.live.step
            m = measure_fn(self.live.probe_vectors)
            drift = m["index/drift_cosine"]
            out.update(m)
        if self.due(step, drift):
            self.start(step, state_dict_fn())
        return out

    def _bound_staleness(self, step: int) -> None:
        """Rank 0 waits for the round in flight when the live version is refresh.max_lag_steps behind (the next
        step then mines from that round's version); the other ranks wait at their next collective."""
        lag = self.refresh.max_lag_steps
        if lag and self.pending is not None and step - self.live.step >= lag:
            t0 = time.perf_counter()
            ray.wait([self.pending])
            self.lag_wait_s += time.perf_counter() - t0

    def _done_metrics(self, done: dict[str, Any] | None) -> dict[str, float]:
        """What a finished refresh logs: its seconds and version (and a sharded round's metrics), or a failure."""
        out: dict[str, float] = {}
        if done is not None and done.get("ok"):
            out.update({"index/refresh_seconds": done["seconds"], "index/version": done["version"]})
            out.update(done.get("metrics", {}))  # a sharded refresh's version mix, mixed recall, encoded share
            if done.get("committed_late"):
                out["index/refreshes_committed_late"] = self.late_commits
        if done is not None and "error" in done:
            out["index/refresh_failures"] = self.failures
        return out

    def drain(self) -> dict[str, float]:
        """Wait for a refresh still running at the end of training (its snapshot lives in this worker's store);
        returns its metrics, for rank 0 to log at the last step as `after_step` would have."""
        if self.pending is None:
            return {}
        ray.wait([self.pending])
        out = self._done_metrics(self.finished())
        self.pull()
        return out

    def checkpoint_info(self) -> dict[str, int]:
        """Rank 0: the newest version number published, for the checkpoint (a resumed run numbers on from it)."""
        return {"live_version": int(_call(self.service, "version"))} if self.rank == 0 else {}

    def summary(self) -> dict[str, float]:
        """Rank 0's refresh summary: counts, and training throughput while a refresh ran vs while none did."""
        busy = [(s, n) for s, n, r in self.steps if r]
        idle = [(s, n) for s, n, r in self.steps if not r]
        out = {
            "index/refreshes": float(self.refreshes),
            "index/refresh_failures": float(self.failures),
            "index/refreshes_committed_late": float(self.late_commits),
            "index/steps_during_refresh": float(len(busy)),
            "index/final_version": float(self.live.version),
            # what training itself met of the shards' inconsistency (the states published are in index/*_mean)
            "index/steps_on_mixed_versions": float(self.mixed_steps),
            "index/refresh_seconds_total": float(sum(self.seconds)),
            "index/lag_wait_seconds": self.lag_wait_s,
            "index/snapshot_mb": self.snapshot_mb,  # what each index node fetches per round (the weights as trained)
        }
        rounds = self.round_metrics
        for key, how in (
            ("index/encoded_fraction", np.mean),
            ("index/mixed_recall_at_10", np.mean),
            ("index/mined_agreement", np.mean),
            ("index/version_skew", np.max),
            ("index/round_rx_mb", np.mean),
            ("index/round_tx_mb", np.mean),
            ("index/search_ms_p50", np.mean),
            ("index/search_ms_p95", np.max),
        ):  # the refresh rounds' own figures (index/refresh_service.py)
            got = [m[key] for m in rounds if key in m]
            if got:
                out[f"{key}_{how.__name__}"] = float(how(got))
        if busy and idle:
            sps_busy = sum(n for _, n in busy) / sum(s for s, _ in busy)
            sps_idle = sum(n for _, n in idle) / sum(s for s, _ in idle)
            out.update(
                {
                    "index/samples_per_s_refreshing": sps_busy,
                    "index/samples_per_s_idle": sps_idle,
                    "index/refresh_throughput_ratio": sps_busy / sps_idle,
                    "index/max_step_s_refreshing": max(s for s, _ in busy),
                    "index/median_step_s_idle": float(np.median([s for s, _ in idle])),
                }
            )
        return out

    def start(self, step: int, state_dict: dict) -> None:
        """Start a refresh with this snapshot (put in the object store once; the index shards fetch it)."""
        if self.snapshot_bf16 is None:
            self.snapshot_bf16 = _call(self.service, "snapshot_precision") == "bf16"
        cast = torch.bfloat16 if self.snapshot_bf16 else None
        weights = {
            k: v.detach().cpu().to(cast) if cast is not None and v.is_floating_point() else v.detach().cpu().clone()
            for k, v in state_dict.items()
        }
        self.snapshot_mb = sum(v.numel() * v.element_size() for v in weights.values()) / 1e6
        self.pending = self.service.refresh.remote(step, [ray.put(weights)])
        self.pending_since = time.perf_counter()
