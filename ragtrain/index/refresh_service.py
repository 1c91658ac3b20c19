"""The live index: the run's index shards refresh their own rows while training steps, under a consistency policy.

`RefreshService` (a threaded Ray actor) drives the run's IndexShard actors (index/sharded.py), each holding
`LiveRows` (index/live_rows.py); the trainer's `LiveIndexClient` (index/live_client.py) talks to it. A refresh round
hands every shard the new encoder snapshot; each re-encodes its share (`refresh.fraction`, chosen by
`refresh.priority`: index/priority/) while training steps. When the new rows become searchable is
`refresh.consistency` (index/consistency/: global, eager, aligned): the service hands the policy the round as a
`RefreshRound` (`_Round` below) and reads back what it did. One shard (index.shards=1) is the same path.

The commit point (the build searches read, its encoder version, the newest published version) is persisted before
any search sees it (index/commit_point.py); Ray restarts a crashed service, which resumes from it. A round that
fails after its commit point is reported committed late (`committed_late`), not failed: searches did switch.

Every state that searches can see is published as a `LiveVersion` (negatives re-mined with the newest snapshot's
query vectors), and measured on the staleness probe: `index/version_skew` (newest - oldest encoder version of the
rows searched), `index/mixed_recall_at_10` (the probe queries' top 10 over the probe passages as searches see
them, against the same passages all encoded by the newest snapshot), `index/mined_agreement` (the same comparison
for the hard negatives mined for those queries: their Jaccard overlap), `index/newest_version_share`,
`index/staleness_steps`, `index/encoded_fraction`, `index/mined_queries` (the training queries re-encoded and
mined for: all of them, or the probe's alone for a trainer that takes no negatives) and each shard's encode
seconds.
"""

from __future__ import annotations

import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from ragtrain.config import FaultConfig
from ragtrain.config.index import IndexConfig, RefreshConfig
from ragtrain.config.resources import PoolResources
from ragtrain.config.retriever import RetrieverConfig
from ragtrain.embed.align import fit_alignment
from ragtrain.index.commit_point import CommitPoint
from ragtrain.index.consistency import POLICIES
from ragtrain.index.faiss_index import METRIC, IndexMeta, exact_search
from ragtrain.index.live_client import LiveVersion, Probe, VersionBook
from ragtrain.index.live_rows import version_summary
from ragtrain.index.mining import MiningSpec, mine_rows, positive_scores
from ragtrain.index.sharded import (
    LIVE_BASE,
    LiveStateLost,
    ShardedIndex,
    ShardUnavailableError,
    _gather,
    shard_ranges,
)
from ragtrain.runtime.console import get_logger

log = get_logger(__name__)


def mixed_recall(queries: np.ndarray, seen: np.ndarray, consistent: np.ndarray, k: int = 10) -> float:
    """Mean overlap of each query's top-k over `seen` passage vectors with its top-k over `consistent` ones."""
    k = min(k, len(seen))
    a = exact_search(queries, seen, k)[1]
    b = exact_search(queries, consistent, k)[1]
    return float(np.mean([len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(a, b)]))


class _Exact:
    """Exact inner-product search over a few vectors in memory (what `mine_rows` asks of an index)."""

    def __init__(self, vectors: np.ndarray):
        self.vectors = vectors

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return exact_search(queries, self.vectors, min(k, len(self.vectors)))


def mined_agreement(
    queries: np.ndarray, seen: np.ndarray, consistent: np.ndarray, gold: list[list[int]], depth: int, skip_top: int
) -> float:
    """Mean Jaccard overlap of the hard negatives mined (same rules as training's) for each query from `seen`
    passage vectors with those mined from `consistent` ones: how much a mixed index changes what training learns
    from. A query with no candidates in either counts as agreeing."""
    spec = MiningSpec(depth, skip_top)
    a = mine_rows(_Exact(seen), queries, gold, spec)
    b = mine_rows(_Exact(consistent), queries, gold, spec)
    return float(np.mean([len(set(x) & set(y)) / len(set(x) | set(y)) if x or y else 1.0 for x, y in zip(a, b)]))


@dataclass(frozen=True)
class RefreshSpec:
    """What the refresh service reads, resolved on the driver (never the run's whole config)."""

    refresh: RefreshConfig  # consistency, fraction, priority, anchors, timeout_s
    retriever: RetrieverConfig  # the encoder the shards rebuild from each snapshot
    index: IndexConfig  # precision resolved for the encode; factory; shard_timeout_s
    mining: MiningSpec
    seed: int
    threads: int  # torch threads of each shard's round encode: the refresh's reserved CPUs shared by the shards
    fault: FaultConfig  # the shard fault hooks (hold_shard_encode, kill_shard_before_apply) for fault tests
    folder: str  # the run's shard root: the service persists its commit point there (index/commit_point.py)


PLACEMENT_TIMEOUT_S = 30.0
SERVICE_RESTARTS = 3  # a crashed service is restarted this many times (from its commit point); calls are retried


def node_traffic(encoded: list[dict]) -> dict[str, float]:
    """The MB the index nodes received and sent while their shards fetched a round's snapshot and encoded: per node
    the largest of its shards' readings (shards of one node read the same counters over overlapping spans), summed
    over the nodes; {} when a shard had no counters (no /proc/net/dev)."""
    per_node: dict[str, tuple[int, int]] = {}
    for e in encoded:
        if "node" not in e:
            return {}
        rx, tx = per_node.get(e["node"], (0, 0))
        per_node[e["node"]] = (max(rx, e["rx_bytes"]), max(tx, e["tx_bytes"]))
    if not per_node:
        return {}
    return {
        "index/round_rx_mb": sum(rx for rx, _ in per_node.values()) / 1e6,
        "index/round_tx_mb": sum(tx for _, tx in per_node.values()) / 1e6,
    }


def reserve(pool: PoolResources) -> PlacementGroup:
    """The live refresh's CPUs: `resources.pool` as a placement group (one bundle per actor, custom resources
    included), so they are never handed to the trainer; the service lives in it and the shards encode on its share."""
    bundle = {"CPU": float(pool.cpus_per_actor), **{k: float(v) for k, v in pool.resources.items()}}
    pg = placement_group([bundle] * pool.num_actors, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:  # feasible on paper (checked up front) but held by someone else: say so instead of hanging
        remove_placement_group(pg)
        raise TimeoutError(
            f"resources.pool: {pool.num_actors} x {bundle} could not be reserved for the live refresh within "
            f"{PLACEMENT_TIMEOUT_S:.0f} s (free now: {ray.available_resources()}); other work holds them"
        )
    return pg


def anchor_rows(rows: int, n: int, seed: int) -> list[int]:
    """A seeded sample of `n` corpus rows (sorted): the passages every encoder version encodes for `aligned`."""
    return sorted(np.random.default_rng([seed, 7]).choice(rows, size=min(n, rows), replace=False).tolist())


# one thread refreshes while the others answer the workers' polls; a crashed service comes back from its commit
# point, and the calls in flight (a poll, a round) are retried on it
@ray.remote(max_concurrency=4, max_restarts=SERVICE_RESTARTS, max_task_retries=SERVICE_RESTARTS)
class RefreshService:
    """The live index held by the index shards: the published versions in `self.book` under `self._swap`, one
    refresh at a time under `self._busy`, run in a thread of this actor, shard by shard. The commit point (the
    committed version and build) is persisted before any search sees it, and read back by a restarted service."""

    def __init__(
        self,
        spec: RefreshSpec,
        actors: list,
        doc_ids: list[str],
        passages,
        sources: list,
        train_queries: list[str],
        train_gold: list[list[int]],
        probe: Probe,
    ):
        self.spec, self.actors, self.doc_ids, self.passages = spec, actors, doc_ids, passages
        self.sources, self.train_queries, self.train_gold, self.probe = sources, train_queries, train_gold, probe
        self.policy = POLICIES[spec.refresh.consistency]()
        self.ranges = shard_ranges(len(doc_ids), len(actors))
        self.offsets = [a for a, _ in self.ranges]
        self.book = VersionBook()
        self.tag = "live"
        self.meta: IndexMeta | None = None  # built on the first _index()
        self.encoder_version = 0  # the newest version whose rows searches see
        self.last_version = 0  # the newest version a round started: a failed round's number is never reused
        self.encoder_steps: dict[int, int] = {}  # encoder version -> training step of its snapshot
        self.anchors: dict[int, np.ndarray] = {}  # encoder version -> its vectors of the anchor passages
        self.anchor_rows = anchor_rows(len(doc_ids), spec.refresh.anchors, spec.seed)
        self.maps: dict[int, np.ndarray] = {}
        self.hot = np.zeros(len(doc_ids), dtype=np.int64)  # rows retrieved or mined since the last round
        self._busy = threading.Lock()
        self._swap = threading.Lock()
        # held from a round's staging to its barrier (global) and by every restart of a shard's live rows: a search
        # that restarts a crashed shard meanwhile resolves its journal against the barrier's outcome, not before it
        self._barrier = threading.RLock()
        # held by a round from the moment searches see its new rows (commit, advance) until that state is published:
        # a pinned search (`search_pinned`) under it reads a state and that state's version number together. Taken
        # after the barrier, never before it: a search holds it alone (its shard restarts run outside it)
        self._state = threading.Lock()
        self.failures: list[str] = []
        self.history: list[dict[str, Any]] = []
        self.from_tag, self.vector_folder, self.dim = "", "", 0  # set by `publish` (or a restart's commit point)
        self._point = threading.Lock()  # one commit point write at a time
        if _restarted():
            self._resume()
        else:  # a new live index: a commit point left in this folder is an earlier one's
            CommitPoint.remove(spec.folder)

    # ------------------------------------------------------------------------------------- what trainers ask

    def snapshot_precision(self) -> str:
        """The precision the shards encode in (index.precision, resolved on the driver): under bf16 they cast every
        snapshot to bf16 on load, so the trainer may send it as bf16, half the bytes on every index node's link."""
        precision = self.spec.index.precision
        return str(getattr(precision, "value", precision))

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

    def committed(self) -> dict[str, Any]:
        """The commit point searches read: {encoder_version, tag}."""
        with self._barrier:
            return {"encoder_version": self.encoder_version, "tag": self.tag}

    # ------------------------------------------------------------------------------------------ commit point

    def _save_point(self, **committing: Any) -> None:
        """Persist the commit point (index/commit_point.py), with `committing` (tag, encoder_version) in place of
        what is in memory: a version is durable before any search sees it."""
        with self._swap:
            published, first = self.book.latest(), self.book.first
        with self._point:
            point = CommitPoint(
                self.tag, self.encoder_version, self.last_version, self.vector_folder, self.dim, first, published,
                dict(self.encoder_steps), dict(self.anchors), dict(self.maps),
            )  # fmt: skip
            replace(point, **committing).save(self.spec.folder)

    def _resume(self) -> None:
        """A restarted service: the commit point back, every shard's live rows restarted from disk against it (a
        journaled round of the committed version finished, any other dropped) and the committed build rebuilt."""
        point = CommitPoint.load(self.spec.folder)
        if point is None:  # restarted before version 0 was published: `publish` (retried) starts it
            return
        self.tag, self.encoder_version, self.last_version = point.tag, point.encoder_version, point.last_version
        self.vector_folder, self.dim, self.from_tag = point.vector_folder, point.dim, LIVE_BASE
        self.encoder_steps, self.anchors, self.maps = point.encoder_steps, point.anchors, point.maps
        self.book = VersionBook(self.book.keep, point.first)
        if point.published is not None:
            self.book.publish(point.published)
        staged = f"live{point.last_version}"
        if staged != self.tag:  # a round cut short before its barrier may have left its staged build
            for a in self.actors:
                a.drop.remote(staged)
        self._start(list(range(len(self.actors))))
        log.warning(
            "the live index service restarted: encoder version %d (build %r) committed, version %d published",
            self.encoder_version, self.tag, self.book.version(),
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------------ shards

    def call_shards(
        self, shards: list[int], method: str, *args, what: str = "a live refresh call", quick: bool = False
    ) -> list[Any]:
        """One call per shard; a shard that lost its live rows (restarted) starts them again from disk, once.
        `quick` calls (row fetches, version mixes) wait at most index.shard_timeout_s, as searches do; encodes and
        builds at most refresh.timeout_s (a shard stopped past it: ShardUnavailableError naming it)."""
        refs = [getattr(self.actors[i], method).remote(*args) for i in shards]
        out = []
        for i, ref in zip(shards, refs):
            try:
                out.append(self._wait([ref], [i], what, quick)[0])
            except LiveStateLost:
                self._start([i])
                out.append(self._wait([getattr(self.actors[i], method).remote(*args)], [i], what, quick)[0])
        return out

    def _wait(self, refs: list, shards: list[int], what: str, quick: bool = False) -> list[Any]:
        if quick:
            return _gather(refs, shards, what, self.spec.index.shard_timeout_s)
        if self.book.latest() is None:  # version 0, before training: the shards' first encoder loads take their time
            return _gather(refs, shards, what, None)
        return _gather(refs, shards, what, self.spec.refresh.timeout_s, "refresh.timeout_s")

    def _start(self, shards: list[int], fresh: bool = False) -> None:
        """(Re)start the live rows of `shards` from disk; a journaled round is finished if it is the version
        searches were switched to (`encoder_version`), else dropped."""
        with self._barrier:
            refs = [
                self.actors[i].live_start.remote(
                    self.from_tag, self.vector_folder, self.sources[i], *self.ranges[i], fresh, self.encoder_version
                )
                for i in shards
            ]
            self._wait(refs, shards, "the start of the live rows")
            builds = [self.actors[i].live_build.remote(self.tag, self.maps) for i in shards]
            self._wait(builds, shards, "a live build")

    def _split(self, rows: list[int]) -> dict[int, list[int]]:
        """Global rows -> {shard: local rows}."""
        out: dict[int, list[int]] = {}
        for r in rows:
            s = int(np.searchsorted(self.offsets, r, side="right") - 1)
            out.setdefault(s, []).append(r - self.offsets[s])
        return out

    def _rows(self, rows: list[int], maps: dict[int, np.ndarray]) -> np.ndarray:
        """Searchable vectors of global rows (in the given order), fetched from their shards."""
        parts = self._split(rows)
        out = {}
        for s, local in parts.items():
            vecs = self.call_shards([s], "live_rows", local, maps, what="a row fetch", quick=True)[0]
            out.update({self.offsets[s] + lr: v for lr, v in zip(local, vecs)})
        return np.stack([out[r] for r in rows])

    # ------------------------------------------------------------------------------------------------ rounds

    def publish(self, step: int, from_tag: str, vector_folder: str, weights: list) -> dict[str, Any]:
        """Version 0: every shard holds its rows of the build `from_tag` (vectors from `vector_folder`)."""
        try:
            self.from_tag, self.vector_folder = from_tag, vector_folder
            self._start(list(range(len(self.actors))), fresh=True)
            self.from_tag = LIVE_BASE  # every shard now holds its own persisted copy of the start build
            self.encoder_steps[0] = step
            if self.policy.needs_anchors:
                self.anchors[0] = self._rows(self.anchor_rows, {})
            qvecs = self._encode(0, step, weights[0], self.train_queries, "query")
            fresh = self._rows(self.probe.rows, {})
            self.dim = int(fresh.shape[1])
            return self.publish_state(step, qvecs, fresh, {"encoded_rows": 0})  # the first commit point too
        except Exception as e:  # the caller sees why version 0 is missing
            traceback.print_exc()
            return {"ok": False, "error": repr(e), "step": step}

    def refresh(self, step: int, weights: list) -> dict[str, Any]:
        """One round: every shard re-encodes its share with the snapshot in `weights[0]`; the new rows become
        searchable as `refresh.consistency` says. Returns the round's stats and metrics."""
        if not self._busy.acquire(blocking=False):
            return {"ok": False, "skipped": "a refresh is already running", "step": step}
        start = time.perf_counter()
        try:
            return self._round(step, weights[0], start)
        except Exception as e:  # keep serving what is live; the caller logs the failure (one line)
            self.failures.append(f"step {step}: {e!r}")
            if not isinstance(e, ShardUnavailableError):  # a lost or stopped shard: its message says it all
                traceback.print_exc()
            error = f"{type(e).__name__}: {e}"
            return {"ok": False, "error": error, "step": step, "seconds": time.perf_counter() - start}
        finally:
            self._busy.release()

    def _round(self, step: int, weights_ref, start: float) -> dict[str, Any]:
        """Encode the round's texts, start every shard's re-encode, let the new rows land as the policy says."""
        # a new number for every snapshot, even after a failed round: a shard's encoder and its rows' versions
        # never take an older snapshot's label (persisted: a restarted service numbers on from it)
        self.last_version = v = max(self.last_version, self.encoder_version) + 1
        self.encoder_steps[v] = step
        self._save_point()
        qvecs = self._encode(v, step, weights_ref, self.train_queries, "query")
        fresh = self._encode(v, step, weights_ref, [self.passages[i] for i in self.probe.rows], "passage")
        extra = len(self.probe.rows)
        if self.policy.needs_anchors:
            anchors = [self.passages[i] for i in self.anchor_rows]
            self.anchors[v] = self._encode(v, step, weights_ref, anchors, "passage")
            extra += len(self.anchor_rows)
        round_ = _Round(self, v, step, qvecs, fresh, self._launch(v, weights_ref))
        try:
            self.policy.land(round_)
            self._retire(round_.retired, wait=True)
        except Exception as e:
            if not round_.committed:
                raise
            return self._committed_late(round_, e, start)
        finally:
            round_.release_state()  # a round that failed before publishing what it committed
        stats = {
            "ok": True,
            "version": self.book.version(),
            "encoder_version": v,
            "step": step,
            "seconds": time.perf_counter() - start,
            "states": len(round_.states),
            "metrics": self._round_metrics(round_.encoded, round_.states, extra),
            "node": ray.get_runtime_context().get_node_id(),
        }
        try:  # after the round's seconds: not part of them
            stats["metrics"].update(self._search_latency(qvecs))
        except ShardUnavailableError as e:  # the round did land: a lost shard costs this round its latency figures
            log.warning("refresh round %d landed; its timed searches failed, so it has no search latency: %s", v, e)
        self.history.append({**stats, "state_metrics": [s["metrics"] for s in round_.states]})
        return stats

    def _committed_late(self, round_: _Round, error: Exception, start: float) -> dict[str, Any]:
        """A round that failed after its commit point: searches did switch to its version, so it is reported
        committed (late), not failed; a shard that has not applied it finishes its journal when it restarts."""
        reason = f"{type(error).__name__}: {error}"
        log.warning("refresh round %d committed late (searches switched to it): %s", round_.version, reason)
        self._retire(round_.retired, wait=False)  # no search reads them: freed whenever the shards get to it
        stats = {
            "ok": True,
            "committed_late": True,
            "late": reason,
            "version": self.book.version(),
            "encoder_version": round_.version,
            "step": round_.step,
            "seconds": time.perf_counter() - start,
            "states": len(round_.states),
            "metrics": {},
            "node": ray.get_runtime_context().get_node_id(),
        }
        self.history.append({**stats, "state_metrics": [s["metrics"] for s in round_.states]})
        return stats

    def _retire(self, tags: list[str], wait: bool) -> None:
        """Drop builds no search reads any more, on every shard (`wait`: for the answers, as a round ends)."""
        for tag in tags:
            refs = [a.drop.remote(tag) for a in self.actors]
            if wait:
                self._wait(refs, list(range(len(self.actors))), "a drop")

    def _launch(self, v: int, weights_ref) -> dict[Any, tuple[int, tuple]]:
        """Every shard starts re-encoding its share of rows with the snapshot of version v (the hot counts since
        the last round go with it); returns {ObjectRef: (shard, its call's arguments)}."""
        spec, r = self.spec, self.spec.refresh
        hot, self.hot = self.hot, np.zeros_like(self.hot)
        out = {}
        for i, (a, b) in enumerate(self.ranges):
            args = (
                v,
                [weights_ref],
                spec.retriever,
                spec.index,
                r.fraction,
                r.priority,
                hot[a:b],
                spec.seed,
                spec.threads,
                spec.fault.hold_shard_encode,
            )
            out[self.actors[i].live_encode.remote(*args)] = (i, args)
        return out

    def _encoded(self, ref, shard: int, args: tuple) -> dict:
        """A shard's encode result (waiting at most refresh.timeout_s); one restarted since the last round gets its
        rows back from disk, then encodes."""
        try:
            return self._wait([ref], [shard], "a live encode")[0]
        except LiveStateLost:
            self._start([shard])
            return self._wait([self.actors[shard].live_encode.remote(*args)], [shard], "a live encode")[0]

    def _round_metrics(self, encoded: dict[int, dict], states: list[dict], extra: int) -> dict[str, float]:
        """The round's figures: the share of rows re-encoded, the worst version skew and the mean mixed recall of
        the states searches saw, the final state's version mix and staleness, each shard's encode seconds."""
        last = states[-1]["metrics"]
        return {
            "index/encoded_fraction": sum(e["encoded"] for e in encoded.values()) / len(self.doc_ids),
            "index/encoded_extra_rows": float(extra),
            "index/mined_queries": float(len(self.train_queries)),  # the queries re-encoded and mined each round
            "index/version_skew": max(s["metrics"]["index/version_skew"] for s in states),
            "index/mixed_recall_at_10": float(np.mean([s["metrics"]["index/mixed_recall_at_10"] for s in states])),
            "index/mined_agreement": float(np.mean([s["metrics"]["index/mined_agreement"] for s in states])),
            "index/newest_version_share": last["index/newest_version_share"],
            "index/staleness_steps": last["index/staleness_steps"],
            **{f"index/shard{i}_encode_seconds": e["seconds"] for i, e in sorted(encoded.items())},
            **node_traffic(list(encoded.values())),
        }

    def _search_latency(self, qvecs: np.ndarray) -> dict[str, float]:
        """refresh.search_probe single-query top-10 searches of the new state, timed one by one from the service's
        node (a scatter to every shard and the merge): their median and 95th percentile in ms; {} when 0."""
        n = self.spec.refresh.search_probe
        if not n:
            return {}
        ms = []
        for i in range(n):
            q = qvecs[i % len(qvecs)][None, :]
            t0 = time.perf_counter()
            self._search(q, 10)
            ms.append((time.perf_counter() - t0) * 1e3)
        return {"index/search_ms_p50": float(np.median(ms)), "index/search_ms_p95": float(np.percentile(ms, 95))}

    def _encode(self, v: int, step: int, weights_ref, texts: list[str], role: str) -> np.ndarray:
        """A few texts (queries, probe and anchor passages) with the snapshot of encoder version v, on shard 0: the
        shards' own encoder, so the probe's fresh vectors are what a shard would store."""
        spec = self.spec
        return self.call_shards([0], "encode_few", v, [weights_ref], spec.retriever, spec.index, texts, role)[0]

    def _fit_maps(self, newest: int) -> dict[int, np.ndarray]:
        """For every older encoder version still stored: the orthogonal map of its anchors onto the newest's."""
        return {u: fit_alignment(self.anchors[u], self.anchors[newest]).weight for u in self.anchors if u != newest}

    def publish_state(self, step: int, qvecs: np.ndarray, fresh_probe: np.ndarray, extra: dict) -> dict[str, Any]:
        """Publish the state searches see now: negatives mined with the newest snapshot's query vectors, the
        probe's stored vectors, and what the state mixes (persisted with the commit point)."""
        m = self.spec.mining
        mixes = self.call_shards(list(range(len(self.actors))), "live_mix", quick=True)
        index = _LiveSearch(self)
        positive = None
        if m.margin is not None:  # each query's positive, on its gold rows' searchable vectors only
            wanted = sorted({g for gs in self.train_gold for g in gs})
            local = {g: i for i, g in enumerate(wanted)}
            gold = [[local[g] for g in gs] for gs in self.train_gold]
            positive = positive_scores(qvecs, gold, self._rows(wanted, self.maps))
        negatives = mine_rows(index, qvecs, self.train_gold, m, positive=positive)
        for rows in negatives:
            np.add.at(self.hot, np.asarray(rows, dtype=np.int64), 1)
        seen = self._rows(self.probe.rows, self.maps)
        pq = qvecs[: len(self.probe.queries)]  # the probe queries are the first training queries (make_probe)
        metrics = {
            **version_summary(mixes, self.encoder_steps, step),
            "index/mixed_recall_at_10": mixed_recall(pq, seen, fresh_probe),
            "index/mined_agreement": mined_agreement(pq, seen, fresh_probe, self.probe.gold, m.depth, m.skip_top),
        }
        with self._swap:
            version = self.book.version() + 1
            live = LiveVersion(version, step, negatives, seen, 0.0, metrics["index/version_skew"])
            self.book.publish(live)
        self._save_point()
        return {"ok": True, "version": version, "step": step, "metrics": metrics, **extra}

    def _index(self) -> ShardedIndex:
        if self.meta is None:
            self.meta = IndexMeta(
                factory=self.spec.index.factory, dim=self.dim, metric=METRIC, ntotal=len(self.doc_ids),
                corpus_fingerprint="", encoder="live", encoder_step=0, precision="",
            )  # fmt: skip
        return ShardedIndex(
            self.actors, self.tag, self.doc_ids, self.meta, self.offsets, self.spec.index.shard_timeout_s
        )

    def close(self) -> None:
        """Wait for a running refresh, then free the shards' live builds and persisted rows (the trained index
        that follows is built on the same shard actors)."""
        with self._busy:
            shards = list(range(len(self.actors)))
            refs = [a.live_end.remote([self.tag, LIVE_BASE]) for a in self.actors]
            _gather(refs, shards, "the end of the live index", self.spec.index.shard_timeout_s)
            CommitPoint.remove(self.spec.folder)

    # ------------------------------------------------------------------------------------------- searches

    def search(self, qvecs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, rows) from the live index (counted as hot rows)."""
        scores, rows = self._search(qvecs, k)
        np.add.at(self.hot, rows[rows >= 0], 1)
        return scores, rows

    def search_pinned(self, qvecs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Top-k (scores, rows) from the live index and the number of the published version they were read from:
        no round changes what searches see, or publishes, between the search and the number (`_state`). A training
        step's one search (`LiveIndexClient.search_step`), so the step is labelled with the version it read."""
        with self._state:
            try:
                return self._pinned(qvecs, k)
            except KeyError:  # a shard restarted under it: its rows back (outside the lock: that takes the barrier)
                pass
        self.call_shards(list(range(len(self.actors))), "live_mix", quick=True)
        with self._state:
            return self._pinned(qvecs, k)

    def _pinned(self, qvecs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, int]:
        scores, rows = self._index().search(qvecs, k)
        np.add.at(self.hot, rows[rows >= 0], 1)
        with self._swap:
            return scores, rows, self.book.version()

    def _search(self, qvecs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """A search of the live index. A shard restarted under it (its search retried on the new actor) holds no
        live build: it gets its rows and build back from disk, and the search is asked once more."""
        try:
            return self._index().search(qvecs, k)
        except KeyError:  # Ray's error of a task that raised KeyError is one: "index shard i holds no build ..."
            self.call_shards(list(range(len(self.actors))), "live_mix", quick=True)  # restores the restarted ones
            return self._index().search(qvecs, k)


class _LiveSearch:
    """The live index as `mine_rows` asks for it, searched through the service (which restores restarted shards)."""

    def __init__(self, service: RefreshService) -> None:
        self.service = service

    def search(self, qvecs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.service._search(qvecs, k)


def _restarted() -> bool:
    """Whether this actor is a restart (Ray's property reads its deprecated `actor_id` inside: its warning is noise)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


class _Round:
    """One refresh round as its consistency policy sees it (`consistency.base.RefreshRound`): the service's shards
    and state behind a few calls; what the round did (`encoded`, `states`, `committed`, `retired`) is read back by
    the service when the policy returns or raises."""

    def __init__(
        self, service: RefreshService, version: int, step: int, qvecs: np.ndarray, fresh: np.ndarray, encoding: dict
    ) -> None:
        self._service, self.version, self.step = service, version, step
        self._qvecs, self._fresh, self._encoding = qvecs, fresh, encoding  # {encode ObjectRef: (shard, args)}
        self.shards = list(range(len(service.actors)))
        self.kill_before_apply = service.spec.fault.kill_shard_before_apply
        self.encoded: dict[int, dict] = {}  # shard -> its encode's stats
        self.states: list[dict] = []  # one per state searches could see
        self.committed = False  # True from the commit point on: what fails after it is late, not a failure
        self.retired: list[str] = []  # builds searches left at the commit point: dropped once the round ends
        self.holding = False  # holds the service's `_state`: what searches see changed, not yet published

    @property
    def tag(self) -> str:
        return self._service.tag

    def finished_encodes(self) -> Iterator[int]:
        s = self._service
        timeout = s.spec.refresh.timeout_s
        deadline, pending = time.monotonic() + timeout, list(self._encoding)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                late = sorted(self._encoding[r][0] for r in pending)
                raise ShardUnavailableError(
                    f"index shard{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not answer a live "
                    f"encode within {timeout:g} s (refresh.timeout_s): it is stopped, restarting or its node is lost"
                )
            shard, args = self._encoding[done[0]]
            self.encoded[shard] = s._encoded(done[0], shard, args)
            yield shard

    def call(self, shards: list[int], method: str, *args: Any) -> list[Any]:
        return self._service.call_shards(shards, method, *args)

    def barrier(self) -> AbstractContextManager[Any]:
        return self._service._barrier

    def discard(self, tag: str) -> None:
        for i in self.shards:  # not waited for: the old build stays searched whatever they answer
            self._service.actors[i].live_discard.remote(tag)

    def hold_state(self) -> None:
        """Pinned searches wait from here until the state searches see next is published (`publish`)."""
        if not self.holding:
            self._service._state.acquire()
            self.holding = True

    def release_state(self) -> None:
        if self.holding:
            self.holding = False
            self._service._state.release()

    def commit(self, tag: str) -> None:
        s = self._service
        with s._barrier:
            self.hold_state()
            s._save_point(tag=tag, encoder_version=self.version)  # durable first: no search sees an uncommitted one
            old, s.tag, s.encoder_version = s.tag, tag, self.version
            self.committed = True
        if old != tag:
            self.retired.append(old)

    def advance(self) -> None:
        s = self._service
        with s._barrier:
            self.hold_state()  # the shard's rows become searchable with the rebuild that follows
            s._save_point(encoder_version=self.version)
            s.encoder_version = self.version  # a shard at a time: a later one that fails still fails the round

    def align(self) -> dict[int, np.ndarray]:
        s = self._service
        s.maps = s._fit_maps(self.version)
        s._save_point()
        return s.maps

    def publish(self) -> None:
        try:
            self.states.append(self._service.publish_state(self.step, self._qvecs, self._fresh, {}))
        finally:
            self.release_state()
