"""RAG EM / F1 of the jointly trained models on the index the run ships (a trained passage encoder).

The joint fit with a trained passage encoder searches the live index, whose rows the refresh re-encoded with
snapshots older than the last step (and may mix encoder versions). The stage then re-encodes the corpus with the
final encoder and ships that index (<output_dir>/index): `python -m ragtrain search`, `ask` and the `trained`
phase's nDCG read it. This fit scores RAG on it, so every figure of the run comes from the index it ships: each
worker loads the final encoder and the generator from the joint fit's final checkpoint and answers its share of
the evaluation questions (generator/steps.py's `evaluate`, as the joint fit does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
import torch

from ragtrain.config import Config
from ragtrain.embed.model import build_encoder
from ragtrain.embed.model import load_tokenizer as load_encoder_tokenizer
from ragtrain.embed.weights import load_state
from ragtrain.generator.saved import load_generator
from ragtrain.generator.steps import evaluate, prompt_builder
from ragtrain.joint.train import PREDICTIONS_FILE, IndexSearch, JointData
from ragtrain.train.harness import Worker, WorkerArgs, fit

STAGE = "joint_eval"  # its Ray Train run folder: <output_dir>/ray/joint_eval


@dataclass
class ShippedInputs:
    """What the evaluation's workers receive beside the config."""

    data: Any  # ObjectRef of the JointData
    weights: Any  # ObjectRef of the final encoder's weights
    generator: str  # the trained generator's folder (in the joint fit's final checkpoint)
    index: Any  # the shipped index (its shard actors)


def eval_loop_per_worker(args: WorkerArgs) -> None:
    """One Ray Train worker: the final encoder and the trained generator -> RAG on the shipped index -> rank 0
    writes the answers into the final checkpoint."""
    cfg = args.cfg
    w = Worker(args, seed=cfg.joint.seed)
    inputs: ShippedInputs = args.inputs
    data: JointData = w.fetch(inputs.data)
    encoder = build_encoder(cfg.retriever)
    load_state(encoder, w.fetch(inputs.weights))
    encoder.to(w.device).eval()
    generator = load_generator(cfg, inputs.generator).to(w.device)
    builder = prompt_builder(cfg.generator, generator.tokenizer)
    # evaluate asks any object for search(questions, k) (its annotation names the generator stage's client)
    search: Any = IndexSearch(cfg, encoder, load_encoder_tokenizer(cfg.retriever), w.device, data.doc_ids, inputs.index)
    rag = replace(cfg, generator=replace(cfg.generator, eval=replace(cfg.generator.eval, modes=["rag"])))
    results, predictions = evaluate(generator, builder, data.gen, search, rag, w.device, w.rank, w.world)

    def write(folder: Path) -> None:  # the answers (and the likelihood's rows), named as the completeness mark
        Path(folder, PREDICTIONS_FILE).write_text(json.dumps(predictions, indent=1))
        Path(folder, "meta.json").write_text(json.dumps({"weights": PREDICTIONS_FILE}))

    # RAG's EM / F1 and the answer likelihood (its p_R from this index's scores): both read the shipped index
    w.finish({"step": 0, **{f"{mode}/{k}": v for mode, r in results.items() for k, v in r.items()}}, write)


def fit_shipped_rag(
    cfg: Config, data: JointData, weights: dict[str, torch.Tensor], generator: Path, index: Any
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Driver: RAG with the final encoder over `index` (the shipped one) and the generator saved in `generator`,
    on resources.trainer workers; returns ({em, f1, n, seconds, gold_in_top_k}, the answers as predictions.json
    holds them, per mode)."""
    r = cfg.resources.trainer
    inputs = ShippedInputs(ray.put(data), ray.put(weights), str(generator), index)
    done = fit(eval_loop_per_worker, WorkerArgs(cfg, STAGE, r.cpus_per_worker, inputs=inputs), r.num_workers)
    answers = json.loads(Path(done.folder, PREDICTIONS_FILE).read_text())
    return {k: float(v) for k, v in done.summary.items() if k.startswith(("rag/", "likelihood/"))}, answers
