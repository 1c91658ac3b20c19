"""Live index refresh: the pool re-encodes the corpus with a recent encoder snapshot while training keeps stepping.

`IndexService` (a threaded Ray actor next to the pool) holds the live index version: the FAISS index, the hard-
negative candidates it yields for every training query (ANCE-style) and the stored vectors of a fixed staleness
probe. `refresh(step, [weights_ref])` builds the next version in a background thread of the actor and swaps it in
whole when done; a failed refresh keeps the old version and says why. `LiveIndexClient` is the worker side: every
worker pulls a new version when one appears; rank 0 also decides when to refresh (every N steps, or when the
measured drift passes a threshold) and measures staleness. Training never waits for a refresh.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import ray

from ragtrain.config import Config


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


def make_probe(train_gold: Sequence[Sequence[int]], queries: Sequence[str], corpus_size: int,
               num_queries: int, num_passages: int, seed: int) -> Probe:
    """First `num_queries` training queries, their gold passages, and seeded random passages up to `num_passages`."""
    n = min(num_queries, len(queries))
    rows: list[int] = []
    for g in train_gold[:n]:
        rows.extend(r for r in g if r not in rows)
    others = [int(r) for r in np.random.default_rng(seed).permutation(corpus_size) if int(r) not in set(rows)]
    rows.extend(others[: max(0, num_passages - len(rows))])
    where = {r: i for i, r in enumerate(rows)}
    return Probe(rows, list(queries[:n]), [[where[r] for r in g] for g in train_gold[:n]])


def mine(index, qvecs: np.ndarray, gold: Sequence[Sequence[int]], depth: int, skip_top: int) -> list[list[int]]:
    """Hard-negative candidates per query: the index's top `depth` rows minus the top `skip_top` minus gold."""
    _, rows = index.search(qvecs, depth)
    return [[int(r) for r in rows[i][skip_top:] if r >= 0 and int(r) not in set(gold[i])] for i in range(len(gold))]


def staleness(stale: np.ndarray, fresh: np.ndarray, queries: np.ndarray, gold: Sequence[Sequence[int]],
              k: int = 10) -> dict[str, float]:
    """How far the live index lags the current encoder, on the probe (vectors unit-norm, rows aligned).

    - index/drift_cosine: mean over probe passages of 1 - cos(stored vector, current encoder's vector).
    - index/stale_recall@10, index/fresh_recall@10: mean recall@k of the current encoder's probe-query vectors
      against the probe passages' stored vectors vs their freshly encoded vectors; index/stale_vs_fresh_recall
      is fresh - stale (> 0: refreshing the index would retrieve better right now).
    """
    cos = (stale * fresh).sum(1) / (np.linalg.norm(stale, axis=1) * np.linalg.norm(fresh, axis=1)).clip(min=1e-12)

    def recall(passages: np.ndarray) -> float:
        top = np.argsort(-(queries @ passages.T), axis=1, kind="stable")[:, :k]
        return float(np.mean([len(set(top[i].tolist()) & set(g)) / len(g) for i, g in enumerate(gold) if g]))

    rs, rf = recall(stale), recall(fresh)
    return {"index/drift_cosine": float(np.mean(1.0 - cos)), "index/stale_recall@10": rs,
            "index/fresh_recall@10": rf, "index/stale_vs_fresh_recall": rf - rs}


@ray.remote(max_concurrency=4)  # one thread refreshes while the others answer workers' polls
class IndexService:
    """Holds the live index version; builds the next one on the pool without blocking anyone."""

    def __init__(self, cfg: Config, pool, passages: list[str], doc_ids: list[str], fingerprint: str,
                 train_queries: list[str], train_gold: list[list[int]], probe: Probe):
        import faiss

        faiss.omp_set_num_threads(max(1, int(cfg.resources.pool.cpus_per_actor)))  # stay inside the pool's CPUs
        self.cfg, self.pool, self.passages, self.doc_ids = cfg, pool, passages, doc_ids
        self.fingerprint, self.train_queries, self.train_gold, self.probe = fingerprint, train_queries, train_gold, probe
        self.pool.invalidate()  # the driver may have loaded weights since this copy of the pool was made
        self.live: Optional[LiveVersion] = None
        self.index = None
        self._busy = threading.Lock()  # only one refresh at a time
        self._swap = threading.Lock()
        self.failures: list[str] = []
        self.history: list[dict[str, float]] = []

    def publish(self, step: int, vectors: np.ndarray, weights: list) -> dict[str, Any]:
        """Version 0 from corpus vectors the driver already encoded (the zero-shot index), not a second encode."""
        return self._run(step, weights[0], vectors)

    def refresh(self, step: int, weights: list) -> dict[str, Any]:
        """Encode the corpus with the snapshot in `weights[0]` (an ObjectRef, passed inside a list so Ray does not
        resolve it here) and swap the new version in; returns its stats, or why it was skipped or failed."""
        return self._run(step, weights[0], None)

    def _run(self, step: int, weights_ref, vectors: Optional[np.ndarray]) -> dict[str, Any]:
        from ragtrain.index.faiss_index import build_configured

        if not self._busy.acquire(blocking=False):
            return {"ok": False, "skipped": "a refresh is already running", "step": step}
        start = time.perf_counter()
        try:
            version = 0 if self.live is None else self.live.version + 1
            self.pool.set_weights(("refresh", version, step), weights_ref)
            r, idx = self.cfg.retriever, self.cfg.index
            if vectors is None:
                vectors, _ = self.pool.encode(self.passages, r.passage_max_length, idx, progress=False)
            index = build_configured(vectors, self.doc_ids, idx, self.fingerprint, f"{r.model}@step{step}", step,
                                     self.cfg.seed)
            index.meta.version = version
            qvecs, _ = self.pool.encode(self.train_queries, r.query_max_length, idx, progress=False)
            t = r.train
            negatives = mine(index, qvecs, self.train_gold, t.hard_negative_depth, t.hard_negative_skip_top)
            live = LiveVersion(version, step, negatives, vectors[self.probe.rows].copy(), time.perf_counter() - start)
            with self._swap:  # atomic: readers see the old version or the new one, never a mix
                self.live, self.index = live, index
            stats = {"ok": True, "version": version, "step": step, "seconds": live.build_seconds,
                     "node": ray.get_runtime_context().get_node_id()}
            self.history.append(stats)
            return stats
        except Exception as e:  # keep serving the old version; the caller logs the failure
            self.failures.append(f"step {step}: {e!r}")
            traceback.print_exc()
            return {"ok": False, "error": repr(e), "step": step, "seconds": time.perf_counter() - start}
        finally:
            self._busy.release()

    def version(self) -> int:
        """The live version number (-1 before the first publish): a cheap poll."""
        return -1 if self.live is None else self.live.version

    def latest(self) -> Optional[LiveVersion]:
        """The live version."""
        with self._swap:
            return self.live

    def search(self, qvecs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, rows) from the live index."""
        with self._swap:
            index = self.index
        return index.search(qvecs, k)

    def report(self) -> dict[str, Any]:
        """Refresh history and failures."""
        return {"history": list(self.history), "failures": list(self.failures)}

    def close(self) -> None:
        """Wait for a running refresh to finish, so the pool can be handed back to the driver."""
        with self._busy:
            pass


class LiveIndexClient:
    """Worker side of the live index: pulls new versions; on rank 0 also schedules refreshes."""

    def __init__(self, service, cfg: Config, rank: int):
        self.service, self.cfg, self.rank = service, cfg, rank
        self.live: LiveVersion = ray.get(service.latest.remote())
        if self.live is None:
            raise RuntimeError("the index service has no published version: publish() must run before training")
        self.pending: Optional[ray.ObjectRef] = None
        self.pending_since = 0.0
        self.refreshes = 0
        self.failures = 0
        self.steps: list[tuple[float, int, bool]] = []  # (seconds, samples, a refresh was running) per step

    def pull(self) -> bool:
        """Swap to a newer published version if there is one (a ~1 ms actor call); True when it changed."""
        if ray.get(self.service.version.remote()) == self.live.version:
            return False
        self.live = ray.get(self.service.latest.remote())
        return True

    def negatives(self) -> list[list[int]]:
        """Hard-negative candidates per training query from the live version."""
        return self.live.negatives

    def in_flight(self) -> bool:
        """True while a refresh started by this client is running."""
        return self.pending is not None and not ray.wait([self.pending], timeout=0)[0]

    def finished(self) -> Optional[dict[str, Any]]:
        """The stats of a refresh that has just completed (once), else None."""
        if self.pending is None or self.in_flight():
            return None
        stats = ray.get(self.pending)
        self.pending = None
        if stats.get("ok"):
            self.refreshes += 1
        elif "error" in stats:
            self.failures += 1
            print(f"[index] refresh from step {stats['step']} failed, the old index stays live: {stats['error']}")
        return stats

    def due(self, step: int, drift: Optional[float]) -> bool:
        """Whether rank 0 should start a refresh now: none running, and the schedule (steps or drift) says so."""
        r = self.cfg.refresh
        if self.pending is not None:
            return False
        if r.every_steps and step - self.live.step >= r.every_steps:
            return True
        return bool(r.drift_threshold) and drift is not None and drift > r.drift_threshold

    def after_step(self, step: int, state_dict_fn, measure_fn, step_seconds: float, samples: int) -> dict[str, float]:
        """Per-step upkeep: pull a new version; on rank 0 log finished refreshes, measure staleness every
        refresh.check_every steps and start a refresh when due. Returns metrics for rank 0 to log."""
        refreshing = self.in_flight() if self.rank == 0 else False
        self.steps.append((step_seconds, samples, refreshing))
        out: dict[str, float] = {}
        if self.pull():
            out["index/version"] = self.live.version
        if self.rank != 0:
            return out
        done = self.finished()
        if done is not None and done.get("ok"):
            out.update({"index/refresh_seconds": done["seconds"], "index/version": done["version"]})
        if done is not None and "error" in done:
            out["index/refresh_failures"] = self.failures
        drift = None
        if step % self.cfg.refresh.check_every == 0:
            out["index/lag_steps"] = step - self.live.step
            m = measure_fn(self.live.probe_vectors)
            drift = m["index/drift_cosine"]
            out.update(m)
        if self.due(step, drift):
            self.start(step, state_dict_fn())
        return out

    def drain(self) -> None:
        """Wait for a refresh still running at the end of training (its snapshot lives in this worker's store)."""
        if self.pending is not None:
            ray.wait([self.pending])
            self.finished()
            self.pull()

    def summary(self) -> dict[str, float]:
        """Rank 0's refresh summary: counts, and training throughput while a refresh ran vs while none did."""
        busy = [(s, n) for s, n, r in self.steps if r]
        idle = [(s, n) for s, n, r in self.steps if not r]
        out = {"index/refreshes": float(self.refreshes), "index/refresh_failures": float(self.failures),
               "index/steps_during_refresh": float(len(busy)), "index/final_version": float(self.live.version)}
        if busy and idle:
            sps_busy = sum(n for _, n in busy) / sum(s for s, _ in busy)
            sps_idle = sum(n for _, n in idle) / sum(s for s, _ in idle)
            out.update({"index/samples_per_s_refreshing": sps_busy, "index/samples_per_s_idle": sps_idle,
                        "index/refresh_throughput_ratio": sps_busy / sps_idle,
                        "index/max_step_s_refreshing": max(s for s, _ in busy),
                        "index/median_step_s_idle": float(np.median([s for s, _ in idle]))})
        return out

    def start(self, step: int, state_dict: dict) -> None:
        """Start a refresh with this snapshot (put in the object store once; the pool actors fetch it)."""
        weights = {k: v.detach().cpu().clone() for k, v in state_dict.items()}
        self.pending = self.service.refresh.remote(step, [ray.put(weights)])
        self.pending_since = time.perf_counter()
