"""Joint retriever + generator training on a real local Ray: gloo DDP over both models, the index shards (real
FAISS), the live refresh on 2 shards, MLflow on SQLite. Tiny encoder, tiny Llama, the 24-entity KB."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from ragtrain.config import to_typed
from ragtrain.embed.weights import load_weights
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


def _generator(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "generator" / "model.safetensors"))


LOSSES = ("pdist_loss", "gen_loss", "top_passage_posterior")


def _stored_and_initial(index, weights, cfg, passages) -> tuple[np.ndarray, np.ndarray]:
    """The first 8 stored vectors of `index` and what the initial encoder makes of those passages."""
    from ragtrain.embed.encoders import QueryEncoder

    initial = QueryEncoder(cfg.retriever, [weights]).encode(list(passages[:8]), role="passage")
    return index.reconstruct_first(8), initial


@pytest.mark.integration
def test_two_workers_killed_mid_run_end_as_one_uninterrupted_worker_on_the_same_global_batch(built) -> None:
    """Frozen passages with the live refresh enabled in the run (it refreshes during retriever training). 2 workers
    x 2 questions: rank 1 dies after step 3, the worker group restarts from the step-2 checkpoint (both models, the
    optimizer's groups and schedule, RNG, loss history) and ends with the figures of 1 uninterrupted worker x 4
    questions (the same global batch): one reference for both the restart and DDP, as each Ray Train fit costs
    ~15 CPU-s of process starts. No refresh touches the index the joint stage searched and ships, which still holds
    the initial encoder's passage vectors."""
    from ragtrain.joint.stage import run_joint_stage

    tmp, llama, data, retrieval, index, weights = built
    one = _fit(_cfg(tmp / "one", llama, "logger=none", "resources.trainer.num_workers=1", "joint.batch_size=4"), built)
    assert [h["step"] for h in one.history] == [1, 2, 3, 4]
    assert one.history[-1]["gen_loss"] < one.history[0]["gen_loss"]  # the generator learns
    assert max((one.weights[k] - weights[k]).abs().max().item() for k in weights) > 1e-3  # the query side learned
    assert 0 <= one.metrics["rag/em"] <= one.metrics["rag/f1"] + 1e-9 <= 1 + 1e-9
    # the answer likelihood over the index's top 4 (scores from the frozen passages' index), on every evaluated
    # question (more than EM's sample)
    assert one.metrics["likelihood/n"] == len(data.eval_qrels) > one.metrics["rag/n"]
    cfg = _cfg(
        tmp / "killed", llama, "stages=[retriever,index,joint]", "retriever.train.log_every=1",
        "refresh.enabled=true", "refresh.every_steps=1", "checkpoint.every_steps=2", "fault.max_failures=1",
        "fault.kill_worker_at_step=3", "fault.kill_rank=1",
    )  # fmt: skip
    out = Path(cfg.output_dir)
    out.mkdir(parents=True)  # rank 0 writes its lines (the restore's) into <out>/ragtrain.log
    results = run_joint_stage(cfg, data, retrieval, index, out, None)
    assert (out / "ray" / ".fault_injected_joint_rank1_step3").exists()  # it really died
    assert "[joint] resumed at step 2 from" in (out / "ragtrain.log").read_text()
    history = json.loads((out / "joint" / "loss_history.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3, 4]  # no gap, no repeat across the restart
    for key in LOSSES:
        assert [h[key] for h in history] == pytest.approx([h[key] for h in one.history], rel=1e-4, abs=1e-6), key
    # the restored schedule: each step's learning rates of both groups, exactly (the weights below are compared at
    # the tolerance of 2 ranks against 1)
    lrs = ("lr_retriever", "lr_generator")
    assert [[h[k] for k in lrs] for h in history] == [[h[k] for k in lrs] for h in one.history]
    # the updated parameters of both models agree (2 ranks' gradient sums differ from 1's in the last bits, and Adam
    # turns that into ~lr x 1e-2: measured 1.2e-5)
    final = load_weights(out / "joint")
    for k, v in final.items():
        torch.testing.assert_close(v, one.weights[k], rtol=1e-4, atol=1e-4)
    g1 = _generator(one.folder)
    for k, v in _generator(out / "joint").items():
        torch.testing.assert_close(v, g1[k], rtol=1e-4, atol=1e-4)
    assert results["joint_rag"]["em"] == one.metrics["rag/em"]
    # the likelihood split over the ranks and gathered: 2 workers give 1 worker's figures
    assert results["joint_likelihood"]["n"] == one.metrics["likelihood/n"]
    for key in ("rag_nll", "rag_nll_top1", "oracle_nll"):
        assert results["joint_likelihood"][key] == pytest.approx(one.metrics[f"likelihood/{key}"], rel=1e-3), key
    # no refresh round ran in the joint stage, and the index it searched still holds the initial encoder's vectors
    assert not (out / "joint" / "refresh_history.json").exists()
    assert not any(k.startswith(("index/", "live/")) for k in results["joint"])
    stored, initial = _stored_and_initial(index.index, weights, cfg, retrieval.passages())
    np.testing.assert_allclose(stored, initial, atol=1e-5)
    assert max((final[k] - weights[k]).abs().max().item() for k in weights) > 1e-3  # while the query side moved


def _checkpoint_meta(cfg) -> dict:
    from ragtrain.train.checkpoint import latest_checkpoint, read_meta

    path = latest_checkpoint(Path(cfg.output_dir) / "ray" / "joint")
    assert path is not None
    return read_meta(path)


def _stop_then_resume(cfg, built, logger):
    """The joint stage stopped by a kill after step 3 (no restarts allowed), then resumed (resume=true)."""
    from ray.train import TrainingFailedError

    from ragtrain.joint.stage import run_joint_stage

    _, _, data, retrieval, index, _ = built
    out = Path(cfg.output_dir)
    out.mkdir(parents=True)  # rank 0 writes its lines (the restore's) into <out>/ragtrain.log
    with pytest.raises(TrainingFailedError):
        run_joint_stage(cfg, data, retrieval, index, out, None)
    meta = _checkpoint_meta(cfg)
    assert meta["step"] == 2 and meta["live_version"] >= 0  # the live index's newest version at step 2
    resumed = replace(cfg, resume=True)
    return run_joint_stage(resumed, data, retrieval, index, out, logger), meta


@pytest.mark.integration
def test_trained_passages_resume_mid_joint_refresh_two_shards_and_score_the_index_they_ship(built) -> None:
    from mlflow.tracking import MlflowClient

    from ragtrain.track.mlflow import RunLogger

    tmp, llama, data, retrieval, index, weights = built
    cfg = _cfg(
        tmp / "full", llama,
        "joint.passage_encoder=trained", "joint.loss=emdr2", "refresh.enabled=true", "refresh.every_steps=2",
        "refresh.consistency=global", "refresh.check_every=1", "refresh.probe_queries=4", "refresh.probe_passages=8",
        "checkpoint.every_steps=2", "fault.kill_worker_at_step=3", "fault.max_failures=0",
    )  # fmt: skip
    logger = RunLogger(cfg.logger, run_name="joint-full")
    try:
        results, meta = _stop_then_resume(cfg, built, logger)
    finally:
        logger.end()
    out = Path(cfg.output_dir) / "joint"
    # resumed mid-joint: from the step-2 checkpoint (not step 0), the live index numbered on from its version
    assert "[joint] resumed at step 2 from" in (Path(cfg.output_dir) / "ragtrain.log").read_text()
    assert [h["step"] for h in json.loads((out / "loss_history.json").read_text())] == [1, 2, 3, 4]
    run = MlflowClient(logger.uri).get_run(logger.run_id)
    steps = [m.step for m in MlflowClient(logger.uri).get_metric_history(logger.run_id, "joint/emdr2_loss")]
    assert sorted(steps) == [3, 4]  # this run trained steps 3 and 4 only
    report = json.loads((out / "refresh_history.json").read_text())
    assert report["history"] and all(h["ok"] for h in report["history"])
    assert report["history"][0]["version"] == meta["live_version"] + 2  # start: checkpoint's + 1, its round: + 2
    # the store's own report at the end: every row of both shards at one encoder version, a refreshed one
    mix = report["final_mix"]
    assert len(mix) == 1 and int(next(iter(mix))) > 0, mix
    assert sum(mix.values()) == len(retrieval.doc_ids)
    # joint training takes no mined negatives: the rounds encode and mine only the staleness probe's queries (the
    # store's service is started by `retrieval`, with its own config's probe)
    probe = retrieval.cfg.refresh.probe_queries
    assert probe < len(retrieval.train_qrels)
    assert {h["metrics"]["index/mined_queries"] for h in report["history"]} == {float(probe)}
    assert results["joint"]["index/refreshes"] >= 1 and results["joint"]["index/final_version_count"] == 1
    # the jointly trained retriever evaluated on the split, over the index the run ships
    assert {"ndcg@10", "recall@100", "answer_recall@5"} <= set(results["trained"])
    assert 0 < results["trained"]["recall@100"] <= 1 and 0 <= results["trained"]["ndcg@10"] <= 1
    logged = ("joint/emdr2_loss", "joint/gen_loss", "joint/grad_norm_retriever", "index/drift_cosine",
              "index/version_skew", "index/mixed_recall_at_10", "run/joint_rag/em",
              "run/joint/live/rag/em", "run/joint_likelihood/rag_nll")  # fmt: skip
    for key in logged:
        assert key in run.data.metrics, key
    # the answer likelihood with the live index's scores, saved per question beside EM / F1 for pairing
    rows = [json.loads(line) for line in (out / "per_question.jsonl").open()]
    assert len(rows) == results["joint_likelihood"]["n"] == len(data.eval_qrels)
    lik, rag = results["joint_likelihood"], results["joint_rag"]
    assert sum(r["likelihood/rag_nll"] for r in rows) / len(rows) == pytest.approx(lik["rag_nll"])
    assert sum(r.get("rag/em", 0) for r in rows) / rag["n"] == pytest.approx(rag["em"])  # on EM's sample only
    assert (out / "generator" / "config.json").exists() and (out / "encoder.safetensors").exists()
    _assert_ships_what_it_scored(cfg, data, retrieval, results, weights)


def _assert_ships_what_it_scored(cfg, data, retrieval, results, weights) -> None:
    """The run's saved index is the final encoder's (the live rows were refreshed by older snapshots): its metadata
    names the joint encoder, its vectors are that encoder's (not the initial one's), RAG's answers and EM come from
    it, and `ragtrain.commands.search` serves it with the joint queries."""
    from omegaconf import OmegaConf

    from ragtrain.commands.paired import answer_scores
    from ragtrain.commands.search import search
    from ragtrain.embed.encoders import QueryEncoder
    from ragtrain.index.sharded import open_saved

    out = Path(cfg.output_dir) / "joint"
    saved = open_saved(Path(cfg.output_dir) / "index")
    assert saved.meta.encoder == f"{cfg.retriever.model}@{out / 'encoder.safetensors'}"
    final = QueryEncoder(cfg.retriever, [load_weights(out)])
    stored, initial = _stored_and_initial(saved, weights, cfg, retrieval.passages())
    np.testing.assert_allclose(stored, final.encode(list(retrieval.passages()[:8]), role="passage"), atol=1e-5)
    assert np.abs(stored - initial).max() > 1e-3  # the trained passage side moved the stored vectors
    # RAG's figures and answers come from the shipped index: each question's passages are its top k there
    predictions = json.loads((out / "predictions.json").read_text())
    rag, live = predictions["rag"], predictions["live/rag"]
    _, rows = saved.search(final.encode([p["question"] for p in rag], role="query"), cfg.generator.retrieval.top_k)
    assert [p["passages"] for p in rag] == [[saved.doc_ids[r] for r in row] for row in rows]
    em = answer_scores(cfg.output_dir, "rag/em").values()
    assert sum(em) / len(em) == pytest.approx(results["joint_rag"]["em"], abs=1e-12)
    assert len(live) == len(rag) and 0 <= results["joint"]["live/rag/em"] <= 1  # the live index's, labelled
    (Path(cfg.output_dir) / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    question = data.queries[sorted(data.eval_qrels)[0]]
    _, hits = search(cfg.output_dir, question, 3)
    _, rows = saved.search(final.encode([question], role="query"), 3)
    assert [h["id"] for h in hits] == [saved.doc_ids[r] for r in rows[0]]


def test_a_resumed_runs_mlflow_history_keeps_the_joint_stages_metrics_up_to_its_checkpoint(tmp_path) -> None:
    """resume=true: the joint stage's metrics (joint/*, and index/* of its live refresh without a retriever stage)
    past its latest checkpoint were logged by the stopped run, and are logged again by the resumed one."""
    from ragtrain.pipeline.stages import checkpointed_steps

    cfg = to_typed(compose(tiny_overrides(tmp_path) + ["stages=[index,joint]", "resume=true"]))
    ckpt = Path(cfg.output_dir) / "ray" / "joint" / "checkpoint_000000"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 10, "world": 1, "fit_id": "x"}))
    for name in ("rank0.safetensors", "rank0_state.pt"):
        (ckpt / name).write_bytes(b"")
    keep = checkpointed_steps(cfg)
    assert (keep("joint/loss"), keep("index/drift_cosine"), keep("run/trained/ndcg@10")) == (10, 10, None)


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
