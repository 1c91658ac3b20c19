"""The generator stage on a real local Ray: gloo DDP, the retrieval service, three eval modes, checkpoints, checks.

One small stage run (tiny T5, tiny retriever, 24-entity KB, 2 workers x batch 4, 6 steps) is shared by the tests;
a second, 1-worker run with batch 8 checks that DDP follows the same loss trajectory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ray.train import TrainingFailedError

from ragtrain.config import to_typed
from ragtrain.generator.stage import PHASES
from ragtrain.index.faiss_index import IndexMismatchError
from ragtrain.pipeline.export import answer_block
from ragtrain.runtime.errors import ConfigError
from tests.conftest import compose, tiny_overrides


def _overrides() -> list[str]:
    return [
        "generator=tiny_t5",
        "stages=[retriever,index,generator]",
        "generator.dropout=0.0",
        "generator.train.max_steps=6",
        "generator.train.batch_size=4",
        "generator.train.log_every=1",
        "generator.train.checkpoint_every=3",
        "generator.train.warmup_steps=2",
        "generator.train.oracle_steps=2",
        "generator.eval.max_new_tokens=4",
        "generator.eval.before=true",
        "resources.trainer.num_workers=2",
    ]


def _cfg(tmp: Path, *extra: str):
    return to_typed(compose(tiny_overrides(tmp) + _overrides() + list(extra)))


@pytest.fixture(scope="module")
def built(ray_session, tmp_path_factory):
    """A tiny-retriever index of the 24-entity KB, held by the run's index shard as in a pipeline run (built from
    vectors encoded in-process: the Ray Data encode is tested in tests/corpus), saved to <out>/index."""
    from ragtrain.corpus.load import load_data
    from tests.conftest import in_process_index

    tmp = tmp_path_factory.mktemp("gen")
    cfg = _cfg(tmp)
    data = load_data(cfg.data)
    retrieval, index, _ = in_process_index(cfg, data, tmp / "vectors")
    out = Path(cfg.output_dir)
    index.index.save(out / "index")
    yield tmp, cfg, data, retrieval, index
    retrieval.close()


@pytest.fixture(scope="module")
def stage_run(built):
    from ragtrain.generator.stage import run_generator_stage
    from ragtrain.track.mlflow import RunLogger

    _, cfg, data, retrieval, index = built
    logger = RunLogger(cfg.logger, run_name="generator-test")
    try:
        results = run_generator_stage(cfg, data, retrieval, index, Path(cfg.output_dir), logger)
    finally:
        logger.end()
    return results, logger


@pytest.mark.integration
def test_three_modes_run_and_are_logged(built, stage_run) -> None:
    from mlflow.tracking import MlflowClient

    _, cfg, data, _, _ = built
    results, logger = stage_run
    assert {"gen_closed_book", "gen_rag", "gen_oracle", "gen_train"} <= set(results)
    n_eval = len(data.eval_qrels)
    for phase in ("gen_closed_book", "gen_rag", "gen_oracle"):
        assert results[phase]["n"] == n_eval and 0 <= results[phase]["em"] <= results[phase]["f1"] + 1e-9 <= 1 + 1e-9
    assert results["gen_train"]["steps"] == 6 and results["gen_train"]["samples_per_s"] > 0
    client = MlflowClient(logger.uri)
    run = client.get_run(logger.run_id)
    for key in ("gen_closed_book/em", "gen_rag/em", "gen_oracle/em", "gen_rag/f1", "run/gen_train/steps"):
        assert key in run.data.metrics, key
    # generator.eval.before: the same modes and questions, scored before fine-tuning
    for phase in ("gen_before_closed_book", "gen_before_rag", "gen_before_oracle"):
        assert results[phase]["n"] == n_eval and 0 <= results[phase]["em"] <= results[phase]["f1"] + 1e-9 <= 1 + 1e-9
        assert run.data.metrics[f"{phase}/f1"] == pytest.approx(results[phase]["f1"])
    assert results["gen_before_rag"]["gold_in_top_k"] == results["gen_rag"]["gold_in_top_k"]  # same retrieval
    losses = client.get_metric_history(logger.run_id, "gen_train/loss")  # rank 0, every log window
    assert sorted(m.step for m in losses) == [1, 2, 3, 4, 5, 6]
    for key in ("gen_train/tokens_per_s", "gen_train/samples_per_s"):
        assert client.get_metric_history(logger.run_id, key)[-1].value > 0
    preds = json.loads((Path(cfg.output_dir) / "generator" / "predictions.json").read_text())
    assert set(preds) == {"closed_book", "rag", "oracle", "likelihood"} and all(
        len(v) == n_eval for v in preds.values()
    )
    _check_likelihood(cfg, results, run.data.metrics, preds)
    # each prediction names the passages of its prompt; gen_rag/gold_in_top_k counts the gold one among them
    gold = {q: {p for p, grade in rel.items() if grade > 0} for q, rel in data.eval_qrels.items()}
    assert all(r["passages"] == [] for r in preds["closed_book"])
    assert all(len(r["passages"]) == 1 and r["passages"][0] in gold[r["qid"]] for r in preds["oracle"])
    assert all(len(r["passages"]) == cfg.generator.retrieval.top_k for r in preds["rag"])
    # python -m ragtrain paired --metric <mode>/<em|f1> re-scores these answers: the run's own figures
    from ragtrain.commands.paired import answer_scores

    for phase, mode in (("gen_rag", "rag"), ("gen_closed_book", "closed_book"), ("gen_oracle", "oracle")):
        for kind in ("em", "f1"):
            values = answer_scores(cfg.output_dir, f"{mode}/{kind}").values()
            assert sum(values) / len(values) == pytest.approx(results[phase][kind], abs=1e-12)
    # the exported generator's card: these figures, and how many questions they were scored on
    block = answer_block(cfg, results).splitlines()
    em_row = next(line.split() for line in block if line.startswith("em "))
    assert block[0] == f"{n_eval} {cfg.data.split} questions" and "untrained rag" in block[2]
    assert em_row[1:] == [f"{results[p]['em']:.4f}" for p in PHASES.values() if p in results]
    hit = sum(bool(gold[r["qid"]] & set(r["passages"])) for r in preds["rag"]) / n_eval
    assert results["gen_rag"]["gold_in_top_k"] == pytest.approx(hit) and run.data.metrics[
        "gen_rag/gold_in_top_k"
    ] == pytest.approx(hit)


def _check_likelihood(cfg, results, logged: dict, preds: dict) -> None:
    """The answer likelihood on every evaluated question (generator.eval.likelihood_questions=0), before and after
    training, logged, and saved per question with EM / F1 in per_question.jsonl."""
    k = cfg.generator.eval.likelihood_top_k
    lik = results["gen_likelihood"]
    assert lik["n"] == len(preds["rag"]) and lik["top_k"] == k and set(results["gen_before_likelihood"]) == set(lik)
    assert (
        0 < lik["oracle_nll"] and 0 < lik["rag_nll"] and lik["rag_nll"] != results["gen_before_likelihood"]["rag_nll"]
    )
    for key in ("rag_nll", "rag_nll_top1", "oracle_nll"):
        assert logged[f"gen_likelihood/{key}"] == pytest.approx(lik[key])
        assert lik[key] == pytest.approx(sum(r[key] for r in preds["likelihood"]) / lik["n"])
    for r in preds["likelihood"]:  # the RAG prompt's passage is the retriever's first: its top-1 NLL is that one
        assert len(r["passages"]) == len(r["scores"]) == k and r["scores"] == sorted(r["scores"], reverse=True)
        assert r["rag_nll_top1"] == -r["loglik"][0] and min(r["loglik"]) <= -r["rag_nll"] <= max(r["loglik"])
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "generator" / "per_question.jsonl").open()]
    assert [r["qid"] for r in rows] == sorted(r["qid"] for r in preds["rag"])
    assert sum(r["rag/em"] for r in rows) / len(rows) == pytest.approx(results["gen_rag"]["em"])
    assert sum(r["likelihood/rag_nll"] for r in rows) / len(rows) == pytest.approx(lik["rag_nll"])


@pytest.mark.integration
def test_checkpoints_every_n_steps_and_round_trip(built, stage_run) -> None:
    from ragtrain.generator.model import AnswerDecoder, load_tokenizer
    from ragtrain.generator.saved import load_generator
    from ragtrain.generator.stage import build_gen_data
    from ragtrain.generator.steps import prompt_builder

    _, cfg, data, _, _ = built
    out = Path(cfg.output_dir)
    ckpts = sorted(c for c in (out / "ray" / "generator").glob("checkpoint_*") if c.is_dir())
    assert len(ckpts) == 2  # step 3 and the final one (num_to_keep=2)
    metas = [json.loads((c / "meta.json").read_text()) for c in ckpts]
    step3, final = (ckpts[0], ckpts[1]) if metas[0]["step"] == 3 else (ckpts[1], ckpts[0])
    assert (final / "model.safetensors").exists() and json.loads((final / "meta.json").read_text())["final"]
    assert (final / "config.json").exists() and (final / "tokenizer_config.json").exists()  # an HF model folder
    assert (step3 / "rank0.safetensors").exists() and (step3 / "rank1.safetensors").exists()
    assert not list(out.rglob("*.bin")) and not list(out.rglob("*.pkl"))
    states = list(out.rglob("rank*_state.pt"))  # the step-3 checkpoint's optimizer/RNG state, one per rank
    assert len(states) == 2 and all(torch.load(p, weights_only=True)["step"] == 3 for p in states)
    # The saved weights reproduce the run's own oracle predictions.
    g = cfg.generator
    model = load_generator(cfg, out / "generator")
    gd = build_gen_data(cfg, data)
    tokenizer = load_tokenizer(g)
    decode = AnswerDecoder(tokenizer)
    builder = prompt_builder(g, tokenizer)
    src = [builder.source(e.question, [gd.passages[e.gold[0]]]) for e in gd.eval]
    b = model.arch.collate(src, [[] for _ in src], model.pad_id, for_generation=True)
    again = [decode(o) for o in model.generate(b["input_ids"], b["attention_mask"], 1, g.eval.max_new_tokens)]
    saved = json.loads((out / "generator" / "predictions.json").read_text())["oracle"]
    assert again == [p["prediction"] for p in saved]


@pytest.mark.slow(reason="an end-to-end run of its own, beyond the default suite's budget (make test-slow)")
def test_two_workers_match_one_worker_with_the_doubled_batch(built, stage_run) -> None:
    import ray

    from ragtrain.generator.retriever_client import RetrievalClient
    from ragtrain.generator.stage import build_gen_data, resolve_index
    from ragtrain.generator.train import fit_generator

    tmp, cfg2, data, retrieval, index = built
    cfg1 = _cfg(
        tmp / "one",
        "resources.trainer.num_workers=1",
        "generator.train.batch_size=8",
        "generator.train.checkpoint_every=0",
        "generator.eval.modes=[]",
        "logger=none",
    )
    payload = resolve_index(cfg1, data, index, Path(cfg1.output_dir))
    fit = fit_generator(cfg1, build_gen_data(cfg1, data), RetrievalClient(ray.put(payload)), None)
    two = json.loads((Path(cfg2.output_dir) / "generator" / "loss_history.json").read_text())
    one = [h["loss"] for h in fit.loss_history]
    assert len(one) == len(two) == 6
    assert one == pytest.approx([h["loss"] for h in two], rel=1e-5)  # measured: <= 1.1e-7
    assert one[-1] < one[0]  # and it learns


def _stage(cfg, built, name: str):
    """One generator stage run into its own MLflow run; returns (results, the run's gen_train/loss history)."""
    from mlflow.tracking import MlflowClient

    from ragtrain.generator.stage import run_generator_stage
    from ragtrain.track.mlflow import RunLogger

    _, _, data, retrieval, index = built
    logger = RunLogger(cfg.logger, run_name=name)
    try:
        results = run_generator_stage(cfg, data, retrieval, index, Path(cfg.output_dir), logger)
    finally:
        logger.end()
    losses = MlflowClient(logger.uri).get_metric_history(logger.run_id, "gen_train/loss")
    return results, sorted((m.step, m.value) for m in losses)


def _assert_same_run(results, losses, clean_results, clean_cfg) -> None:
    """Logged step sequence 1..6 without gap or repeat, losses and EM/F1 equal to the uninterrupted run's."""
    clean = json.loads((Path(clean_cfg.output_dir) / "generator" / "loss_history.json").read_text())
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in losses] == pytest.approx([h["loss"] for h in clean], rel=1e-5)
    for phase in ("gen_closed_book", "gen_rag", "gen_oracle"):
        for k in ("em", "f1"):
            assert results[phase][k] == pytest.approx(clean_results[phase][k], abs=1e-6), (phase, k)


@pytest.mark.slow(
    reason="restarts go through the one harness (ragtrain/train), tested with the retriever (make test-slow)"
)
def test_killed_worker_restarts_from_its_checkpoint_and_matches_a_clean_run(built, stage_run) -> None:
    from ragtrain.train.checkpoint import fault_marker

    tmp, clean_cfg, *_ = built
    # rank 1 dies after step 4; the group restarts from the step-3 checkpoint (optimizer, schedule, RNG, history)
    cfg = _cfg(tmp / "killed", "fault.max_failures=1", "fault.kill_worker_at_step=4", "fault.kill_rank=1")
    results, losses = _stage(cfg, built, "generator-killed")
    assert fault_marker(cfg.output_dir, "generator", 1, 4).exists()  # it really died
    _assert_same_run(results, losses, stage_run[0], clean_cfg)


@pytest.mark.slow(reason="an end-to-end run of its own, beyond the default suite's budget (make test-slow)")
def test_interrupted_stage_resumes_to_the_same_result(built, stage_run) -> None:
    tmp, clean_cfg, *_ = built
    cfg = _cfg(tmp / "resumed", "fault.max_failures=0", "fault.kill_worker_at_step=5", "fault.kill_rank=0")
    with pytest.raises(TrainingFailedError):  # no restarts allowed: the stage stops at the kill
        _stage(cfg, built, "generator-interrupted")
    assert not (Path(cfg.output_dir) / "generator" / "predictions.json").exists()
    resumed = to_typed(
        compose(
            tiny_overrides(tmp / "resumed") + [*[o for o in _overrides() if not o.startswith("fault.")], "resume=true"]
        )
    )
    results, losses = _stage(resumed, built, "generator-resumed")  # a new MLflow run: only steps 4..6 are in it
    assert [s for s, _ in losses] == [4, 5, 6]
    clean = json.loads((Path(clean_cfg.output_dir) / "generator" / "loss_history.json").read_text())
    assert [v for _, v in losses] == pytest.approx([h["loss"] for h in clean][3:], rel=1e-5)
    saved = json.loads((Path(cfg.output_dir) / "generator" / "loss_history.json").read_text())
    assert [h["step"] for h in saved] == [1, 2, 3, 4, 5, 6]  # the history from before the interruption is kept
    _assert_same_run(results, [(h["step"], h["loss"]) for h in saved], stage_run[0], clean_cfg)
    # a second resume finds the finished stage and reuses it instead of training again
    again, _ = _stage(resumed, built, "generator-resumed-again")
    assert again["gen_rag"] == results["gen_rag"] and again["gen_train"]["steps"] == 6


def test_missing_index_fails_before_training(built, tmp_path) -> None:
    from ragtrain.generator.stage import preflight, run_generator_stage

    _, _, data, _, _ = built
    cfg = _cfg(tmp_path, "stages=[generator]")
    with pytest.raises(ConfigError, match="generator.retrieval.index_dir: .*run the 'index' stage before 'generator'"):
        preflight(cfg, data)
    with pytest.raises(FileNotFoundError, match="needs a retrieval index"):
        run_generator_stage(cfg, data, None, None, tmp_path / "out", None)
    assert not (tmp_path / "out" / "ray").exists()  # no trainer was started


@pytest.mark.parametrize(
    "override,match",
    [
        ("retriever=minilm", "retriever.model is 'minilm'"),  # another encoder family
        ("retriever.tiny.hidden_size=32", "32-dim vectors but the index holds 64-dim"),
        ("seed=1", "does not match the index"),  # same architecture, other weights (the untrained tiny init is seeded)
    ],
)
def test_encoder_index_mismatch_fails_clearly(built, tmp_path, override: str, match: str) -> None:
    from ragtrain.generator.stage import preflight

    _, cfg0, data, _, _ = built
    index_dir = Path(cfg0.output_dir) / "index"
    cfg = _cfg(tmp_path, "stages=[generator]", f"generator.retrieval.index_dir={index_dir}", override)
    with pytest.raises(IndexMismatchError, match=match):
        preflight(cfg, data)


def test_a_saved_index_is_searched_from_shards_not_through_the_driver(built, tmp_path) -> None:
    from ragtrain.generator.retriever_client import Searcher
    from ragtrain.generator.stage import resolve_index
    from ragtrain.index.sharded import ShardedIndex

    _, cfg0, data, _, index = built
    cfg = _cfg(tmp_path, "stages=[generator]", f"generator.retrieval.index_dir={Path(cfg0.output_dir) / 'index'}")
    assert resolve_index(cfg, data, None, tmp_path, check_only=True) is None
    payload = resolve_index(cfg, data, None, tmp_path)
    assert isinstance(payload.index, ShardedIndex)  # shard actors hold the saved folder: the driver holds no vector
    questions = [data.queries[q] for q in list(data.eval_qrels)[:5]]
    expected = Searcher(resolve_index(cfg0, data, index, tmp_path)).search(questions, 5)
    assert Searcher(payload).search(questions, 5) == expected


def test_bad_config_and_data_fail_clearly(built, tmp_path) -> None:
    from dataclasses import replace

    from ragtrain.generator.stage import preflight

    _, _, data, _, _ = built
    with pytest.raises(ConfigError, match="fp16 needs a GPU"):
        preflight(_cfg(tmp_path, "generator.train.precision=fp16"), data)
    on_gpu = ("generator.train.precision=fp16", "resources.trainer.use_gpu=true", "stages=[retriever,index,joint]")
    with pytest.raises(ConfigError, match=r"fp16 is not supported by the joint stage .*: use bf16 .* or fp32"):
        preflight(_cfg(tmp_path, *on_gpu), data)  # its step has no loss scaling: fp16 gradients would underflow
    # the generator's own worker count puts 2 NCCL ranks on a half GPU each: refused before the retriever trains
    half = (
        "resources.trainer.use_gpu=true",
        "resources.trainer.num_workers=1",
        "resources.trainer.gpus_per_worker=0.5",
        "generator.train.num_workers=2",
    )
    with pytest.raises(ConfigError, match=r"gpus_per_worker below 1 could put two of the 2 NCCL ranks on one GPU"):
        preflight(_cfg(tmp_path, *half), data)
    with pytest.raises(ConfigError, match=r"^generator.model='/nonexistent/t5': no such folder; give a local folder"):
        preflight(_cfg(tmp_path, "generator=t5_pretrained", "generator.model=/nonexistent/t5"), data)
    with pytest.raises(ConfigError, match="cannot be loaded offline"):  # a hub id that is not cached
        preflight(_cfg(tmp_path, "generator=t5_pretrained", "generator.model=some-org/not-cached-t5"), data)
    # a top_k past the index: refused before any training, not a crash in a joint step or a silent cut
    passages = len(data.corpus)
    with pytest.raises(ConfigError, match=rf"^generator.retrieval.top_k=1000 is more than the {passages} passages"):
        preflight(_cfg(tmp_path, "generator.retrieval.top_k=1000"), data)
    with pytest.raises(ConfigError, match=rf"^joint.top_k=1000 is more than the {passages} passages of the index"):
        preflight(_cfg(tmp_path, "stages=[retriever,index,joint]", "joint.top_k=1000"), data)
    with pytest.raises(ConfigError, match=rf"^generator.eval.likelihood_top_k=1000 is more than the {passages} pass"):
        preflight(_cfg(tmp_path, "generator.eval.likelihood_top_k=1000"), data)
    with pytest.raises(ConfigError, match="needs short answers"):
        preflight(_cfg(tmp_path), replace(data, answers={}))


def test_a_model_the_architecture_or_lengths_cannot_use_fails_before_training(built, tmp_path) -> None:
    # each of these used to pass the checks and fail inside a Ray worker, after the retriever had trained
    from transformers import GPT2Config

    from ragtrain.generator.stage import preflight

    _, _, data, _, _ = built
    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=64, vocab_size=30522).save_pretrained(gpt2)
    use = [f"generator.model={gpt2}", "generator.tokenizer=minilm"]
    with pytest.raises(
        ConfigError,
        match=r"generator.arch=seq2seq needs a seq2seq LM, and generator.model=.* is a "
        r"'gpt2' model: set generator.arch .*choices: \['bert2bert', 'seq2seq', ",
    ):
        preflight(_cfg(tmp_path, *use), data)
    with pytest.raises(ConfigError, match=r"generator.arch=bert2bert needs a BERT checkpoint"):
        preflight(_cfg(tmp_path, "generator=bert2bert_minilm", *use), data)
    with pytest.raises(
        ConfigError,
        match=r"generator.max_source_length \+ generator.max_target_length = 108 is more "
        r"than generator.model=.* has positions for \(64\)",
    ):
        preflight(_cfg(tmp_path, "generator=tiny_gpt2", *use), data)
    # an encoder (BERT is in transformers' causal-LM table as a decoder) is refused as a causal LM: trained, it
    # attends to the answer it should predict and scored EM 0.000
    minilm = ["generator.arch=causal", "generator.model=minilm", "generator.tokenizer=minilm"]
    with pytest.raises(
        ConfigError,
        match=r"generator.arch=causal needs a decoder-only causal LM \(this checkpoint is an encoder, which attends "
        r"to later tokens\), and generator.model='minilm' is a 'bert' model",
    ):
        preflight(_cfg(tmp_path, *minilm), data)
    with pytest.raises(
        ConfigError,
        match=r"question '.*': the question takes \d+ tokens with the template's fixed "
        r"tokens, more than generator.max_source_length=8",
    ):
        preflight(_cfg(tmp_path, "generator.max_source_length=8"), data)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("generator=bert2bert_minilm", "generator.model=tiny"), r"generator.model 'tiny' is a small T5 or GPT-2"),
        (("generator.train.epochs=3",), r"generator.train.epochs and generator.train.max_steps=6 are both set"),
        (
            ("generator.train.log_every=2",),
            r"generator.train.checkpoint_every must be 0 or a multiple of "
            r"generator.train.log_every \(2\)",
        ),
        (
            ("generator.tiny.num_heads=3",),
            r"generator.tiny.d_model must be divisible by generator.tiny.num_heads \(3\)",
        ),
        (
            ("checkpoint.every_steps=3", "retriever.train.log_every=2"),
            r"checkpoint.every_steps must be 0 or a multiple",
        ),
        # keys that only one architecture or model reads
        (
            ("generator.decoder_layers=3",),
            r"generator.decoder_layers applies to generator.arch=bert2bert only \(this is "
            r"seq2seq\); remove it",
        ),
        (
            ("generator=tiny_gpt2", "generator.tie_embeddings=false"),
            r"generator.tie_embeddings applies to "
            r"generator.arch=bert2bert only \(this is causal\)",
        ),
        (
            ("generator=bert2bert_minilm", "generator.tiny.d_model=32"),
            r"generator.tiny.d_model applies to "
            r"generator.model=tiny only \(this is 'minilm'\)",
        ),
    ],
)
def test_settings_that_would_be_ignored_or_log_wrongly_are_refused(tmp_path, overrides: tuple, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, *overrides)
