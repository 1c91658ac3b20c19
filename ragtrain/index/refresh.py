"""Live index refresh: the pool re-encodes the corpus with a recent encoder snapshot while training keeps stepping.

`IndexService` (a threaded Ray actor next to the pool) holds the live index version: the FAISS index, the hard-
negative candidates it yields for every training query (ANCE-style) and the stored vectors of a fixed staleness
probe. `refresh(step, [weights_ref])` builds the next version in a background thread of the actor and swaps it in
whole when done; a failed refresh keeps the old version and says why. `LiveIndexClient` is the worker side.

Which version a step mines from is decided once per step, by rank 0 (`begin_step`): it asks the service for the
step's version (`version_for_step`: the newest, recorded in a `VersionBook`; a step replayed after a worker
restart gets the version it had the first time) and broadcasts it; every rank fetches that version's negatives.
So all ranks of a step mine from one version, even when a refresh swaps in between their calls. Rank 0 also
decides when to refresh (every N steps, or when the measured drift passes a threshold) and measures staleness.
Training never waits for a refresh.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np
import ray
import torch
import torch.distributed as dist

from ragtrain.config import Config
from ragtrain.console import get_logger, progress_bars
from ragtrain.corpus.encode import ShardSet
from ragtrain.index.faiss_index import build_configured, exact_search
from ragtrain.index.mining import mine_rows
from ragtrain.precision import resolved_index

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


class LiveService:
    """What trainers ask a live index service (`IndexService` here, `ShardedIndexService` over index shards): the
    published versions in `self.book` under `self._swap`, one refresh at a time under `self._busy`."""

    book: VersionBook
    _swap: threading.Lock
    _busy: threading.Lock
    history: list[dict[str, Any]]
    failures: list[str]

    def version(self) -> int:
        """The live version number (-1 before the first publish): a cheap poll."""
        with self._swap:
            return self.book.version()

    def number_from(self, first: int) -> None:
        """Number the versions from `first` (before the first publish): a resumed run continues its numbers."""
        with self._swap:
            if self.book.versions:
                raise RuntimeError("the live index's versions are numbered before its first publish")
            self.book = VersionBook(self.book.keep, first)

    def latest(self) -> LiveVersion | None:
        """The live version."""
        with self._swap:
            return self.book.latest()

    def version_for_step(self, step: int) -> int:
        """The version training step `step` mines from (rank 0 asks once per step; see VersionBook)."""
        with self._swap:
            return self.book.version_for_step(step)

    def get(self, version: int) -> LiveVersion:
        """A kept version (what the other ranks fetch after rank 0's broadcast)."""
        with self._swap:
            return self.book.get(version)

    def busy(self) -> bool:
        """Whether a refresh is running now."""
        return self._busy.locked()

    def report(self) -> dict[str, Any]:
        """Refresh history and failures."""
        return {"history": list(self.history), "failures": list(self.failures)}

    def close(self) -> None:
        """Wait for a running refresh to finish, so the pool can be handed back to the driver."""
        with self._busy:
            pass


@ray.remote(max_concurrency=4)  # one thread refreshes while the others answer workers' polls
class IndexService(LiveService):
    """Holds the live index version; builds the next one on the pool without blocking anyone."""

    def __init__(
        self,
        cfg: Config,
        pool,
        passages: list[str],
        doc_ids: list[str],
        fingerprint: str,
        train_queries: list[str],
        train_gold: list[list[int]],
        probe: Probe,
    ):
        faiss.omp_set_num_threads(max(1, int(cfg.resources.pool.cpus_per_actor)))  # stay inside the pool's CPUs
        self.cfg, self.pool, self.passages, self.doc_ids = cfg, pool, passages, doc_ids
        self.fingerprint, self.train_queries, self.train_gold, self.probe = (
            fingerprint,
            train_queries,
            train_gold,
            probe,
        )
        self.pool.invalidate()  # the driver may have loaded weights since this copy of the pool was made
        self.book = VersionBook()
        self.index = None
        self._busy = threading.Lock()  # only one refresh at a time
        self._swap = threading.Lock()
        self.failures: list[str] = []
        self.history: list[dict[str, float]] = []

    def publish(self, step: int, shard_folder: str, weights: list) -> dict[str, Any]:
        """Version 0 from the vector shards of an encode already done (the zero-shot index), not a second encode.
        The service reads them itself: the driver that started it never holds the vector matrix."""
        try:
            vectors = ShardSet.load(shard_folder).read_all(order=self.doc_ids)[1]
        except Exception as e:  # the caller sees why version 0 is missing
            return {"ok": False, "error": repr(e), "step": step}
        return self._run(step, weights[0], vectors)

    def refresh(self, step: int, weights: list) -> dict[str, Any]:
        """Encode the corpus with the snapshot in `weights[0]` (an ObjectRef, passed inside a list so Ray does not
        resolve it here) and swap the new version in; returns its stats, or why it was skipped or failed."""
        return self._run(step, weights[0], None)

    def _run(self, step: int, weights_ref, vectors: np.ndarray | None) -> dict[str, Any]:
        if not self._busy.acquire(blocking=False):
            return {"ok": False, "skipped": "a refresh is already running", "step": step}
        start = time.perf_counter()
        try:
            version = self.book.version() + 1
            self.pool.set_weights(("refresh", version, step), weights_ref)
            r, idx = self.cfg.retriever, resolved_index(self.cfg)  # the pool's precision, as the first build's
            if vectors is None:
                # a bar per refresh where training draws one (console.progress_bars: the quiet console on a terminal)
                vectors, _ = self.pool.encode(
                    self.passages,
                    r.passage_max_length,
                    idx,
                    progress=progress_bars(),
                    desc=f"[refresh] v{version} encode",
                    role="passage",
                )
            index = build_configured(
                vectors, self.doc_ids, idx, self.fingerprint, f"{r.model}@step{step}", step, self.cfg.seed
            )
            index.meta.version = version
            qvecs, _ = self.pool.encode(self.train_queries, r.query_max_length, idx, progress=False, role="query")
            t = r.train
            negatives = mine_rows(
                index,
                qvecs,
                self.train_gold,
                t.hard_negative_depth,
                t.hard_negative_skip_top,
                t.hard_negative_margin,
                t.hard_negative_max_score,
                vectors,
            )
            live = LiveVersion(version, step, negatives, vectors[self.probe.rows].copy(), time.perf_counter() - start)
            with self._swap:  # atomic: readers see the old version or the new one, never a mix
                self.book.publish(live)
                self.index = index
            stats = {
                "ok": True,
                "version": version,
                "step": step,
                "seconds": live.build_seconds,
                "node": ray.get_runtime_context().get_node_id(),
            }
            self.history.append(stats)
            return stats
        except Exception as e:  # keep serving the old version; the caller logs the failure
            self.failures.append(f"step {step}: {e!r}")
            traceback.print_exc()
            return {"ok": False, "error": repr(e), "step": step, "seconds": time.perf_counter() - start}
        finally:
            self._busy.release()

    def search(self, qvecs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, rows) from the live index."""
        with self._swap:
            index = self.index
        return index.search(qvecs, k)


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

    def __init__(self, service, cfg: Config, rank: int, broadcast: bool = False, device: torch.device | None = None):
        self.service, self.cfg, self.rank, self.broadcast = service, cfg, rank, broadcast
        self.device = device or torch.device("cpu")  # NCCL broadcasts only tensors on the worker's GPU
        self.live: LiveVersion = _call(service, "latest")
        self.switched = False
        if self.live is None:
            raise RuntimeError("the index service has no published version: publish() must run before training")
        self.pending: ray.ObjectRef | None = None
        self.pending_since = 0.0
        self.refreshes = 0
        self.failures = 0
        self.seconds: list[float] = []  # each finished refresh's wall time
        self.round_metrics: list[dict[str, float]] = []  # each finished sharded round's metrics
        self.steps: list[tuple[float, int, bool]] = []  # (seconds, samples, a refresh was running) per step
        self.mixed_steps = 0  # steps whose negatives came from a version that mixed encoder versions

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
        elif "error" in stats:
            self.failures += 1
            log.info(f"[index] refresh from step {stats['step']} failed, the old index stays live: {stats['error']}")
        return stats

    def due(self, step: int, drift: float | None) -> bool:
        """Whether rank 0 should start a refresh now: none running, and the schedule (steps or drift) says so."""
        r = self.cfg.refresh
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
        out.update(self._done_metrics(self.finished()))
        drift = None
        if step % self.cfg.refresh.check_every == 0:
            out["index/lag_steps"] = step - self.live.step
            m = measure_fn(self.live.probe_vectors)
            drift = m["index/drift_cosine"]
            out.update(m)
        if self.due(step, drift):
            self.start(step, state_dict_fn())
        return out

    def _done_metrics(self, done: dict[str, Any] | None) -> dict[str, float]:
        """What a finished refresh logs: its seconds and version (and a sharded round's metrics), or a failure."""
        out: dict[str, float] = {}
        if done is not None and done.get("ok"):
            out.update({"index/refresh_seconds": done["seconds"], "index/version": done["version"]})
            out.update(done.get("metrics", {}))  # a sharded refresh's version mix, mixed recall, encoded share
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
            "index/steps_during_refresh": float(len(busy)),
            "index/final_version": float(self.live.version),
            # what training itself met of the shards' inconsistency (the states published are in index/*_mean)
            "index/steps_on_mixed_versions": float(self.mixed_steps),
            "index/refresh_seconds_total": float(sum(self.seconds)),
        }
        rounds = self.round_metrics
        for key, how in (
            ("index/encoded_fraction", np.mean),
            ("index/mixed_recall_at_10", np.mean),
            ("index/mined_agreement", np.mean),
            ("index/version_skew", np.max),
        ):  # a sharded refresh's rounds (index/sharded_refresh.py)
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
        """Start a refresh with this snapshot (put in the object store once; the pool actors fetch it)."""
        weights = {k: v.detach().cpu().clone() for k, v in state_dict.items()}
        self.pending = self.service.refresh.remote(step, [ray.put(weights)])
        self.pending_since = time.perf_counter()
