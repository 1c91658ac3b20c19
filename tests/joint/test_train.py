"""Joint retriever + generator training on a real local Ray: gloo DDP over both models, the index shards (real
FAISS), the live refresh on 2 shards, MLflow on SQLite. Tiny encoder, tiny Llama, the 24-entity KB."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ragtrain.config import to_typed
from ragtrain.runtime.errors import ConfigError
from tests.conftest import compose, tiny_overrides
from tests.generator.tiny_llama import save_tiny_llama


def _overrides(llama: Path) -> list[str]:
    return [
        "stages=[index,joint]",
        "generator=smollm2",  # its causal layout, with the tiny Llama in place of the packaged model
        f"generator.model={llama}",
        "generator.include_title=false",
        "generator.train.precision=fp32",
        "generator.prompt=plain",
        "generator.dropout=0.0",
        "generator.max_source_length=160",
        "generator.max_target_length=12",
        "generator.passage_max_tokens=64",
        "generator.retrieval.top_k=2",
        "generator.train.lr=1e-3",
        "generator.train.warmup_steps=0",
        "generator.train.oracle_steps=0",
        "generator.train.grad_clip=0",
        "generator.eval.before=false",
        "generator.eval.modes=[rag]",
        "generator.eval.max_questions=8",
        "generator.eval.max_new_tokens=4",
        "index.shards=2",
        "joint.top_k=4",
        "joint.max_steps=4",
        "joint.batch_size=2",
        "joint.log_every=1",
        "joint.retriever_lr=1e-3",
        "resources.trainer.num_workers=2",
        "resources.pool.num_actors=1",
    ]


def _cfg(tmp: Path, llama: Path, *extra: str):
    return to_typed(compose(tiny_overrides(tmp) + _overrides(llama) + list(extra)))


@pytest.fixture(scope="module")
def built(ray_session, tmp_path_factory):
    """A tiny-retriever index of the 24-entity KB on 2 index shards (vectors encoded in-process, as the generator
    stage's tests do: the Ray Data encode is tested in tests/corpus)."""
    from ragtrain.corpus.load import load_data
    from tests.conftest import in_process_index

    tmp = tmp_path_factory.mktemp("joint")
    llama = save_tiny_llama(tmp / "llama", chat=False)
    cfg = _cfg(tmp, llama)
    data = load_data(cfg.data)
    retrieval, index, weights = in_process_index(cfg, data, tmp / "vectors")
    yield tmp, llama, data, retrieval, index, weights
    retrieval.close()


def _fit(cfg, built):
    from ragtrain.generator.stage import build_gen_data
    from ragtrain.joint.train import JointData, fit_joint

    _, _, data, retrieval, index, weights = built
    jd = JointData(build_gen_data(cfg, data), list(retrieval.doc_ids), retrieval.passages(), retrieval.positions)
    return fit_joint(cfg, jd, weights, index.index, None)


@pytest.mark.integration
def test_two_workers_equal_one_worker_on_the_same_global_batch_and_frozen_passages_stay(built) -> None:
    from safetensors.torch import load_file

    tmp, llama, _, _, index, weights = built
    stored = index.index.reconstruct_first(index.index.ntotal).copy()
    two = _fit(_cfg(tmp / "two", llama, "logger=none"), built)
    one = _fit(_cfg(tmp / "one", llama, "logger=none", "resources.trainer.num_workers=1", "joint.batch_size=4"), built)
    keys = ("pdist_loss", "gen_loss", "top_passage_posterior")
    assert [h["step"] for h in one.history] == [h["step"] for h in two.history] == [1, 2, 3, 4]
    for key in keys:
        assert [h[key] for h in one.history] == pytest.approx([h[key] for h in two.history], rel=1e-4, abs=1e-6)
    assert one.history[-1]["gen_loss"] < one.history[0]["gen_loss"]  # the generator learns
    # the updated parameters of both models agree
    for k, v in one.weights.items():
        torch.testing.assert_close(v, two.weights[k], rtol=1e-4, atol=1e-4)  # Adam: ~lr x 1e-2
    g1 = load_file(str(one.folder / "generator" / "model.safetensors"))
    g2 = load_file(str(two.folder / "generator" / "model.safetensors"))
    for k, v in g1.items():
        torch.testing.assert_close(v, g2[k], rtol=1e-4, atol=1e-4)
    # the query side learned; the passage side (the index's stored vectors) did not move
    moved = max((one.weights[k] - weights[k]).abs().max().item() for k in weights)
    assert moved > 1e-3
    np.testing.assert_array_equal(index.index.reconstruct_first(index.index.ntotal), stored)
    assert 0 <= one.metrics["rag/em"] <= one.metrics["rag/f1"] + 1e-9 <= 1 + 1e-9


@pytest.mark.integration
def test_trained_passages_refresh_two_shards_and_end_on_one_version(built) -> None:
    from mlflow.tracking import MlflowClient

    from ragtrain.joint.stage import run_joint_stage
    from ragtrain.track.mlflow import RunLogger

    tmp, llama, data, retrieval, index, _ = built
    cfg = _cfg(
        tmp / "full", llama,
        "joint.passage_encoder=trained", "joint.loss=emdr2", "refresh.enabled=true", "refresh.every_steps=2",
        "refresh.consistency=global", "refresh.check_every=1", "refresh.probe_queries=4", "refresh.probe_passages=8",
    )  # fmt: skip
    logger = RunLogger(cfg.logger, run_name="joint-full")
    try:
        results = run_joint_stage(cfg, data, retrieval, index, Path(cfg.output_dir), logger)
    finally:
        logger.end()
    out = Path(cfg.output_dir) / "joint"
    report = json.loads((out / "refresh_history.json").read_text())
    # the store's own report at the end: every row of both shards at one encoder version, a refreshed one
    mix = report["final_mix"]
    assert len(mix) == 1 and int(next(iter(mix))) > 0, mix
    assert sum(mix.values()) == len(retrieval.doc_ids)
    assert report["history"] and all(h["ok"] for h in report["history"])
    # joint training takes no mined negatives: the rounds encode and mine only the staleness probe's queries (the
    # store's service is started by `retrieval`, with its own config's probe)
    probe = retrieval.cfg.refresh.probe_queries
    assert probe < len(retrieval.train_qrels)
    assert {h["metrics"]["index/mined_queries"] for h in report["history"]} == {float(probe)}
    assert results["joint"]["index/refreshes"] >= 1 and results["joint"]["index/final_version_count"] == 1
    # the jointly trained retriever evaluated on the split, over the index the refresh left
    assert {"ndcg@10", "recall@100", "answer_recall@5"} <= set(results["trained"])
    assert 0 < results["trained"]["recall@100"] <= 1
    run = MlflowClient(logger.uri).get_run(logger.run_id)
    for key in ("joint/emdr2_loss", "joint/gen_loss", "index/drift_cosine", "index/version_skew",
                "index/mixed_recall_at_10", "run/joint_rag/em"):  # fmt: skip
        assert key in run.data.metrics, key
    assert (out / "generator" / "config.json").exists() and (out / "encoder.safetensors").exists()
    from ragtrain.commands.paired import answer_scores  # the joint stage's saved answers re-score to its figures

    em = answer_scores(cfg.output_dir, "rag/em").values()
    assert sum(em) / len(em) == pytest.approx(results["joint_rag"]["em"], abs=1e-12)
    # the run's saved index is the final encoder's (the live rows were refreshed by older snapshots): its metadata
    # names the joint encoder, its vectors are that encoder's, and `ragtrain search` serves it with the joint queries
    from omegaconf import OmegaConf

    from ragtrain.commands.search import search
    from ragtrain.embed.encoders import QueryEncoder
    from ragtrain.embed.weights import load_weights
    from ragtrain.index.sharded import open_saved

    saved = open_saved(Path(cfg.output_dir) / "index")
    assert saved.meta.encoder == f"{cfg.retriever.model}@{out / 'encoder.safetensors'}"
    final = load_weights(out)
    want = QueryEncoder(cfg.retriever, [final]).encode(list(retrieval.passages()[:8]), role="passage")
    np.testing.assert_allclose(saved.reconstruct_first(8), want, atol=1e-5)
    assert 0 <= results["trained"]["ndcg@10"] <= 1
    (Path(cfg.output_dir) / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    question = data.queries[sorted(data.eval_qrels)[0]]
    _, hits = search(cfg.output_dir, question, 3)
    scores, rows = saved.search(QueryEncoder(cfg.retriever, [final]).encode([question], role="query"), 3)
    assert [h["id"] for h in hits] == [saved.doc_ids[r] for r in rows[0]]


def test_joint_without_an_index_or_with_another_encoder_fails_clearly(built, tmp_path) -> None:
    from ragtrain.generator.stage import preflight
    from ragtrain.index.faiss_index import IndexMismatchError

    _, llama, data, _, index, _ = built
    with pytest.raises(ConfigError, match="joint.passage_encoder=trained refreshes the run's own index"):
        _cfg(tmp_path, llama, "stages=[joint]", "joint.passage_encoder=trained", "refresh.enabled=true",
             "refresh.every_steps=2")  # fmt: skip
    with pytest.raises(ConfigError) as e:  # a trained passage encoder without the live refresh
        _cfg(tmp_path, llama, "joint.passage_encoder=trained")
    assert str(e.value).startswith("joint.passage_encoder changes the passage vectors while training: it needs")
    with pytest.raises(ConfigError, match=r"the joint stage needs a retrieval index .*stages: \[index, joint\]"):
        preflight(_cfg(tmp_path / "none", llama, "stages=[joint]"), data)
    index.index.save(tmp_path / "saved")
    other = _cfg(tmp_path / "other", llama, "stages=[joint]", f"generator.retrieval.index_dir={tmp_path / 'saved'}",
                 "retriever.tiny.hidden_size=32")  # fmt: skip
    with pytest.raises(IndexMismatchError):
        preflight(other, data)
