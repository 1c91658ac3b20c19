"""The joint stage: the index and its encoder checked -> (trained passages: the live refresh started) -> fit_joint
-> the refresh stopped, the store's final version mix recorded -> both models saved under <output_dir>/joint
-> (trained passages) the corpus re-encoded by the final encoder, saved as the run's index (<output_dir>/index),
and RAG scored on it: every figure of the run comes from the index it ships.

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
from ragtrain.eval.per_question import PER_QUESTION_FILE, write_per_question
from ragtrain.generator.stage import PHASES, build_gen_data, likelihood_line, likelihood_results, resolve_index
from ragtrain.index.sharded import shard_gpu_claim
from ragtrain.index.vector_files import save_atomic
from ragtrain.joint import ENCODER_FILE, GENERATOR_FOLDER, JOINT_DIR
from ragtrain.joint.evaluate import fit_shipped_rag
from ragtrain.joint.train import HISTORY_FILE, LIVE, PREDICTIONS_FILE, JointData, checkpoint_encoder, fit_joint
from ragtrain.runtime.console import get_logger
from ragtrain.train.harness import resume_or_none

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
) -> tuple[Any, dict[str, float]]:
    """The corpus encoded by the final encoder, evaluated and saved as the run's index (<out_dir>/index, replacing
    the pre-joint one): the live index's rows were refreshed by snapshots older than the last step (and may mix
    versions), and the folder's index must be the one the saved query encoder searches (`ragtrain.commands.search`,
    `ragtrain.commands.ask`). Its metadata names <out_dir>/joint/encoder.safetensors as its encoder. Returns (the build,
    still held by the index shards for the RAG evaluation on it; its retrieval metrics)."""
    name = f"{cfg.retriever.model}@{out_dir / JOINT_DIR / ENCODER_FILE}"
    built, metrics = retrieval.build_and_evaluate("trained", [weights], name, cfg.joint.max_steps)
    save_atomic(built.index, out_dir / "index")  # a temporary folder, renamed when complete
    if logger is not None:
        logger.log_json(asdict(built.index.meta), "index_meta.json")
    return built, metrics


def start_live_index(cfg: Config, retrieval: Any, built: Any, weights: dict[str, Any]) -> tuple[Any, Any]:
    """The live refresh on the run's index; for a run resumed from a joint checkpoint, on an index of the
    checkpoint's encoder, its versions numbered on from the checkpoint's newest (as the retriever stage's live
    index: neither restarted from the untrained encoder nor repeating version numbers it logged)."""
    path, meta = resume_or_none(cfg, "joint")
    if path is None or meta.get("final"):  # a fresh run, or the stage finished before (it is not trained again)
        return retrieval.start_service(built, weights, negatives=False)
    weights, step = checkpoint_encoder(cfg, path), int(meta["step"])
    start = retrieval.build("resumed", [weights], f"{cfg.retriever.model}@{path.name}", step)
    first = int(meta.get("live_version", -1)) + 1
    log.info(f"[index] resume: the live index starts from the step-{step} joint checkpoint's encoder, version {first}")
    try:
        return retrieval.start_service(start, weights, first_version=first, step=step, negatives=False)
    finally:
        start.index.drop()  # the service holds its own copy


def train(cfg: Config, jd: JointData, payload: Any, retrieval: Any, built: Any, sink: Any) -> tuple[Any, dict]:
    """fit_joint; with trained passages beside the live refresh of the run's index shards (started, then stopped
    with its report and the store's final version mix)."""
    service = probe = None
    report: dict[str, Any] = {}
    if PassageEncoder(cfg.joint.passage_encoder) == PassageEncoder.trained:  # the shards refresh their rows
        service, probe = start_live_index(cfg, retrieval, built, payload.weights[0])
    else:
        retrieval.release()
    try:
        fit = fit_joint(cfg, jd, payload.weights[0], payload.index, sink, service, probe)
        if service is not None:
            report["final_mix"] = final_mix(service, retrieval.shard_group.n)
    finally:
        if service is not None:
            report.update(retrieval.stop_service(service))
    return fit, report


def shipped_figures(
    cfg: Config, jd: JointData, fit: Any, retrieval: Any, built: Any, out_dir: Path, logger: Any
) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Every figure from the index the run ships: the jointly trained retriever on the evaluated split (the run's
    `trained` phase) and EM / F1 per mode; returns (results, the answers per mode). With trained passages the
    final encoder's index (saved in the folder), RAG scored again on it (joint/evaluate.py); with frozen ones
    the trained query side over the run's index, which the joint fit searched."""
    m = dict(fit.metrics)
    predictions = json.loads((fit.folder / PREDICTIONS_FILE).read_text())
    results: dict[str, dict[str, float]] = {}
    if PassageEncoder(cfg.joint.passage_encoder) == PassageEncoder.trained:
        final, results["trained"] = save_final_index(cfg, retrieval, fit.weights, Path(out_dir), logger)
        shipped, answers = fit_shipped_rag(cfg, jd, fit.weights, fit.folder / GENERATOR_FOLDER, final.index)
        m.update(shipped)  # rag/* and likelihood/*: the live index's stay under their own label
        predictions.update(answers)
    elif built is not None:  # (stages [joint] on a saved index: searched by the generator's client only)
        results["trained"] = retrieval.evaluate(replace(built, snapshots=[fit.weights], _encoder=None))
    for mode in ("closed_book", "rag", "oracle"):
        if f"{mode}/em" in m:
            results[PHASES[mode].replace("gen_", "joint_")] = {
                k: m[f"{mode}/{k}"] for k in ("em", "f1", "n", "seconds", "gold_in_top_k") if f"{mode}/{k}" in m
            }
    results.update(likelihood_results(m, "joint_"))
    results["joint"] = {
        "steps": float(cfg.joint.max_steps),
        "wall_seconds": fit.seconds,
        **{k: v for k, v in m.items() if k.startswith(("train/", "index/", LIVE))},
    }
    return results, predictions


def run_joint_stage(
    cfg: Config, data: RetrievalData, retrieval: Any, built: Any, out_dir: Path, logger: Any
) -> dict[str, dict[str, float]]:
    """Train both models jointly on the run's index; returns {"joint": summary, "joint_rag": {em, f1, ...}, ...}
    and writes <out_dir>/joint/ (encoder.safetensors, generator/ as an HF model folder, loss_history.json,
    predictions.json, metrics.json; with trained passages refresh_history.json, and <out_dir>/index replaced by the
    final encoder's index, evaluated as the `trained` phase, RAG scored on it)."""
    j = cfg.joint
    out = Path(out_dir) / JOINT_DIR
    gen = build_gen_data(cfg, data)
    # the index and the snapshot that built it, checked against each other (another encoder fails here)
    payload = resolve_index(cfg, data, built, Path(out_dir))
    if len(payload.weights) != 1:
        raise ValueError("joint training starts from one encoder; the index holds the consensus of several")
    trained = PassageEncoder(j.passage_encoder) == PassageEncoder.trained
    check_config(cfg.resources, together=trained, trainer=True, shard_gpus=shard_gpu_claim(cfg.index))
    jd = JointData(gen, list(retrieval.doc_ids), retrieval.passages(), retrieval.positions)
    sink = logger.sink() if logger is not None else None
    if sink is not None and cfg.resume:
        sink.skip_logged = True  # steps before the interruption are already in the run
    fit, report = train(cfg, jd, payload, retrieval, built, sink)
    out.mkdir(parents=True, exist_ok=True)
    for name in (ENCODER_FILE, HISTORY_FILE):
        shutil.copy2(fit.folder / name, out / name)
    shutil.copytree(fit.folder / GENERATOR_FOLDER, out / GENERATOR_FOLDER, dirs_exist_ok=True)
    results, predictions = shipped_figures(cfg, jd, fit, retrieval, built, Path(out_dir), logger)
    (out / PREDICTIONS_FILE).write_text(json.dumps(predictions, indent=1))
    if report:
        results["joint"]["index/final_version_count"] = float(len(report["final_mix"]))
        (out / REFRESH_FILE).write_text(json.dumps(report, indent=2))
    (out / "metrics.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    write_per_question(out, json.loads((out / PREDICTIONS_FILE).read_text()))  # runs pair on its rows
    if logger is not None:
        if sink is not None:
            sink.log({f"run/{p}/{k}": v for p, r_ in results.items() for k, v in r_.items()}, step=j.max_steps)
        names = ("metrics.json", PREDICTIONS_FILE, PER_QUESTION_FILE) + ((REFRESH_FILE,) if report else ())
        for name in names:
            logger.log_artifact(out / name, "joint")
    log.info(
        f"\n== joint: {j.loss}, passage encoder {PassageEncoder(j.passage_encoder).value}, top_k={j.top_k}, "
        f"{j.max_steps} steps in {fit.seconds:.1f}s =="
    )
    rows = [[p] + [res.get(k) for k in ("em", "f1", "gold_in_top_k")] for p, res in results.items() if "em" in res]
    if rows:
        log.info(tabulate(rows, headers=["phase", "em", "f1", "gold_in_top_k"], floatfmt=".4f"))
    if likelihood_line(results, "joint_"):
        log.info(likelihood_line(results, "joint_"))
    return results
