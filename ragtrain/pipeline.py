"""run(cfg): load data -> (zero-shot index + eval) -> retriever training -> index build + eval -> MLflow summary."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from omegaconf import OmegaConf

from ragtrain.config import Config, DataConfig, DataSource, RetrieverConfig, to_flat_dict
from ragtrain.corpus.dataset import passage_qrels
from ragtrain.data import RetrievalData, load_beir, make_synthetic
from ragtrain.eval.retrieval import evaluate, maxp_run, run_from_scores

# Chunked corpora: retrieve this many passages per wanted document, so MaxP still leaves index.top_k documents
MAXP_DEPTH_FACTOR = 10


def load_data(cfg: DataConfig, retriever: Optional[RetrieverConfig] = None,
              out_dir: Optional[Path] = None) -> RetrievalData:
    """The configured dataset: the synthetic KB, a BEIR folder or a documents folder, chunked when configured.

    `retriever` (its tokenizer) is needed for data.chunk.enabled; `out_dir` receives the generated documents
    (data.generate=true; a temporary folder when None).
    """
    from ragtrain.corpus.dataset import check_chunk_budget, check_corpus_ids, chunk_data, load_documents

    if cfg.source == DataSource.synthetic:
        return make_synthetic(num_entities=cfg.num_entities, seed=cfg.seed, split=cfg.split)
    if cfg.chunk.enabled:  # a chunk the encoder would truncate is a config error: check before reading anything
        if retriever is None:
            raise ValueError("load_data: data.chunk.enabled needs the retriever config (its tokenizer)")
        from ragtrain.retriever.encoder import load_tokenizer

        tokenizer = load_tokenizer(retriever)
        check_chunk_budget(cfg.chunk.max_tokens, tokenizer.model_max_length, retriever.passage_max_length)
    if cfg.source == DataSource.beir:
        assert cfg.root is not None  # checked by DataConfig
        data = load_beir(cfg.root, split=cfg.split, dev_size=cfg.dev_size, seed=cfg.seed)
        check_corpus_ids(data, cfg.root)
    else:
        root = cfg.root
        if cfg.generate:  # data.generate=true: ragtrain's own article folder, written deterministically
            import tempfile

            from ragtrain.corpus.docs_synthetic import write_docs_synthetic

            root = str(Path(out_dir or tempfile.mkdtemp(prefix="ragtrain-docs-")) / "docs")
            write_docs_synthetic(root, num_entities=cfg.num_entities, seed=cfg.seed)
        assert root is not None  # checked by DataConfig
        data, _ = load_documents(root, cfg.glob, cfg.on_error.value, cfg.split, cfg.dev_size, cfg.seed)
    if cfg.chunk.enabled:
        n_docs = len(data.corpus)
        data = chunk_data(data, tokenizer, cfg.chunk.max_tokens, cfg.chunk.overlap)
        print(f"[data] {n_docs} documents -> {len(data.corpus)} chunks of <= {cfg.chunk.max_tokens} tokens "
              f"(overlap {cfg.chunk.overlap})")
    return data


def prepare_output_dir(path: str) -> Path:
    """Create the run's output folder, failing early (before any work) if it cannot be written."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise PermissionError(f"output_dir={str(out)!r} is not writable ({e.strerror}): choose another output_dir") from None
    return out


class Retrieval:
    """Builds indexes with the actor pool and evaluates them on the configured split."""

    def __init__(self, cfg: Config, data: RetrievalData):
        self.cfg, self.data = cfg, data
        self._pool = None
        self.snapshots: list[tuple[str, dict[str, torch.Tensor]]] = []
        self.doc_ids = list(data.corpus)
        self.passages = [p.full_text() for p in data.corpus.values()]
        self.fingerprint = data.fingerprint()
        # Training and mining work on passages: with chunks, every chunk of a judged document carries its grade
        self.train_qrels = passage_qrels(data.train_qrels, data.doc_of)
        self.shards = None  # the last build's vector shards on disk (ragtrain.corpus.encode.ShardSet)
        self._vectors: Optional[np.ndarray] = None  # its vectors, read from the shards only when a feature needs them
        self._local: dict = {}  # snapshot version -> LocalEncoder: queries are encoded in the driver, same function

    @property
    def vectors(self) -> Optional[np.ndarray]:
        """The last build's passage vectors in corpus order. Read from its shards on first use: only the live index
        service's version 0, stale-index alignment and vector_avg/distill need the whole matrix in the driver."""
        if self._vectors is None and self.shards is not None:
            self._vectors = self.shards.read_all(order=self.doc_ids)[1]
        return self._vectors

    @vectors.setter
    def vectors(self, value: Optional[np.ndarray]) -> None:
        self._vectors = value

    @property
    def pool(self):
        """The encoder actor pool of the live index service (refresh.enabled), started on first use."""
        from ragtrain.index.pool import EncoderPool

    
        if self._pool is None:
            from ragtrain.cluster.resources import record_placement_group

            self._pool = EncoderPool(self.cfg.retriever, self.cfg.resources.pool)
            self._pool.fault_shard = self.cfg.fault.kill_pool_actor_at_shard  # fault injection (tests)
            record_placement_group(self.cfg.output_dir, self._pool.placement_group)  # a stopped trial's reaper
        return self._pool

    def release(self) -> None:
        """Stop the pool so its CPUs go back to the cluster (the trainer needs them on a small machine)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def build(self, tag: str, snapshots: list[dict[str, torch.Tensor]], encoder_name: str, step: int):
        """Encode the corpus on Ray Data into vector shards and build the FAISS index from them (returns index, stats).

        One snapshot: its vectors. Several (sync=vector_avg: one per replica): every replica encodes every
        passage and the index holds the re-normalised mean vector; queries are averaged the same way.
        """
        import ray

        from ragtrain.corpus.encode import EncodeFault, encode_to_shards, encoder_dim
        from ragtrain.index.faiss_index import build_configured
        from ragtrain.index.shards import build_configured_from_shards, check_index_config
        from ragtrain.sync.vector_avg import consensus_vectors

        cfg, idx = self.cfg, self.cfg.index
        # A factory FAISS rejects, or more IVF lists than passages: fail before encoding anything
        check_index_config(idx.factory, encoder_dim(cfg.retriever), len(self.doc_ids))
        self.snapshots = [(f"{tag}/{i}", w) for i, w in enumerate(snapshots)]
        self._local, self._vectors = {}, None
        vec_dir = Path(cfg.output_dir).resolve() / "vectors"
        fault = None
        if cfg.fault.kill_encode_actor_at_batch >= 0:  # fault injection (tests): one encode actor dies, once per run
            vec_dir.mkdir(parents=True, exist_ok=True)
            fault = EncodeFault(cfg.fault.kill_encode_actor_at_batch, str(vec_dir / ".encode_actor_killed"))
        sets = []
        for i, (_, weights) in enumerate(self.snapshots):
            print(f"[{tag}] encoding {len(self.doc_ids)} passages on Ray Data ({cfg.resources.pool.num_actors} actors)")
            sets.append(encode_to_shards(
                (self.doc_ids, self.passages), ray.put(weights), cfg.retriever, idx, cfg.resources.pool,
                vec_dir / (tag if len(self.snapshots) == 1 else f"{tag}_{i}"), vector_dtype=idx.vector_dtype,
                fault=fault, num_gpus_per_actor=cfg.resources.pool.gpus_per_actor))
        seconds = sum(s.seconds for s in sets)
        if len(sets) == 1:  # FAISS from the shards: the driver never holds the vector matrix
            self.shards = sets[0]
            index = build_configured_from_shards(sets[0], idx, self.fingerprint, encoder_name, step, cfg.seed)
        else:
            self.shards = None
            self._vectors = consensus_vectors([s.read_all(order=self.doc_ids)[1] for s in sets])
            index = build_configured(self._vectors, self.doc_ids, idx, self.fingerprint, encoder_name, step, cfg.seed)
        stats = {"docs": len(self.doc_ids), "seconds": seconds, "docs_per_s": len(self.doc_ids) * len(sets) / seconds,
                 "index_build_seconds": index.meta.build_seconds}
        return index, stats

    def start_service(self, weights: dict[str, torch.Tensor]):
        """Start the live index service on the pool (refresh.enabled) with version 0 = the last built index's
        vectors, encoded with `weights`; returns (service actor, staleness probe)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ragtrain.index.refresh import IndexService, make_probe

        r = self.cfg.refresh
        qids = sorted(self.train_qrels)  # the order of TrainExample.qidx (build_examples)
        pos = {d: i for i, d in enumerate(self.doc_ids)}
        gold = [[pos[d] for d, g in sorted(self.train_qrels[q].items()) if g > 0] for q in qids]
        queries = [self.data.queries[q] for q in qids]
        probe = make_probe(gold, queries, len(self.doc_ids), r.probe_queries, r.probe_passages, self.cfg.seed)
        # The service builds FAISS indexes: it lives in the pool's placement group (0 CPUs of its own, on the
        # pool's node), so index work never takes the trainer's CPUs.
        strategy = PlacementGroupSchedulingStrategy(self.pool.placement_group, placement_group_bundle_index=0)
        service = IndexService.options(num_cpus=0, scheduling_strategy=strategy).remote(
            self.cfg, self.pool, self.passages, self.doc_ids, self.fingerprint, queries, gold, probe
        )
        stats = ray.get(service.publish.remote(0, self.vectors, [ray.put(weights)]))
        if not stats.get("ok"):
            ray.kill(service)
            raise RuntimeError(f"the live index service could not publish version 0: {stats}")
        return service, probe

    def stop_service(self, service) -> dict:
        """Wait for a running refresh, collect the service's refresh history, and release the pool."""
        import ray

        ray.get(service.close.remote())
        report = ray.get(service.report.remote())
        ray.kill(service)
        # The pool serves only the live refresh. Its placement group holds the pool's CPUs and custom resources
        # (index_node on a cluster): the final index's Ray Data encode actors ask for the same ones and would wait
        # forever behind it (the 2-node test hung here).
        self.release()
        return report

    def encode(self, texts: list[str], max_length: int, desc: str = "", progress: bool = True) -> tuple[np.ndarray, dict]:
        """Vectors of a few `texts` (queries) under the current snapshots (their re-normalised mean when there are
        several), encoded in the driver by the corpus actors' own class (`LocalEncoder` = `EncodeBatch.encode`)."""
        import time

        from ragtrain.corpus.encode import LocalEncoder
        from ragtrain.sync.vector_avg import consensus_vectors

        assert self.snapshots, "build() sets the snapshots first"
        start = time.perf_counter()
        per_snapshot = []
        for version, weights in self.snapshots:
            if version not in self._local:
                self._local[version] = LocalEncoder(self.cfg.retriever, weights, self.cfg.index)
            per_snapshot.append(self._local[version].encode(texts, max_length))
        seconds = time.perf_counter() - start
        return consensus_vectors(per_snapshot), {"docs": len(texts), "seconds": seconds,
                                                 "docs_per_s": len(texts) / max(seconds, 1e-9)}

    def search(self, index, qids: list[str], k: int) -> dict[str, list[str]]:
        """Encode queries like the index's passages and retrieve the top-k doc ids for each."""
        texts = [self.data.queries[q] for q in qids]
        qv, _ = self.encode(texts, self.cfg.retriever.query_max_length, progress=False)
        _, rows = index.search(qv, k)
        return run_from_scores(qids, index.doc_ids, rows)  # the index's row order (shard order)

    def build_and_evaluate(self, tag: str, snapshots: list[dict[str, torch.Tensor]], encoder_name: str, step: int):
        """`build`, then `evaluate` on the split; returns (index, metrics incl. the pool's encode docs/s)."""
        index, stats = self.build(tag, snapshots, encoder_name, step)
        return index, {**self.evaluate(index), "encode_docs_per_s": stats["docs_per_s"]}

    def evaluate_stale(self, stale: np.ndarray, step: int) -> dict[str, dict[str, float]]:
        """The stale (zero-shot) index searched with the trained query encoder, as is and after an orthogonal map
        onto the trained space fitted on `index.align_anchors` anchor passages (call right after the trained
        build: its vectors are the reference). Returns {"stale": ..., "stale_aligned": ...}."""
        from ragtrain.index.faiss_index import build_configured
        from ragtrain.repair.align import embedding_drift, fit_alignment

        fresh, idx = self.vectors, self.cfg.index
        rows = np.random.default_rng(self.cfg.seed).permutation(len(fresh))[: idx.align_anchors]
        # Only the anchors need the trained encoder's vectors; they are rows of the trained build here.
        aligned = fit_alignment(stale[rows], fresh[rows], "orthogonal").apply(stale)
        out = {}
        for tag, vecs in (("stale", stale), ("stale_aligned", aligned)):
            index = build_configured(vecs, self.doc_ids, idx, self.fingerprint, tag, step, self.cfg.seed)
            out[tag] = {**self.evaluate(index), "drift_vs_trained": embedding_drift(vecs, fresh),
                        "anchors": float(len(rows))}
        return out

    def evaluate(self, index) -> dict[str, float]:
        """Retrieval metrics of `index` on the evaluated split."""
        qids = sorted(self.data.eval_qrels)
        k = self.cfg.index.top_k
        if not self.data.doc_of:
            return evaluate(self.search(index, qids, k), self.data.eval_qrels)
        # Chunks: MaxP (a document ranks at its best chunk) before the cut-offs, so qrels stay on documents
        run = self.search(index, qids, min(len(self.doc_ids), k * MAXP_DEPTH_FACTOR))
        return evaluate(maxp_run(run, self.data.doc_of, depth=k), self.data.eval_qrels)

    def mine_negatives(self, index) -> dict[str, list[int]]:
        """Hard-negative candidates for each training query: top ranks minus gold, minus the top skipped ones,
        minus those above the margin / score ceiling (the one rule: ragtrain/index/mining.py)."""
        from ragtrain.index.mining import mine_rows

        t = self.cfg.retriever.train
        qids = sorted(self.train_qrels)
        qv, _ = self.encode([self.data.queries[q] for q in qids], self.cfg.retriever.query_max_length, progress=False)
        row = {d: i for i, d in enumerate(index.doc_ids)}  # the index's row order (shard order)
        pos = {d: i for i, d in enumerate(self.doc_ids)}
        # all chunks of a gold document are gold
        gold = [[row[d] for d, g in self.train_qrels[q].items() if g > 0 and d in row] for q in qids]
        # the margin scores each query's positive from the stored vectors (corpus order -> index rows)
        vecs = None
        if t.hard_negative_margin is not None:
            vecs = self.vectors[[pos[d] for d in index.doc_ids]]
        mined = mine_rows(index, qv, gold, t.hard_negative_depth, t.hard_negative_skip_top, t.hard_negative_margin,
                          t.hard_negative_max_score, vecs)
        return {q: [pos[index.doc_ids[r]] for r in rows] for q, rows in zip(qids, mined)}


def parameter_mean(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of several replicas' weights (non-float entries are taken from the first)."""
    return {
        k: torch.stack([s[k] for s in states]).mean(0) if states[0][k].is_floating_point() else states[0][k]
        for k in states[0]
    }


def summary_table(results: dict[str, dict[str, float]]) -> str:
    """Metrics side by side per phase (zero-shot, trained, ...), with trained - zero-shot."""
    from tabulate import tabulate

    phases = [p for p in results if p != "train" and not p.startswith("gen_")]  # retrieval phases only
    if not phases:
        return "(no retrieval phases)"
    keys = [k for k in results[phases[0]] if "@" in k]
    change = "zeroshot" in results and "trained" in results
    rows = []
    for k in keys:
        row = [k] + [results[p].get(k, float("nan")) for p in phases]
        if change:
            row.append(results["trained"].get(k, float("nan")) - results["zeroshot"].get(k, float("nan")))
        rows.append(row)
    headers = ["metric"] + phases + (["trained - zeroshot"] if change else [])
    return tabulate(rows, headers=headers, floatfmt=".4f")


def run(
    cfg: Config, *, train_callbacks: Optional[list] = None, report_intermediate: bool = False,
    parent_run_id: Optional[str] = None,
) -> dict[str, dict[str, float]]:
    """Run the configured stages end to end; returns {phase: metrics}.

    A Tune trial passes `train_callbacks` (TuneReportCallback), `report_intermediate=True` (ray.train.report at
    every log window, so schedulers see learning curves) and its sweep's `parent_run_id` (MLflow child run).
    """
    from ragtrain.cluster.resources import check_config, init_ray
    from ragtrain.retriever.batching import TrainData, build_examples
    from ragtrain.retriever.encoder import build_encoder
    from ragtrain.index.shards import save_atomic
    from ragtrain.retriever.train import fit_retriever, save_weights
    from ragtrain.track.mlflow import RunLogger

    out = prepare_output_dir(cfg.output_dir)  # an unwritable folder fails before any work
    if cfg.resume and not (out / "config.yaml").exists():
        raise FileNotFoundError(f"resume=true but output_dir={str(out)!r} holds no earlier run (no config.yaml): "
                                "point output_dir at the interrupted run's folder")
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))  # the resolved, typed config
    data = load_data(cfg.data, cfg.retriever, out)  # bad data fails here, before Ray or MLflow start
    if "generator" in cfg.stages:  # no answers, a missing or mismatched saved index: fail before any training
        from ragtrain.generator.stage import preflight

        preflight(cfg, data, out)
    print(f"[data] {data.name}: {len(data.corpus)} passages, {len(data.train_qrels)} train queries, "
          f"{len(data.eval_qrels)} {data.split} queries")
    init_ray(cfg.resources)
    # Infeasible requests fail in seconds, not as a pending hang; with live refresh the trainer and the pool run at
    # the same time, so they must fit the cluster together.
    check_config(cfg.resources, together="retriever" in cfg.stages and cfg.refresh.enabled)

    run_file = out / "mlflow_run_id"  # resume=true continues this run's MLflow run
    resume_id = run_file.read_text().strip() if cfg.resume and run_file.exists() else None
    logger = RunLogger(cfg.logger, run_name=cfg.experiment_name, parent_run_id=parent_run_id, run_id=resume_id)
    if logger.enabled:
        run_file.write_text(logger.run_id or "")
    if logger.enabled and os.environ.get("RAY_ADDRESS") and logger.uri.startswith(("sqlite:", "file:")):
        print(f"warning: RAY_ADDRESS is set but MLflow logs to a local store ({logger.uri}); rank 0 may run on "
              "another node: set logger.tracking_uri (or MLFLOW_TRACKING_URI) to an MLflow server")
    status = "FAILED"
    cleanup: list = []
    try:
        if resume_id is None:  # a resumed run keeps the params it was started with
            logger.log_params(to_flat_dict(cfg))
        logger.log_artifact(out / "config.yaml")
        torch.manual_seed(cfg.seed)  # the tiny encoder's init; pretrained weights ignore it
        encoder = build_encoder(cfg.retriever)
        weights = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
        encoder_name, step = f"{cfg.retriever.model}@init", 0
        del encoder

        retrieval = Retrieval(cfg, data)
        cleanup.append(retrieval.release)
        results: dict[str, dict[str, float]] = {}
        train = "retriever" in cfg.stages
        live = train and cfg.refresh.enabled  # the pool refreshes the index while training steps
        needs_negatives = train and cfg.retriever.train.hard_negatives > 0
        negatives: Optional[dict[str, list[int]]] = None
        if train and (cfg.zeroshot_eval or needs_negatives or live):
            index, results["zeroshot"] = retrieval.build_and_evaluate("zeroshot", [weights], encoder_name, step)
            if needs_negatives and not live:  # static negatives, mined once from the zero-shot index
                negatives = retrieval.mine_negatives(index)
        elif train and cfg.index.align_anchors:  # zeroshot_eval=false (e.g. sync_compare's later variants):
            retrieval.build("zeroshot", [weights], encoder_name, step)  # the stale vectors still, not evaluated
        stale = retrieval.vectors if train and cfg.index.align_anchors else None

        if train:
            pos = {d: i for i, d in enumerate(retrieval.doc_ids)}
            service = probe = None
            if live:
                service, probe = retrieval.start_service(weights)
            else:
                retrieval.release()  # without refresh the trainer and the pool take turns on the CPUs
            examples = build_examples(data.queries, retrieval.train_qrels, pos, negatives)
            try:
                sink = logger.sink()
                if sink is not None and cfg.resume:
                    sink.skip_logged = True  # steps before the interruption are already in the run
                fit = fit_retriever(
                    cfg, TrainData(retrieval.passages, examples), weights, sink, resume=cfg.resume,
                    callbacks=train_callbacks, report_intermediate=report_intermediate,
                    index_service=service, probe=probe,
                )
            finally:
                refresh_report = retrieval.stop_service(service) if service is not None else None
            if refresh_report is not None:
                (out / "refresh_history.json").write_text(json.dumps(refresh_report, indent=2))
                logger.log_artifact(out / "refresh_history.json")
            weights, step = fit.weights, fit.steps
            (out / "encoder").mkdir(exist_ok=True)
            if fit.replicas:  # vector_avg: the saved encoder is the parameter mean; replicas go next to it
                weights = parameter_mean(fit.replicas)
                for r, state in enumerate(fit.replicas):
                    save_weights(state, out / "encoder", name=f"replica_{r}")
            save_weights_path = save_weights(weights, out / "encoder")
            encoder_name = f"{cfg.retriever.model}@{save_weights_path}"
            print(f"[retriever] {fit.steps} steps in {fit.seconds:.1f}s; weights: {save_weights_path}")
            results["train"] = {"seconds": fit.seconds, "steps": fit.steps, **fit.metrics}

        index = None
        if "index" in cfg.stages:
            phase = "trained" if train else "zeroshot"
            replicas = fit.replicas if train else []
            if replicas:  # vector_avg: first the parameter mean, for comparison; then the mean of the vectors
                _, results["param_avg"] = retrieval.build_and_evaluate("param_avg", [weights], encoder_name, step)
                param_vecs = retrieval.vectors
            name = f"vector_avg of {len(replicas)} replicas in {out / 'encoder'}" if replicas else encoder_name
            index, results[phase] = retrieval.build_and_evaluate(phase, replicas or [weights], name, step)
            if replicas:
                from ragtrain.repair.align import embedding_drift

                results["param_avg"]["drift_vs_consensus"] = embedding_drift(param_vecs, retrieval.vectors)
            if replicas and cfg.index.distill_steps:  # one student encoder that serves the consensus index
                from ragtrain.repair.distill import distill_consensus

                kept = index, retrieval.vectors, retrieval.snapshots
                _, results["distilled"] = distill_consensus(retrieval, weights, step)
                index, retrieval.vectors, retrieval.snapshots = kept  # the run's index stays the consensus one
            if stale is not None and not replicas:  # align the stale index instead of re-encoding it: how close?
                results.update(retrieval.evaluate_stale(stale, step))
            save_atomic(index, out / "index")  # a temporary folder, renamed when complete
            logger.log_json(asdict(index.meta), "index_meta.json")

        if "generator" in cfg.stages:  # retrieves with this run's index, or the saved one (stages: [generator])
            from ragtrain.generator.stage import run_generator_stage

            built = index is not None
            results.update(run_generator_stage(cfg, data, retrieval if built else None, index, out, logger))

        (out / "metrics.json").write_text(json.dumps(results, indent=2, sort_keys=True))
        logger.log_artifact(out / "metrics.json")
        for phase, m in results.items():  # zero-shot at step 0, the trained encoder at its last step
            if phase.startswith("gen_"):
                continue  # the generator stage logged its own, at its own steps
            prefix = "run/" if phase == "train" else f"{phase}/"  # run summary: run/train/samples_per_s, ...
            sink = logger.sink()
            if sink is not None:
                sink.skip_logged = cfg.resume  # a resumed run already holds the phases finished before
                sink.log({prefix + k: v for k, v in m.items()}, step=0 if phase == "zeroshot" else step)
        if cfg.export and ({"retriever", "index"} & set(cfg.stages) or "generator" in cfg.stages):
            from ragtrain.export import export_run  # <output_dir>/export: sentence-transformers + HF folders

            encoded = bool({"retriever", "index"} & set(cfg.stages))  # this run trained or indexed with `weights`
            export_run(cfg, weights if encoded else None, out, f"{data.name}: {len(data.corpus)} passages, "
                       f"{len(data.train_qrels)} training queries, evaluated on {len(data.eval_qrels)} {data.split} "
                       "queries", summary_table(results), logger)
        print(f"\n== {cfg.experiment_name}: {data.name} split={data.split} index={cfg.index.factory} ==")
        print(summary_table(results))
        if "train" in results:
            t = results["train"]
            print(f"training: {t['steps']:.0f} steps, {t['train/samples_per_s']:.1f} samples/s, "
                  f"{t['comm/bytes_per_step'] / 1e6:.2f} MB sent/step/worker, comm time share {t['comm/time_share']:.2f}")
        print(f"outputs: {out.resolve()}" + (f"\nmlflow: {logger.uri} run {logger.run_id}" if logger.enabled else ""))
        status = "FINISHED"
        return results
    finally:
        for fn in cleanup:
            fn()
        logger.end(status)

