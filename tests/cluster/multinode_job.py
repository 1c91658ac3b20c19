"""Run by the multi-node tests on the head of a 2-node Ray cluster (RAY_ADDRESS): prints one JSON line with what
it observed. The cluster (tests/cluster/conftest.py) is the emulated one, or two raylets on 127.0.0.1; either way
each node has 2 CPUs, `index_node` and a `trainer_slot`, and node 1 `pool_node` too (the labelled node).

Part "sync" trains the tiny retriever with sync=hierarchical, sync=hybrid_powersgd and sync=layerwise (top layer
every step, the rest every 2nd) on 4 workers spread over both nodes, and places an encoder pool on the node labelled
`pool_node`; part "refresh" runs the pipeline with live index refresh (2 trainer workers, the pool and its index
service on the labelled node); "distributed" the documents pipeline with a killed worker and then killed index
shards; "storage" the shared-path check.

Usage: multinode_job.py OUT PART, with RAY_ADDRESS set (and OUT in a folder every node sees).
"""

import json
import os
import sys
import tempfile

import ray
import torch

from ragtrain.cluster.resources import init_ray
from ragtrain.config import Config
from ragtrain.config.data import DataConfig
from ragtrain.config.logger import LoggerConfig
from ragtrain.config.resources import PoolResources, ResourcesConfig, TrainerResources
from ragtrain.config.retriever import RetrieverConfig, RetrieverTrainConfig
from ragtrain.data import make_synthetic
from ragtrain.retriever.batching import TrainData, build_examples
from tests.conftest import sync_config


def main(out_dir: str, part: str) -> None:
    """Join the cluster as `python -m ragtrain` does with RAY_ADDRESS (this checkout's ragtrain shipped to the
    workers), then run `part`."""
    assert os.environ.get("RAY_ADDRESS"), "run on a cluster: RAY_ADDRESS is its head"
    init_ray(ResourcesConfig())
    try:
        cfg = Config(
            data=DataConfig(num_entities=20),
            retriever=RetrieverConfig(
                model="tiny",
                query_max_length=16,
                passage_max_length=32,
                train=RetrieverTrainConfig(batch_size=2, max_steps=4, log_every=2, lr=1e-3),
            ),
            resources=ResourcesConfig(
                trainer=TrainerResources(num_workers=4, cpus_per_worker=1),
                pool=PoolResources(num_actors=1, cpus_per_actor=1, resources={"pool_node": 1}),
            ),
            logger=LoggerConfig(backend="none"),
            sync=sync_config("hierarchical", mixer={"period": 2}),
            output_dir=out_dir,
        )
        alive = [n for n in ray.nodes() if n["Alive"]]
        observed = {
            "labelled_node": next(n["NodeID"] for n in alive if "pool_node" in n["Resources"]),
            "nodes": sorted(n["NodeID"] for n in alive),
            "addresses": sorted(n["NodeManagerAddress"] for n in alive),
        }
        if part == "storage":
            observed.update(storage_part(out_dir, apart=len(set(observed["addresses"])) > 1))
        elif part == "distributed":
            observed.update(distributed_part(out_dir))
            observed.update(shard_kill_part(out_dir))
        elif part == "sync":
            data = make_synthetic(num_entities=20)
            pos = {d: i for i, d in enumerate(data.corpus)}
            texts = [p.full_text() for p in data.corpus.values()]
            observed.update(sync_part(cfg, TrainData(texts, build_examples(data.queries, data.train_qrels, pos))))
        else:
            observed.update(refresh_part(cfg, out_dir))
        print(json.dumps(observed))
    finally:
        ray.shutdown()


def storage_part(out_dir: str, apart: bool) -> dict:
    """check_shared_paths on both nodes: what the driver wrote and reads under OUT is seen; a folder only the
    driver's node has is named. On nodes apart that is a folder in the driver's own /tmp (it exists here, and no
    other node sees it); on one machine's raylets, which share every path, a path that no node has stands in."""
    from pathlib import Path

    from ragtrain.cluster.storage import check_shared_paths
    from ragtrain.runtime.errors import ConfigError

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    checked = check_shared_paths({"output_dir": out_dir}, {"data.root": str(Path(out_dir).parent)})
    only_here = tempfile.mkdtemp(prefix="ragtrain-driver-") if apart else str(Path(out_dir) / "only-on-the-driver")
    try:
        check_shared_paths({"output_dir": out_dir}, {"data.root": only_here})
        error = ""
    except ConfigError as e:
        error = str(e)
    left = sorted(p.name for p in Path(out_dir).iterdir())
    return {"looked_from": sorted(checked), "only_here": only_here, "error": error, "left": left}


def sync_part(cfg, train) -> dict:
    """hierarchical, hybrid_powersgd and layerwise on 4 workers over both nodes; where the live refresh's reserved
    CPUs (resources.pool) land."""
    import re
    from dataclasses import replace

    from ray.util.placement_group import placement_group_table, remove_placement_group

    from ragtrain.embed.model import build_encoder
    from ragtrain.index.refresh_service import reserve
    from ragtrain.retriever.train import fit_retriever

    out_dir = cfg.output_dir
    torch.manual_seed(0)
    weights = build_encoder(cfg.retriever).state_dict()
    fit = fit_retriever(cfg, train, weights, sink=None)
    n_params = sum(v.numel() for v in weights.values())

    # the same cluster, the new compositions: intra-node all-reduce + inter-node PowerSGD (rank 4 from step 2);
    # layer-wise: the tiny model's top layer (layer 1 of 2) every step, the rest averaged every 2nd step
    hybrid = fit_retriever(
        replace(
            cfg,
            sync=sync_config("hybrid_powersgd", reducer={"start_iter": 2}),
            output_dir=os.path.join(out_dir, "hybrid"),
        ),
        train,
        weights,
        sink=None,
    )
    top = [r"\.layer\.1\."]
    layerwise = fit_retriever(
        replace(
            cfg,
            sync=sync_config("layerwise", scope={"reducer_params": top}, mixer={"period": 2}),
            output_dir=os.path.join(out_dir, "layerwise"),
        ),
        train,
        weights,
        sink=None,
    )
    n_top = sum(v.numel() for k, v in weights.items() if re.search(top[0], k))
    shapes = [list(v.shape) for v in weights.values()]

    reserved = reserve(cfg.resources.pool)
    pool_nodes = sorted(set(placement_group_table(reserved)["bundles_to_node_id"].values()))
    remove_placement_group(reserved)
    return {
        "metrics": fit.metrics,
        "hybrid": hybrid.metrics,
        "layerwise": layerwise.metrics,
        "n_params": n_params,
        "n_top": n_top,
        "shapes": shapes,
        "pool_nodes": pool_nodes,
    }


def refresh_part(cfg, out_dir: str) -> dict:
    """The pipeline with live refresh: 2 trainer workers; the refresh's reservation and its service on the labelled
    node."""
    from dataclasses import replace

    from ragtrain.config.index import RefreshConfig
    from ragtrain.config.resources import TrainerResources
    from ragtrain.config.sync import SyncConfig
    from ragtrain.pipeline.stages import run

    live = replace(
        cfg,
        retriever=replace(
            cfg.retriever, train=replace(cfg.retriever.train, max_steps=12, hard_negatives=1, hard_negative_depth=8)
        ),
        resources=replace(cfg.resources, trainer=TrainerResources(num_workers=2, cpus_per_worker=1)),
        sync=SyncConfig(),
        refresh=RefreshConfig(enabled=True, every_steps=3, check_every=3, probe_passages=16, probe_queries=4),
        output_dir=os.path.join(out_dir, "live"),
    )
    results = run(live)
    history = json.load(open(os.path.join(out_dir, "live", "refresh_history.json")))["history"]
    return {"refresh_nodes": sorted({h["node"] for h in history}), "refreshes": results["train"]["index/refreshes"]}


def distributed_part(out_dir: str) -> dict:
    """docs_quickstart made small (12 generated documents, chunked; the tiny encoder) on the 2 nodes, with a live index
    refresh on the labelled node while 2 trainer workers train (one per node: each takes its node's `trainer_slot`),
    and trainer rank 1 killed at step 3: Ray Train restarts the worker group from the step-2 checkpoint and training
    finishes its 4 steps. MLflow logs to a SQLite store given relative to the driver's working folder, which is not
    the raylets' (rank 0 logs from its node)."""
    from mlflow.tracking import MlflowClient  # lazy: mlflow's import takes ~1 s, and only this part reads a store

    from ragtrain.config import to_typed
    from ragtrain.pipeline.stages import run
    from tests.conftest import compose

    out = os.path.join(out_dir, "docs")
    os.makedirs(out_dir, exist_ok=True)
    os.chdir(out_dir)  # as a user's driver runs from a folder of theirs; the raylets started elsewhere
    cfg = to_typed(
        compose(
            [
                "experiment=docs_quickstart",
                "retriever=tiny",
                "data.num_entities=12",
                "data.chunk.max_tokens=32",
                "data.chunk.overlap=8",
                "retriever.passage_max_length=34",
                "retriever.train.max_steps=4",
                "retriever.train.batch_size=4",
                "retriever.train.log_every=2",
                "retriever.train.hard_negatives=1",
                "retriever.train.hard_negative_depth=8",
                "resources.num_cpus=null",
                "resources.trainer.num_workers=2",
                "resources.trainer.cpus_per_worker=1",
                "resources.pool.num_actors=1",
                "resources.pool.cpus_per_actor=1",
                "+resources.pool.resources.pool_node=0.5",
                "+resources.trainer.resources.trainer_slot=1",  # one per node: the gradients cross the link
                "refresh.enabled=true",
                "refresh.every_steps=2",
                "refresh.check_every=2",
                "refresh.probe_passages=16",
                "refresh.probe_queries=4",
                "refresh.search_probe=3",
                "index.shards=auto",  # one shard per index node: each refreshes half its rows, searched as they land
                "refresh.consistency=eager",
                "refresh.fraction=0.5",
                "checkpoint.every_steps=2",
                "fault.max_failures=1",
                "fault.kill_worker_at_step=3",
                "fault.kill_rank=1",
                "logger=mlflow",
                "logger.tracking_uri=sqlite:///mlflow/mlflow.db",
                "export=false",
                f"output_dir={out}",
            ]
        )
    )
    results = run(cfg)
    history = json.load(open(os.path.join(out, "refresh_history.json")))["history"]
    store = os.path.join(out_dir, "mlflow", "mlflow.db")
    run_id = open(os.path.join(out, "mlflow_run_id")).read().strip()
    losses = MlflowClient(f"sqlite:///{store}").get_metric_history(run_id, "train/loss") if run_id else []
    train = results["train"]
    global_batch = cfg.retriever.train.batch_size * cfg.resources.trainer.num_workers
    return {
        "refresh_nodes": sorted({h["node"] for h in history}),
        "refresh_metrics": [h["metrics"] for h in history],
        "refreshes": train["index/refreshes"],
        "snapshot_mb": train["index/snapshot_mb"],
        "killed": os.path.exists(os.path.join(out, "ray", ".fault_injected_retriever_rank1_step3")),
        "steps": train["steps"],
        "chunks": len(run_doc_of(out)),
        "ndcg": {k: results[k]["ndcg@10"] for k in ("zeroshot", "trained")},
        "loss_steps": sorted({m.step for m in losses}),  # what rank 0 logged into the store
        "grad_bytes_per_step": train["comm/bytes_per_step/grad"],
        # gradients in flight per step: time share x step seconds (global batch / samples per second)
        "comm_s_per_step": train["comm/time_share"] * global_batch / train["train/samples_per_s"],
    }


def shard_kill_part(out_dir: str) -> dict:
    """Index shards on the same 2 nodes: `auto` places one per index node; shard 1's process is killed while a
    search is in flight, and the search still returns the same answer (the shard restarts on its node from its
    persisted build)."""
    import signal
    import time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import numpy as np

    from ragtrain.config.index import IndexConfig
    from ragtrain.config.resources import PoolResources
    from ragtrain.index.sharded import SEARCH_BATCH, ShardGroup, resolve_shards
    from tests.index.test_vector_files import _vectors, _write_vectors

    out = Path(out_dir)
    x = _vectors(300)
    shards = _write_vectors(out / "vec", [f"d{i}" for i in range(300)], x, per_file=50)
    n = resolve_shards("auto", shards.rows, ray.nodes())
    group = ShardGroup(n, out / "shards", PoolResources(num_actors=1), timeout_s=60.0)
    index = group.build("t", shards, IndexConfig(), "fp", "enc", 0, seed=0)
    before = group.info()
    q = _vectors(8 * SEARCH_BATCH, seed=1)
    want = index.search(q, 10)
    exact = np.argsort(-(q[:50] @ x.T), axis=1, kind="stable")[:, :10]
    with ThreadPoolExecutor(1) as pool:
        searching = pool.submit(index.search, q, 10)
        time.sleep(0.05)
        # shard 1's process, on the other node: the emulated nodes share the host's process ids (their own network,
        # mount and host-name namespaces only), as one machine's raylets do
        os.kill(before[1]["pid"], signal.SIGKILL)
        got = searching.result()
    after = group.info()
    group.close()
    return {
        "shards": n,
        "shard_nodes": [i["node"] for i in before],
        "restarted_node": after[1]["node"],
        "pids_changed": [a["pid"] != b["pid"] for a, b in zip(after, before)],
        "restored": after[1]["restored"],
        "same_after_kill": bool((got[1] == want[1]).all() and (got[0] == want[0]).all()),
        "exact": bool((want[1][:50] == exact).all()),
    }


def run_doc_of(out: str) -> dict:
    """The run's chunk -> document map (its store holds chunks of the generated documents)."""
    from ragtrain.data.store import PassageStore

    store = PassageStore(os.path.join(out, "corpus", "passages.arrow"))
    return {p.id: p.doc_id for p in store.values() if p.doc_id}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
