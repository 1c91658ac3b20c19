"""Retrieval over the configured corpus: build an index on Ray Data, search it, evaluate it, mine negatives from it.

`Retrieval.build` returns a `BuiltIndex` (the index, the encoder snapshot(s) that built it and where its vectors
are); everything after takes that value, so no caller saves and restores state around a call. Every index lives in
the run's shard group (`index/sharded.py`: index.shards IndexShard actors, one by default, each indexing a row
range; searches are scattered and merged): the driver holds its passage ids, not its vectors. Every search
encodes its queries with `QueryEncoder` (the corpus actors' own class, `ragtrain/corpus/encode.py`); hard negatives
come from the one rule in `mining.py`; the live refresh runs on the same shards (`refresh_service.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ragtrain.cluster.resources import record_placement_group
from ragtrain.config import Config
from ragtrain.config.index import IndexConfig
from ragtrain.config.retriever import RetrieverConfig
from ragtrain.corpus.dataset import passage_qrels
from ragtrain.corpus.encode import VECTORS_META, VectorSet, build_threads, encode_to_vectors
from ragtrain.data import RetrievalData
from ragtrain.data.store import PassageStore
from ragtrain.embed.align import fit_alignment
from ragtrain.embed.encoders import EncodeFault, QueryEncoder, encoder_dim
from ragtrain.embed.precision import resolved_index
from ragtrain.eval.answers import answer_recall
from ragtrain.eval.metrics import DEFAULT_KS, evaluate, maxp_run, run_from_scores
from ragtrain.index import vector_cache
from ragtrain.index.base import Index, ReadOnlyIndex
from ragtrain.index.faiss_index import check_index_config
from ragtrain.index.mining import MiningSpec, mine_rows, positive_scores
from ragtrain.index.vector_ops import DRIFT_SAMPLE, drift, map_vectors, mean_vectors, sample_ids
from ragtrain.runtime.console import get_logger

if TYPE_CHECKING:  # lazy at run time: these modules import Ray
    from ray.util.placement_group import PlacementGroup

    from ragtrain.index.sharded import ShardGroup

log = get_logger(__name__)

# Chunked corpora: retrieve this many passages per wanted document, so MaxP still leaves index.top_k documents
MAXP_DEPTH_FACTOR = 10


@dataclass
class BuiltIndex:
    """One index build: the FAISS index, the encoder snapshot(s) behind it, and its vectors' whereabouts."""

    tag: str
    index: Index | ReadOnlyIndex  # the run's ShardedIndex; a saved one opened in this process (paired): read-only
    snapshots: list[dict[str, torch.Tensor]]
    corpus_ids: list[str]  # corpus order
    stats: dict
    shards: Any = None  # VectorSet: the vectors on disk (several snapshots: their consensus, shard by shard)
    _encoder: Any = field(default=None, repr=False)

    def query_encoder(self, retriever: RetrieverConfig, idx: IndexConfig) -> QueryEncoder:
        """The QueryEncoder of this build's snapshot(s) (loaded once)."""
        if self._encoder is None:
            self._encoder = QueryEncoder(retriever, self.snapshots, idx.batch_size, idx.precision.value)
        return self._encoder


class Retrieval:
    """Builds indexes of the corpus on Ray Data and evaluates them on the configured split."""

    def __init__(self, cfg: Config, data: RetrievalData):
        self.cfg, self.data = cfg, data
        self._shards: ShardGroup | None = None
        self._reserved: PlacementGroup | None = None  # the live refresh's CPUs, held while it runs
        self.doc_ids = list(data.corpus)
        self.fingerprint = data.fingerprint()
        # Training and mining work on passages: with chunks, every chunk of a judged document carries its grade
        self.train_qrels = passage_qrels(data.train_qrels, data.doc_of)

    @cached_property
    def positions(self) -> dict[str, int]:
        """Passage id -> corpus position (the order of `doc_ids`, of the trainer's texts and of TrainExample)."""
        return {d: i for i, d in enumerate(self.doc_ids)}

    def passages(self) -> Sequence[str]:
        """Every passage's text in corpus order (the trainer's and the live refresh's input): a PassageStore's
        on-demand view (pickled as the store's path), or a list for an in-memory corpus."""
        corpus = self.data.corpus
        return corpus.texts() if isinstance(corpus, PassageStore) else [p.full_text() for p in corpus.values()]

    @property
    def shard_group(self):
        """The run's IndexShard actors (index.shards), started on first use; builds persist under
        <output_dir>/shards/<tag>/shard-<i>/."""
        if self._shards is None:
            import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

            # lazy: ragtrain.index.sharded imports faiss/ray; this module imports without them
            from ragtrain.index.sharded import ShardGroup, resolve_shards, shard_gpus

            idx = self.cfg.index
            n = resolve_shards(idx.shards, len(self.doc_ids), ray.nodes())
            self._shards = ShardGroup(
                n,
                Path(self.cfg.output_dir) / "shards",
                self.cfg.resources.pool,
                idx.shard_timeout_s,
                gpu=shard_gpus(idx),
            )
        return self._shards

    def index_from(self, tag: str, shards: Any, encoder_name: str, step: int) -> Index:
        """The index of the vector set `shards` under `tag`, split over the index shards."""
        cfg = self.cfg
        return self.shard_group.build(tag, shards, cfg.index, self.fingerprint, encoder_name, step, cfg.seed)

    def close(self) -> None:
        """Release the refresh's CPUs and stop the index shards (the end of a run)."""
        self.release()
        if self._shards is not None:
            self._shards.close()
            self._shards = None

    def release(self) -> None:
        """Give the live refresh's reserved CPUs back to the cluster (the trainer needs them on a small machine)."""
        if self._reserved is not None:
            from ray.util.placement_group import remove_placement_group  # lazy: ray is heavy (~0.5 s)

            remove_placement_group(self._reserved)
            self._reserved = None

    def build(self, tag: str, snapshots: list[dict[str, torch.Tensor]], encoder_name: str, step: int) -> BuiltIndex:
        """Encode the corpus into vector files (`vectors_of`) and build the FAISS index from them.

        One snapshot: its vectors. Several (sync=vector_avg: one per replica): every replica encodes every
        passage and the index holds the re-normalised mean vector; queries are averaged the same way.
        """
        cfg, idx = self.cfg, resolved_index(self.cfg)  # auto: as the encode actors will run it (key, index meta)
        # A factory FAISS rejects, or more IVF lists than passages: fail before encoding anything
        check_index_config(idx.factory, encoder_dim(cfg.retriever), len(self.doc_ids))
        vec_dir = Path(cfg.output_dir).resolve() / "vectors"
        fault = None
        if cfg.fault.kill_encode_actor_at_batch >= 0:  # fault injection (tests): one encode actor dies, once per run
            vec_dir.mkdir(parents=True, exist_ok=True)
            fault = EncodeFault(cfg.fault.kill_encode_actor_at_batch, str(vec_dir / ".encode_actor_killed"))
        folders = [vec_dir / (tag if len(snapshots) == 1 else f"{tag}_{i}") for i in range(len(snapshots))]
        sets = [self.vectors_of(tag, w, f, fault, alone=len(snapshots) == 1) for w, f in zip(snapshots, folders)]
        seconds = sum(s.seconds for s in sets)
        # vector_avg: the consensus is computed file by file into its own vector folder; the index shards build
        # FAISS from it either way, so the driver holds neither vectors nor index
        shards = sets[0] if len(sets) == 1 else mean_vectors(sets, vec_dir / tag)
        index = self.index_from(tag, shards, encoder_name, step)
        stats = {"docs": len(self.doc_ids), "seconds": seconds, "index_build_seconds": index.meta.build_seconds}
        if all(s.stats.get("cache_hit") for s in sets):  # nothing was encoded: no throughput to report
            stats["encode_cache_hit"] = 1.0
        else:
            stats["docs_per_s"] = len(self.doc_ids) * len(sets) / seconds
        stats["index_shard_peak_rss_mb"] = max(index.meta.extra["shard_peak_rss_mb"])  # the largest shard's process
        return BuiltIndex(tag, index, list(snapshots), self.doc_ids, stats, shards)

    def vectors_of(
        self, tag: str, weights: dict[str, torch.Tensor], folder: Path, fault: Any, alone: bool = True
    ) -> Any:
        """The corpus's vectors under `weights` as a VectorSet in `folder`: from the corpus stream (`alone`: one
        snapshot) or the vector cache when they hold them, else encoded: on Ray Data's encode actors (the corpus
        stream's encode) with one index shard, by the shards themselves (each its row range, where it runs) with
        several."""
        import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

        cfg, idx = self.cfg, resolved_index(self.cfg)
        streamed = self._streamed(folder, weights) if alone else None
        if streamed is not None:  # encoded as the corpus was read (corpus/stream.py): the same weights, corpus
            log.info(f"[{tag}] {streamed.rows} passage vectors from the corpus stream ({folder})")
            return streamed.in_order(self.doc_ids)
        key = None
        if idx.cache_dir and fault is None:  # the same weights on the same corpus were encoded before: reuse
            key = vector_cache.cache_key(
                weights, cfg.retriever, idx, self.fingerprint, cfg.retriever.passage_max_length
            )
            cached = vector_cache.lookup(idx.cache_dir, key, folder)
            if cached is not None:
                log.info(f"[{tag}] {len(self.doc_ids)} passage vectors from the cache ({Path(idx.cache_dir) / key})")
                return cached.in_order(self.doc_ids)
        # A store is read by Ray Data's tasks (or the shards) a range at a time; an in-memory corpus goes as lists
        source = self.data.corpus if isinstance(self.data.corpus, PassageStore) else (self.doc_ids, self.passages())
        pool = cfg.resources.pool
        if self.shard_group.n > 1:  # each shard reads and encodes its own row range, where it runs
            log.info(f"[{tag}] encoding {len(self.doc_ids)} passages on {self.shard_group.n} index shards")
            got = self.shard_group.encode(source, ray.put(weights), cfg.retriever, idx, folder)
        else:
            threads = build_threads(pool)
            n, each = len(self.doc_ids), f"{threads} torch thread{'s' if threads > 1 else ''} each"
            log.info(f"[{tag}] encoding {n} passages on Ray Data ({pool.num_actors} actors, {each})")
            got = encode_to_vectors(
                source, ray.put(weights), cfg.retriever, idx, pool, folder, vector_dtype=idx.vector_dtype,
                fault=fault, num_gpus_per_actor=pool.gpus_per_actor, num_threads=threads,
            )  # fmt: skip
        got = got.in_order(self.doc_ids)  # the index's row r is the corpus's row r (the live refresh relies on it)
        if key is not None and idx.cache_dir:  # key: set only with a cache
            vector_cache.store(idx.cache_dir, key, got)
        return got

    def _streamed(self, folder: Path, weights: dict[str, torch.Tensor]) -> Any:
        """The VectorSet the corpus stream wrote in `folder` if it holds this corpus under these weights, or None."""
        if not (folder / VECTORS_META).exists():
            return None
        shards = VectorSet.load(folder)
        if not shards.stats.get("streamed") or shards.stats.get("corpus") != self.fingerprint:
            return None
        cfg = self.cfg
        key = vector_cache.cache_key(
            weights, cfg.retriever, resolved_index(cfg), self.fingerprint, cfg.retriever.passage_max_length
        )
        return shards if shards.stats.get("key") == key else None

    def build_and_evaluate(
        self, tag: str, snapshots: list[dict[str, torch.Tensor]], encoder_name: str, step: int
    ) -> tuple[BuiltIndex, dict[str, float]]:
        """`build`, then `evaluate` on the split; returns (build, metrics incl. the encode's docs/s and the largest
        index shard's peak RSS)."""
        built = self.build(tag, snapshots, encoder_name, step)
        extra = {k: built.stats[k] for k in ("index_shard_peak_rss_mb", "encode_cache_hit") if k in built.stats}
        if "docs_per_s" in built.stats:
            extra["encode_docs_per_s"] = built.stats["docs_per_s"]
        return built, {**self.evaluate(built), **extra}

    def encode_queries(self, built: BuiltIndex, qids: list[str]) -> np.ndarray:
        """The queries' vectors under `built`'s snapshot(s), encoded as its passages were."""
        return built.query_encoder(self.cfg.retriever, self.cfg.index).encode(
            [self.data.queries[q] for q in qids], role="query"
        )

    def search(
        self, built: BuiltIndex, qids: list[str], k: int, vectors: np.ndarray | None = None
    ) -> dict[str, list[str]]:
        """Top-k doc ids for each query (the index's row order is shard order, so rows are named by the index);
        `vectors`: the queries' vectors when already encoded."""
        _, rows = built.index.search(self.encode_queries(built, qids) if vectors is None else vectors, k)
        return run_from_scores(qids, built.index.doc_ids, rows)

    def ranked(self, built: BuiltIndex) -> dict[str, list[str]]:
        """The evaluated split's rankings under `built`: top `index.top_k` documents per query."""
        qids = sorted(self.data.eval_qrels)
        k = self.cfg.index.top_k
        if not self.data.doc_of:
            return self.search(built, qids, k)
        # Chunks: MaxP (a document ranks at its best chunk) before the cut-offs, so qrels stay on documents. A
        # document with many chunks can fill a fixed passage depth on its own, so a query whose passages name
        # fewer than k documents is searched again deeper, up to the whole index: every query gets its true top k.
        vectors, total = self.encode_queries(built, qids), len(self.doc_ids)
        out: dict[str, list[str]] = {}
        todo, depth = list(range(len(qids))), min(total, k * MAXP_DEPTH_FACTOR)
        while todo:
            run = maxp_run(self.search(built, [qids[i] for i in todo], depth, vectors[todo]), self.data.doc_of, depth=k)
            out.update(run)
            todo = [i for i in todo if len(run[qids[i]]) < k and depth < total]
            depth = min(total, depth * 4)
        return out

    def evaluate(self, built: BuiltIndex) -> dict[str, float]:
        """Retrieval metrics of `built` on the evaluated split; with short answers (SQuAD, the synthetic KB) also
        answer_recall@k: a gold answer in one of the top-k passages (ragtrain/eval/answers.py)."""
        ranked = self.ranked(built)
        metrics = evaluate(ranked, self.data.eval_qrels)
        qids = sorted(q for q in self.data.eval_qrels if q in self.data.answers)
        if qids:
            # on passages, the reader's input: a chunked corpus's document ranking is searched again as passages
            run = ranked if not self.data.doc_of else self.search(built, qids, max(DEFAULT_KS))
            metrics |= answer_recall(run, self.data.answers, self.passage_texts(run), qids)
        return metrics

    def passage_texts(self, run: dict[str, list[str]]) -> dict[str, str]:
        """Passage id -> body text of every passage in `run`, read from the store in one batch."""
        ids = list(dict.fromkeys(p for ranked in run.values() for p in ranked))
        corpus = self.data.corpus
        if isinstance(corpus, PassageStore):
            return {p.id: p.text for p in corpus.passages([self.positions[i] for i in ids])}
        return {i: corpus[i].text for i in ids}

    def evaluate_stale(self, stale: BuiltIndex, trained: BuiltIndex, step: int) -> dict[str, dict[str, float]]:
        """The stale (zero-shot) vectors searched with the trained query encoder, as is and after an orthogonal map
        onto the trained space fitted on `index.align_anchors` anchor passages (their trained vectors are rows of
        `trained`). Returns {"stale": ..., "stale_aligned": ...}. Shard by shard: only the anchors' vectors and a
        drift sample are read into the driver; the mapped vectors are written as a vector set for the index shards."""
        idx, seed = resolved_index(self.cfg), self.cfg.seed
        anchors = sample_ids(self.doc_ids, idx.align_anchors, seed)
        align = fit_alignment(stale.shards.vectors_of(anchors), trained.shards.vectors_of(anchors), "orthogonal")
        aligned = map_vectors(stale.shards, align.apply, Path(stale.shards.folder).parent / "stale_aligned")
        measured = sample_ids(self.doc_ids, DRIFT_SAMPLE, seed + 1)
        out = {}
        for tag, shards in (("stale", stale.shards), ("stale_aligned", aligned)):
            index = self.index_from(tag, shards, tag, step)
            # searched with the trained encoder: the question is how far the old vectors lag it
            view = BuiltIndex(
                tag,
                index,
                trained.snapshots,
                self.doc_ids,
                {},
                shards,
                _encoder=trained.query_encoder(self.cfg.retriever, self.cfg.index),
            )
            out[tag] = {
                **self.evaluate(view),
                "drift_vs_trained": drift(shards, trained.shards, measured),
                "anchors": float(len(anchors)),
                "drift_rows": float(len(measured)),
            }
            index.drop()
        return out

    def mine_negatives(self, built: BuiltIndex) -> dict[str, list[int]]:
        """Hard-negative candidates (corpus positions) for each training query: the one rule of mining.py."""
        spec = MiningSpec.of(self.cfg.retriever.train)
        qids = sorted(self.train_qrels)
        index = built.index
        row = {d: i for i, d in enumerate(index.doc_ids)}  # the index's row order (shard order)
        pos = self.positions
        # all chunks of a gold document are gold
        gold = [[row[d] for d, g in self.train_qrels[q].items() if g > 0 and d in row] for q in qids]
        qvecs = self.encode_queries(built, qids)
        positive = None
        if spec.margin is not None:  # each query's positive, scored on the stored vectors of gold only
            wanted = sorted({r for g in gold for r in g})
            local = {r: i for i, r in enumerate(wanted)}
            ids = [index.doc_ids[r] for r in wanted]
            vecs = built.shards.vectors_of(ids)
            positive = positive_scores(qvecs, [[local[r] for r in g] for g in gold], vecs)
        mined = mine_rows(index, qvecs, gold, spec, positive=positive)
        return {q: [pos[index.doc_ids[r]] for r in rows] for q, rows in zip(qids, mined)}

    def start_service(
        self,
        built: BuiltIndex,
        weights: dict[str, torch.Tensor],
        first_version: int = 0,
        step: int = 0,
        negatives: bool = True,
    ):
        """Start the live refresh (refresh.enabled) on the index shards with its first version = `built`'s vectors,
        encoded with `weights` at training step `step`, numbered `first_version` (a resumed run continues from its
        checkpoint: both nonzero); returns (service actor, staleness probe). Every published version carries hard
        negatives mined for every training query; `negatives=False` (a trainer that takes none: joint training's
        retriever learns from the generator) keeps to the staleness probe's queries, which the round's metrics read:
        re-encoding every training query each round cost as much as the passages' share on SQuAD (7,117 questions)."""
        import ray  # lazy: ray is heavy (~0.5 s); this module imports without it
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # lazy: as ray

        # lazy: ragtrain.index.refresh_service imports faiss/ray; this module imports without them
        from ragtrain.index.live_client import make_probe
        from ragtrain.index.refresh_service import RefreshService, RefreshSpec, reserve
        from ragtrain.index.sharded import ShardedIndex, shard_ranges

        if not isinstance(built.index, ShardedIndex):  # e.g. a saved index opened in this process (ReadOnlyShards)
            raise TypeError(f"the live index service starts from the run's index shards, not {built.index!r}")
        if len(built.snapshots) != 1:
            raise ValueError(
                f"the live index service starts from one encoder's vector files; {built.tag!r} holds the "
                f"consensus of {len(built.snapshots)} replicas"
            )
        cfg, r, pool = self.cfg, self.cfg.refresh, self.cfg.resources.pool
        qids = sorted(self.train_qrels)  # the order of TrainExample.qidx (build_examples)
        pos = self.positions
        gold = [[pos[d] for d, g in sorted(self.train_qrels[q].items()) if g > 0] for q in qids]
        queries = [self.data.queries[q] for q in qids]
        probe = make_probe(gold, queries, len(self.doc_ids), r.probe_queries, r.probe_passages, cfg.seed)
        if not negatives:  # the probe's queries are the first ones (make_probe)
            queries, gold = queries[: len(probe.queries)], gold[: len(probe.queries)]
        # The refresh's CPUs (resources.pool) are reserved in a placement group, so the trainer never gets them; the
        # service lives there (0 CPUs of its own) and the shards' round encodes share them, every core each
        self._reserved = reserve(pool)
        record_placement_group(cfg.output_dir, self._reserved)  # a stopped trial's reaper
        group = self.shard_group
        spec = RefreshSpec(
            r, cfg.retriever, resolved_index(cfg), MiningSpec.of(cfg.retriever.train), cfg.seed,
            threads=max(1, int(pool.cpus_per_actor * pool.num_actors) // group.n), fault=cfg.fault,
            folder=str(group.root),
        )  # fmt: skip
        corpus, texts = self.data.corpus, self.passages()
        sources = [
            corpus if isinstance(corpus, PassageStore) else [ray.put((self.doc_ids[a:b], list(texts[a:b])))]
            for a, b in shard_ranges(len(self.doc_ids), group.n)
        ]
        strategy = PlacementGroupSchedulingStrategy(self._reserved, placement_group_bundle_index=0)
        # @ray.remote made the class an actor class: mypy does not apply class decorators
        service = RefreshService.options(num_cpus=0, scheduling_strategy=strategy).remote(  # type: ignore[attr-defined]
            spec, group.actors, self.doc_ids, texts, sources, queries, gold, probe
        )
        ray.get(service.number_from.remote(first_version))
        stats = ray.get(service.publish.remote(step, built.index.tag, built.shards.folder, [ray.put(weights)]))
        if not stats.get("ok"):
            ray.kill(service)
            raise RuntimeError(f"the live index service could not publish version {first_version}: {stats}")
        return service, probe

    def stop_service(self, service) -> dict:
        """Wait for a running refresh, collect the service's refresh history, and release the refresh's CPUs."""
        import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

        ray.get(service.close.remote())
        report = ray.get(service.report.remote())
        ray.kill(service)
        # The reservation holds the pool's CPUs and custom resources (index_node on a cluster): the final index's
        # Ray Data encode actors ask for the same ones and would wait forever behind it (the 2-node test hung here).
        self.release()
        return report
