"""The live index over index shards: each shard refreshes its own rows, under a consistency policy.

`ShardedIndexService` has `IndexService`'s interface (index/refresh.py: the trainer's `LiveIndexClient` talks to
either), but the live index is the run's IndexShard actors (index/sharded.py), each holding `LiveRows`
(index/live_rows.py). A refresh round hands every shard the new encoder snapshot; each re-encodes its share
(`refresh.fraction`, chosen by `refresh.priority`) while training steps. When the new rows become searchable is
`refresh.consistency`:

- `global`: every shard builds its new index under a new tag; the service switches every search to that tag at
  once, after the last shard is done. Searches never mix the versions of a round.
- `eager`: each shard's new rows are searched as soon as that shard is done: searches see several encoder
  versions at once (the inconsistency of an index distributed over nodes).
- `aligned`: eager, and rows still at an older version are searched through a linear map into the newest
  version's space (orthogonal Procrustes, `repair/align.py`), fitted on `refresh.anchors` passages that every
  version encodes.

Every state that searches can see is published as a `LiveVersion` (negatives re-mined with the newest snapshot's
query vectors), and measured on the staleness probe: `index/version_skew` (newest - oldest encoder version of the
rows searched), `index/mixed_recall_at_10` (the probe queries' top 10 over the probe passages as searches see
them, against the same passages all encoded by the newest snapshot), `index/mined_agreement` (the same comparison
for the hard negatives mined for those queries: their Jaccard overlap), `index/newest_version_share`,
`index/staleness_steps`, `index/encoded_fraction` and the encode seconds of each shard.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any

import numpy as np
import ray

from ragtrain.config import Config
from ragtrain.console import get_logger
from ragtrain.embed.align import fit_alignment
from ragtrain.index.faiss_index import METRIC, IndexMeta, exact_search
from ragtrain.index.live_rows import version_summary
from ragtrain.index.mining import mine_rows, positive_scores
from ragtrain.index.refresh import LiveService, LiveVersion, Probe, VersionBook
from ragtrain.index.sharded import LIVE_BASE, LiveStateLost, ShardedIndex, _gather, shard_ranges
from ragtrain.precision import resolved_index

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
    a = mine_rows(_Exact(seen), queries, gold, depth, skip_top)
    b = mine_rows(_Exact(consistent), queries, gold, depth, skip_top)
    return float(np.mean([len(set(x) & set(y)) / len(set(x) | set(y)) if x or y else 1.0 for x, y in zip(a, b)]))


def anchor_rows(rows: int, n: int, seed: int) -> list[int]:
    """A seeded sample of `n` corpus rows (sorted): the passages every encoder version encodes for `aligned`."""
    return sorted(np.random.default_rng([seed, 7]).choice(rows, size=min(n, rows), replace=False).tolist())


@ray.remote(max_concurrency=4)  # one thread refreshes while the others answer the workers' polls
class ShardedIndexService(LiveService):
    """The live index held by index shards; refreshes run in a thread of this actor, shard by shard."""

    def __init__(
        self,
        cfg: Config,
        pool,
        actors: list,
        doc_ids: list[str],
        passages,
        sources: list,
        train_queries: list[str],
        train_gold: list[list[int]],
        probe: Probe,
    ):
        # `pool`: the refresh's reservation (a placement group without actors): this service lives in it, and
        # the shards encode on its share of CPUs
        self.cfg, self.pool, self.actors, self.doc_ids, self.passages = cfg, pool, actors, doc_ids, passages
        self.sources, self.train_queries, self.train_gold, self.probe = sources, train_queries, train_gold, probe
        self.ranges = shard_ranges(len(doc_ids), len(actors))
        self.offsets = [a for a, _ in self.ranges]
        self.book = VersionBook()
        self.tag = "live"
        self.meta = None
        self.encoder_version = 0  # the newest version whose rows searches see
        self.last_version = 0  # the newest version a round started: a failed round's number is never reused
        self.encoder_steps: dict[int, int] = {}  # encoder version -> training step of its snapshot
        self.anchors: dict[int, np.ndarray] = {}  # encoder version -> its vectors of the anchor passages
        self.anchor_rows = anchor_rows(len(doc_ids), cfg.refresh.anchors, cfg.seed)
        self.maps: dict[int, np.ndarray] = {}
        self.hot = np.zeros(len(doc_ids), dtype=np.int64)  # rows retrieved or mined since the last round
        self._busy = threading.Lock()
        self._swap = threading.Lock()
        self.failures: list[str] = []
        self.history: list[dict[str, Any]] = []

    # ------------------------------------------------------------------------------------------------ shards

    def _call(
        self, shards: list[int], method: str, *args, what: str = "a live refresh call", quick: bool = False
    ) -> list[Any]:
        """One call per shard; a shard that lost its live rows (restarted) starts them again from disk, once.
        `quick` calls (row fetches, version mixes) wait at most index.shard_timeout_s, as searches do; encodes and
        builds take as long as their rows need."""
        refs = [getattr(self.actors[i], method).remote(*args) for i in shards]
        out = []
        for i, ref in zip(shards, refs):
            try:
                out.append(_gather([ref], [i], what, self.cfg.index.shard_timeout_s if quick else None)[0])
            except LiveStateLost:
                self._start([i])
                out.append(_gather([getattr(self.actors[i], method).remote(*args)], [i], what, None)[0])
        return out

    def _start(self, shards: list[int], fresh: bool = False) -> None:
        refs = [
            self.actors[i].live_start.remote(self.from_tag, self.vector_folder, self.sources[i], *self.ranges[i], fresh)
            for i in shards
        ]
        _gather(refs, shards, "the start of the live rows", None)
        _gather([self.actors[i].live_build.remote(self.tag, self.maps) for i in shards], shards, "a live build", None)

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
            vecs = self._call([s], "live_rows", local, maps, what="a row fetch", quick=True)[0]
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
            if self.cfg.refresh.consistency == "aligned":
                self.anchors[0] = self._rows(self.anchor_rows, {})
            qvecs = self._encode(0, step, weights[0], self.train_queries, "query")
            fresh = self._rows(self.probe.rows, {})
            self.dim = int(fresh.shape[1])
            return self._publish(step, qvecs, fresh, {"encoded_rows": 0})
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
        except Exception as e:  # keep serving what is live; the caller logs the failure
            self.failures.append(f"step {step}: {e!r}")
            traceback.print_exc()
            return {"ok": False, "error": repr(e), "step": step, "seconds": time.perf_counter() - start}
        finally:
            self._busy.release()

    def _round(self, step: int, weights_ref, start: float) -> dict[str, Any]:
        """Encode the round's texts, start every shard's re-encode, let the new rows land as the policy says."""
        r = self.cfg.refresh
        # a new number for every snapshot, even after a failed round: a shard's encoder and its rows' versions
        # never take an older snapshot's label
        self.last_version = v = max(self.last_version, self.encoder_version) + 1
        self.encoder_steps[v] = step
        qvecs = self._encode(v, step, weights_ref, self.train_queries, "query")
        fresh = self._encode(v, step, weights_ref, [self.passages[i] for i in self.probe.rows], "passage")
        extra = len(self.probe.rows)
        if r.consistency == "aligned":
            anchors = [self.passages[i] for i in self.anchor_rows]
            self.anchors[v] = self._encode(v, step, weights_ref, anchors, "passage")
            extra += len(self.anchor_rows)
        encoding = self._launch(v, weights_ref)
        land = self._land_at_once if r.consistency == "global" else self._land_each
        encoded, states = land(v, step, qvecs, fresh, encoding)
        stats = {
            "ok": True,
            "version": self.book.version(),
            "encoder_version": v,
            "step": step,
            "seconds": time.perf_counter() - start,
            "states": len(states),
            "metrics": self._round_metrics(encoded, states, extra),
            "node": ray.get_runtime_context().get_node_id(),
        }
        self.history.append({**stats, "state_metrics": [s["metrics"] for s in states]})
        return stats

    def _launch(self, v: int, weights_ref) -> dict[Any, tuple[int, tuple]]:
        """Every shard starts re-encoding its share of rows with the snapshot of version v (the hot counts since
        the last round go with it); returns {ObjectRef: (shard, its call's arguments)}."""
        cfg, r = self.cfg, self.cfg.refresh
        hot, self.hot = self.hot, np.zeros_like(self.hot)
        pool = cfg.resources.pool  # the refresh's CPUs, shared by the shards: training keeps its own
        threads = max(1, int(pool.cpus_per_actor * pool.num_actors) // len(self.actors))
        idx = resolved_index(cfg)
        out = {}
        for i, (a, b) in enumerate(self.ranges):
            args = (v, [weights_ref], cfg.retriever, idx, r.fraction, r.priority, hot[a:b], cfg.seed, threads)
            out[self.actors[i].live_encode.remote(*args)] = (i, args)
        return out

    def _encoded(self, ref, shard: int, args: tuple) -> dict:
        """A shard's encode result; one restarted since the last round gets its rows back from disk, then encodes."""
        try:
            return _gather([ref], [shard], "a live encode", None)[0]
        except LiveStateLost:
            self._start([shard])
            return _gather([self.actors[shard].live_encode.remote(*args)], [shard], "a live encode", None)[0]

    def _land_at_once(self, v, step, qvecs, fresh, encoding) -> tuple[dict[int, dict], list[dict]]:
        """global: every shard builds version v under a new tag from its stored rows with the round's new ones in
        place (nothing applied yet); then every search switches to it at once, and the shards apply the round.
        A shard that restarts before the barrier lost its new rows: the round fails, and searches keep the old
        tag, which the restarted shard rebuilt from its persisted (older) rows: still one version everywhere."""
        encoded = {i: self._encoded(ref, i, args) for ref, (i, args) in encoding.items()}
        shards = list(range(len(self.actors)))
        tag = f"live{v}"
        try:
            self._call(shards, "live_build", tag, {}, v)
        except Exception:
            for i in shards:  # free the new builds that were made; the old tag stays searched
                self.actors[i].drop.remote(tag)
            raise
        old, self.tag = self.tag, tag  # the barrier: every search from now on sees version v everywhere
        self.encoder_version = v
        self._call(shards, "live_apply", v)
        states = [self._publish(step, qvecs, fresh, {})]
        self._call(shards, "drop", old)
        return encoded, states

    def _land_each(self, v, step, qvecs, fresh, encoding) -> tuple[dict[int, dict], list[dict]]:
        """eager / aligned: each shard's new rows are searched as soon as it is done (aligned: every older
        version's rows through the map into v, so every shard's index changes with each landing)."""
        encoded, states, pending = {}, [], list(encoding)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            i, args = encoding[done[0]]
            encoded[i] = self._encoded(done[0], i, args)
            self._call([i], "live_apply", v)
            self.encoder_version = v
            if self.cfg.refresh.consistency == "aligned":
                self.maps = self._fit_maps(v)
                self._call(list(range(len(self.actors))), "live_build", self.tag, self.maps)
            else:
                self._call([i], "live_build", self.tag, {})
            states.append(self._publish(step, qvecs, fresh, {}))
        return encoded, states

    def _round_metrics(self, encoded: dict[int, dict], states: list[dict], extra: int) -> dict[str, float]:
        """The round's figures: the share of rows re-encoded, the worst version skew and the mean mixed recall of
        the states searches saw, the final state's version mix and staleness, each shard's encode seconds."""
        last = states[-1]["metrics"]
        return {
            "index/encoded_fraction": sum(e["encoded"] for e in encoded.values()) / len(self.doc_ids),
            "index/encoded_extra_rows": float(extra),
            "index/version_skew": max(s["metrics"]["index/version_skew"] for s in states),
            "index/mixed_recall_at_10": float(np.mean([s["metrics"]["index/mixed_recall_at_10"] for s in states])),
            "index/mined_agreement": float(np.mean([s["metrics"]["index/mined_agreement"] for s in states])),
            "index/newest_version_share": last["index/newest_version_share"],
            "index/staleness_steps": last["index/staleness_steps"],
            **{f"index/shard{i}_encode_seconds": e["seconds"] for i, e in sorted(encoded.items())},
        }

    def _encode(self, v: int, step: int, weights_ref, texts: list[str], role: str) -> np.ndarray:
        """A few texts (queries, probe and anchor passages) with the snapshot of encoder version v, on shard 0: the
        shards' own encoder, so the probe's fresh vectors are what a shard would store."""
        cfg = self.cfg
        return self._call([0], "encode_few", v, [weights_ref], cfg.retriever, resolved_index(cfg), texts, role)[0]

    def _fit_maps(self, newest: int) -> dict[int, np.ndarray]:
        """For every older encoder version still stored: the orthogonal map of its anchors onto the newest's."""
        return {u: fit_alignment(self.anchors[u], self.anchors[newest]).weight for u in self.anchors if u != newest}

    def _publish(self, step: int, qvecs: np.ndarray, fresh_probe: np.ndarray, extra: dict) -> dict[str, Any]:
        """Publish the state searches see now: negatives mined with the newest snapshot's query vectors, the
        probe's stored vectors, and what the state mixes."""
        t = self.cfg.retriever.train
        mixes = self._call(list(range(len(self.actors))), "live_mix", quick=True)
        index = _LiveSearch(self)
        positive = None
        if t.hard_negative_margin is not None:  # each query's positive, on its gold rows' searchable vectors only
            wanted = sorted({g for gs in self.train_gold for g in gs})
            local = {g: i for i, g in enumerate(wanted)}
            gold = [[local[g] for g in gs] for gs in self.train_gold]
            positive = positive_scores(qvecs, gold, self._rows(wanted, self.maps))
        negatives = mine_rows(
            index, qvecs, self.train_gold, t.hard_negative_depth, t.hard_negative_skip_top,
            t.hard_negative_margin, t.hard_negative_max_score, positive=positive,
        )  # fmt: skip
        for rows in negatives:
            np.add.at(self.hot, np.asarray(rows, dtype=np.int64), 1)
        seen = self._rows(self.probe.rows, self.maps)
        pq = qvecs[: len(self.probe.queries)]  # the probe queries are the first training queries (make_probe)
        metrics = {
            **version_summary(mixes, self.encoder_steps, step),
            "index/mixed_recall_at_10": mixed_recall(pq, seen, fresh_probe),
            "index/mined_agreement": mined_agreement(
                pq, seen, fresh_probe, self.probe.gold, t.hard_negative_depth, t.hard_negative_skip_top
            ),
        }
        with self._swap:
            version = self.book.version() + 1
            live = LiveVersion(version, step, negatives, seen, 0.0, metrics["index/version_skew"])
            self.book.publish(live)
        return {"ok": True, "version": version, "step": step, "metrics": metrics, **extra}

    def _index(self) -> ShardedIndex:
        if self.meta is None:
            self.meta = IndexMeta(
                factory=self.cfg.index.factory, dim=self.dim, metric=METRIC, ntotal=len(self.doc_ids),
                corpus_fingerprint="", encoder="live", encoder_step=0, precision="",
            )  # fmt: skip
        return ShardedIndex(
            self.actors, self.tag, self.doc_ids, self.meta, self.offsets, self.cfg.index.shard_timeout_s
        )

    def close(self) -> None:
        """Wait for a running refresh, then free the shards' live builds and persisted rows (the trained index
        that follows is built on the same shard actors)."""
        with self._busy:
            shards = list(range(len(self.actors)))
            refs = [a.live_end.remote([self.tag, LIVE_BASE]) for a in self.actors]
            _gather(refs, shards, "the end of the live index", self.cfg.index.shard_timeout_s)

    # ------------------------------------------------------------------------------------------- searches

    def search(self, qvecs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, rows) from the live index (counted as hot rows)."""
        scores, rows = self._search(qvecs, k)
        np.add.at(self.hot, rows[rows >= 0], 1)
        return scores, rows

    def _search(self, qvecs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """A search of the live index. A shard restarted under it (its search retried on the new actor) holds no
        live build: it gets its rows and build back from disk, and the search is asked once more."""
        try:
            return self._index().search(qvecs, k)
        except KeyError:  # Ray's error of a task that raised KeyError is one: "index shard i holds no build ..."
            self._call(list(range(len(self.actors))), "live_mix", quick=True)  # restores the restarted ones
            return self._index().search(qvecs, k)


class _LiveSearch:
    """The live index as `mine_rows` asks for it, searched through the service (which restores restarted shards)."""

    def __init__(self, service: ShardedIndexService) -> None:
        self.service = service

    def search(self, qvecs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.service._search(qvecs, k)
