"""The joint stage: the index and its encoder checked -> (trained passages: the live refresh started) -> fit_joint
-> the refresh stopped, the store's final version mix recorded -> both models saved under <output_dir>/joint
-> (trained passages) the corpus re-encoded by the final encoder, saved as the run's index (<output_dir>/index).

Entry point for the pipeline: `run_joint_stage(cfg, data, retrieval, built, out_dir, logger)`, after the index
stage. Bad input (no index, an index of another encoder, no answers) fails in the pipeline's preflight, through
the generator stage's `preflight`, before any training.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import ray
from tabulate import tabulate

from ragtrain.cluster.resources import check_config
from ragtrain.config import Config
from ragtrain.config.joint import PassageEncoder
from ragtrain.data import RetrievalData
from ragtrain.generator.stage import PHASES, build_gen_data, resolve_index
from ragtrain.index.sharded import shard_gpu_claim
from ragtrain.index.vector_files import save_atomic
from ragtrain.joint import ENCODER_FILE, GENERATOR_FOLDER, JOINT_DIR
from ragtrain.joint.train import HISTORY_FILE, PREDICTIONS_FILE, JointData, fit_joint
from ragtrain.runtime.console import get_logger

log = get_logger(__name__)

REFRESH_FILE = "refresh_history.json"  # the live refresh's rounds and the store's final version mix


def final_mix(service: Any, shards: int) -> dict[str, int]:
    """What the index shards hold at the end: {encoder version: rows} summed over every shard (the store's own
    report, asked from each shard)."""
    mixes = ray.get(service.call_shards.remote(list(range(shards)), "live_mix", quick=True))
    total: dict[str, int] = {}
    for m in mixes:
        for v, c in m.items():
            total[str(v)] = total.get(str(v), 0) + int(c)
    return total


def save_final_index(
    cfg: Config, retrieval: Any, weights: dict[str, Any], out_dir: Path, logger: Any
) -> dict[str, float]:
    """The corpus encoded by the final encoder, evaluated and saved as the run's index (<out_dir>/index, replacing
    the pre-joint one): the live index's rows were refreshed by snapshots older than the last step (and may mix
    versions), and the folder's index must be the one the saved query encoder searches (`python -m ragtrain
    search`, `ask`). Its metadata names <out_dir>/joint/encoder.safetensors as its encoder."""
    name = f"{cfg.retriever.model}@{out_dir / JOINT_DIR / ENCODER_FILE}"
    built, metrics = retrieval.build_and_evaluate("trained", [weights], name, cfg.joint.max_steps)
    save_atomic(built.index, out_dir / "index")  # a temporary folder, renamed when complete
    if logger is not None:
        logger.log_json(asdict(built.index.meta), "index_meta.json")
    return metrics


def run_joint_stage(
    cfg: Config, data: RetrievalData, retrieval: Any, built: Any, out_dir: Path, logger: Any
) -> dict[str, dict[str, float]]:
    """Train both models jointly on the run's index; returns {"joint": summary, "joint_rag": {em, f1, ...}, ...}
    and writes <out_dir>/joint/ (encoder.safetensors, generator/ as an HF model folder, loss_history.json,
    predictions.json, metrics.json; with trained passages refresh_history.json, and <out_dir>/index replaced by the
    final encoder's index, evaluated as the `trained` phase)."""
    j = cfg.joint
    out = Path(out_dir) / JOINT_DIR
    gen = build_gen_data(cfg, data)
    # the index and the snapshot that built it, checked against each other (another encoder fails here)
    payload = resolve_index(cfg, data, built, Path(out_dir))
    if len(payload.weights) != 1:
        raise ValueError("joint training starts from one encoder; the index holds the consensus of several")
    trained = PassageEncoder(j.passage_encoder) == PassageEncoder.trained
    r = cfg.resources
    check_config(r, together=trained, trainer=True, shard_gpus=shard_gpu_claim(cfg.index))
    jd = JointData(gen, list(retrieval.doc_ids), retrieval.passages(), retrieval.positions)
    sink = logger.sink() if logger is not None else None
    service = probe = None
    report: dict[str, Any] = {}
    if trained:  # the shards refresh their rows from the trained encoder's snapshots while training steps
        service, probe = retrieval.start_service(built, payload.weights[0], negatives=False)
    else:
        retrieval.release()
    try:
        fit = fit_joint(cfg, jd, payload.weights[0], payload.index, sink, service, probe)
        if service is not None:
            report["final_mix"] = final_mix(service, retrieval.shard_group.n)
    finally:
        if service is not None:
            report.update(retrieval.stop_service(service))
    out.mkdir(parents=True, exist_ok=True)
    for name in (ENCODER_FILE, HISTORY_FILE, PREDICTIONS_FILE):
        shutil.copy2(fit.folder / name, out / name)
    shutil.copytree(fit.folder / GENERATOR_FOLDER, out / GENERATOR_FOLDER, dirs_exist_ok=True)
    m = fit.metrics
    results: dict[str, dict[str, float]] = {}
    # the jointly trained retriever on the evaluated split (the run's `trained` phase): with trained passages the
    # final encoder on both sides, the index saved in the folder; with frozen ones its query side over the run's index
    if trained:
        results["trained"] = save_final_index(cfg, retrieval, fit.weights, Path(out_dir), logger)
    elif built is not None:  # (stages [joint] on a saved index: searched by the generator's client only)
        results["trained"] = retrieval.evaluate(replace(built, snapshots=[fit.weights], _encoder=None))
    for mode in ("closed_book", "rag", "oracle"):
        if f"{mode}/em" in m:
            results[PHASES[mode].replace("gen_", "joint_")] = {
                k: m[f"{mode}/{k}"] for k in ("em", "f1", "n", "seconds", "gold_in_top_k") if f"{mode}/{k}" in m
            }
    results["joint"] = {
        "steps": float(j.max_steps),
        "wall_seconds": fit.seconds,
        **{k: v for k, v in m.items() if k.startswith(("train/", "index/"))},
    }
    if service is not None:
        mix = report["final_mix"]
        results["joint"]["index/final_version_count"] = float(len(mix))
        (out / REFRESH_FILE).write_text(json.dumps(report, indent=2))
    (out / "metrics.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    if logger is not None:
        if sink is not None:
            sink.log({f"run/{p}/{k}": v for p, r_ in results.items() for k, v in r_.items()}, step=j.max_steps)
        for name in ("metrics.json", PREDICTIONS_FILE) + ((REFRESH_FILE,) if service is not None else ()):
            logger.log_artifact(out / name, "joint")
    log.info(
        f"\n== joint: {j.loss}, passage encoder {PassageEncoder(j.passage_encoder).value}, top_k={j.top_k}, "
        f"{j.max_steps} steps in {fit.seconds:.1f}s =="
    )
    rows = [[p] + [res.get(k) for k in ("em", "f1", "gold_in_top_k")] for p, res in results.items() if "em" in res]
    if rows:
        log.info(tabulate(rows, headers=["phase", "em", "f1", "gold_in_top_k"], floatfmt=".4f"))
    return results
