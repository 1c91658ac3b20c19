"""`python -m ragtrain ask <run> "question"`: the run's generator answers from the passages `python -m ragtrain
search` returns, with the jointly trained encoder and generator for a run with a joint stage; bad input is one line,
exit 2; and the export of a joint run holds the jointly trained models.

The run folders are the session's finished tiny quickstart (tests/conftest.py) copied, with a generator folder and,
for the joint run, a joint folder laid out as the stages leave them (an untrained tiny T5 stands in for a trained
generator, a perturbed copy of the trained encoder for the jointly trained one: training itself is tested in
tests/generator and tests/joint, and the joint stage's saved final index in tests/joint/test_train.py)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from ragtrain.joint import ENCODER_FILE, GENERATOR_FOLDER, JOINT_DIR
from tests.commands.test_search import ENV
from tests.conftest import REPO


def _copy_run(src: str, dst: Path, **changes) -> Path:
    """A copy of a finished run's folder (its results, not its MLflow store or checkpoints) with `changes` made to
    its config.yaml (dotted keys, `__` for `.`)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("mlflow*", "checkpoints", "vectors", "shards", "export"))
    conf = OmegaConf.load(dst / "config.yaml")
    for key, value in changes.items():
        OmegaConf.update(conf, key.replace("__", "."), value)
    (dst / "config.yaml").write_text(OmegaConf.to_yaml(conf))
    return dst


def _save_generator(cfg, folder: Path) -> None:
    from ragtrain.generator.model import build_generator
    from ragtrain.generator.model import load_tokenizer as gen_tokenizer
    from ragtrain.generator.saved import save_generator

    folder.mkdir(parents=True)
    tok = gen_tokenizer(cfg.generator)
    torch.manual_seed(1)  # an untrained tiny T5 whose greedy answer is not empty (seed 0's emits padding only)
    save_generator(build_generator(cfg.generator, tok), tok, folder)


@pytest.fixture(scope="module")
def runs(quickstart_run, tmp_path_factory):
    """(cfg, generator run, joint run, the joint encoder's weights): copies of the quickstart's folder."""
    from ragtrain.embed.weights import load_weights, save_weights

    cfg, _, _ = quickstart_run
    tmp = tmp_path_factory.mktemp("ask")
    gen = _copy_run(cfg.output_dir, tmp / "gen", stages=["retriever", "index", "generator"])
    _save_generator(cfg, gen / "generator")
    joint = _copy_run(cfg.output_dir, tmp / "joint", stages=["retriever", "index", "joint"])
    torch.manual_seed(1)  # queries move; the index keeps the vectors of the encoder it was built by (frozen passages)
    weights = {k: v + 0.05 * torch.randn_like(v) for k, v in load_weights(joint / "encoder").items()}
    (joint / JOINT_DIR).mkdir()
    save_weights(weights, joint / JOINT_DIR, Path(ENCODER_FILE).stem)
    _save_generator(cfg, joint / JOINT_DIR / GENERATOR_FOLDER)
    return cfg, gen, joint, weights


def _question(cfg) -> str:
    from ragtrain.data import make_synthetic

    data = make_synthetic(num_entities=cfg.data.num_entities, seed=cfg.data.seed)
    return data.queries[sorted(data.eval_qrels)[0]]


def _ask_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m ragtrain ask`, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "ragtrain", "ask", *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300
    )


def _ask(*args: str) -> subprocess.CompletedProcess:
    """The same entry point in this process: a new interpreter costs seconds of imports."""
    from ragtrain.commands.ask import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["ragtrain", "ask", *args], code, out.getvalue(), err.getvalue())


def _direct_scores(run: Path, weights: dict, question: str, cfg, k: int) -> tuple[list[str], list[float]]:
    """Top-k ids and scores of `question` encoded by `weights`, searched in the run's saved index."""
    from ragtrain.embed.encoders import QueryEncoder
    from ragtrain.index.sharded import open_saved

    index = open_saved(run / "index")
    q = QueryEncoder(cfg.retriever, [weights], precision=cfg.index.precision.value).encode([question], role="query")
    scores, rows = index.search(np.ascontiguousarray(q), k)
    return [index.doc_ids[r] for r in rows[0]], scores[0].tolist()


@pytest.mark.integration
def test_ask_prints_the_answer_and_the_sources_search_returns(runs) -> None:
    from ragtrain.commands.search import search

    cfg, gen, _, _ = runs
    question = _question(cfg)
    res = _ask_cli(str(gen), question, "--json")
    assert res.returncode == 0 and "error" not in res.stderr, res.stderr
    got = json.loads(res.stdout)
    assert got["k"] == cfg.generator.retrieval.top_k  # the default: the passages the generator was trained with
    assert isinstance(got["answer"], str) and got["generator"] == str(gen / "generator")
    _, hits = search(gen, question, got["k"])
    assert got["sources"] == hits and [h["rank"] for h in hits] == list(range(1, got["k"] + 1))
    assert all(h["id"] and h["title"] and h["score"] for h in hits)

    res = _ask(str(gen), question)  # the text form (in this process): the answer, then a line per source
    assert res.returncode == 0, res.stderr
    lines = res.stdout.rstrip("\n").splitlines()
    assert lines[0] == f"answer: {got['answer']}" and lines[1:3] == ["", "sources:"]
    assert len(lines) == 3 + got["k"]
    for line, h in zip(lines[3:], hits):
        rank, score, pid, rest = line.split(maxsplit=3)
        assert (int(rank), pid) == (h["rank"], h["id"]) and float(score) == pytest.approx(h["score"], abs=1e-4)
        assert rest.startswith(f"{h['title']}: ")


def test_the_answer_is_the_generators_on_the_prompt_it_was_trained_with(runs) -> None:
    """The answer equals the saved generator's greedy output on the training prompt of the question and sources,
    cut at its first line: built here from the model folder with plain transformers."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from ragtrain.commands.ask import ask
    from ragtrain.generator.prompt import PromptBuilder, Template

    cfg, gen, _, _ = runs
    question = _question(cfg)
    got = ask(gen, question, k=2)
    g = cfg.generator
    tok = AutoTokenizer.from_pretrained(str(gen / "generator"))
    hf = AutoModelForSeq2SeqLM.from_pretrained(str(gen / "generator")).eval()
    builder = PromptBuilder(tok, g.max_source_length, g.passage_max_tokens,
                            Template(g.question_prefix, g.passage_prefix, g.answer_prefix))  # fmt: skip
    texts = [f"{h['title']}: {h['text']}" if g.include_title else h["text"] for h in got["sources"]]
    ids = torch.tensor([builder.source(question, texts)])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=g.eval.max_new_tokens,
                          num_beams=g.eval.num_beams, do_sample=False)  # fmt: skip
    want = tok.decode(out[0], skip_special_tokens=True).strip().split("\n", 1)[0].strip()
    assert got["answer"] == want and want


def test_a_joint_run_asks_with_the_jointly_trained_encoder_and_generator(runs) -> None:
    from ragtrain.commands.search import search
    from ragtrain.embed.weights import load_weights

    cfg, _, joint, weights = runs
    question = _question(cfg)
    res = _ask(str(joint), question, "-k", "5", "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["generator"] == str(joint / JOINT_DIR / GENERATOR_FOLDER)
    ids, scores = _direct_scores(joint, weights, question, cfg, 5)
    assert [h["id"] for h in got["sources"]] == ids
    assert [h["score"] for h in got["sources"]] == pytest.approx(scores, abs=1e-5)
    # the index's own (pre-joint) encoder scores differently: the scores above name the encoder that was used
    _, before = _direct_scores(joint, load_weights(joint / "encoder"), question, cfg, 5)
    assert max(abs(a - b) for a, b in zip(scores, before)) > 1e-3
    assert search(joint, question, 5)[1] == got["sources"]  # search serves the same query encoder


def test_a_joint_run_with_trained_passages_and_the_pre_joint_index_is_refused(runs, tmp_path: Path) -> None:
    """joint.passage_encoder=trained re-encodes the run's index with the final encoder; a folder whose index is still
    the one from before joint training would be searched with queries of another encoder."""
    cfg, _, joint, _ = runs
    run = _copy_run(str(joint), tmp_path / "run", joint__passage_encoder="trained", refresh__enabled=True,
                    refresh__every_steps=2)  # fmt: skip
    res = _ask(str(run), "who founded it?")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert "not by the jointly trained encoder" in res.stderr and str(run / "index") in res.stderr


def test_export_of_a_joint_run_holds_the_jointly_trained_models(runs, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    from ragtrain.commands.search import load_run_config
    from ragtrain.config.logger import LoggerConfig
    from ragtrain.embed.encoders import QueryEncoder
    from ragtrain.embed.weights import load_weights
    from ragtrain.pipeline.export import export_run
    from ragtrain.track.mlflow import RunLogger
    from tests.conftest import mlflow_db

    cfg, _, joint, weights = runs
    run = _copy_run(str(joint), tmp_path / "run")
    jcfg = load_run_config(run)
    jcfg.logger.register_as = None  # the registry is tested with the quickstart's own export
    logger = RunLogger(LoggerConfig(tracking_uri=mlflow_db(tmp_path / "m.db"), experiment_name="ask"), run_name="j")
    try:  # the pipeline passes the encoder that built the index: the joint run's own replaces it
        exported = export_run(jcfg, load_weights(run / "encoder"), run, "synthetic", "table", logger, "em 0.25")
    finally:
        logger.end()
    st = SentenceTransformer(str(exported["retriever"]), device="cpu", local_files_only=True)
    texts = ["Who founded the Velmora observatory?", "The mill stood on the river bank."]
    ours = QueryEncoder(cfg.retriever, [weights], precision="fp32").encode(texts, role="passage")
    theirs = st.encode_document(texts, convert_to_tensor=True).cpu().float()
    assert torch.nn.functional.cosine_similarity(torch.as_tensor(ours), theirs).min().item() >= 0.9999
    assert "jointly trained encoder" in (exported["retriever"] / "README.md").read_text()
    card = (exported["generator"] / "README.md").read_text()
    assert f"trained jointly with the retriever ({jcfg.joint.loss}, {jcfg.joint.max_steps} steps" in card
    assert 'license: "other"\n' in card and "(license: none: a random init)" in card and "em 0.25" in card
    want = (run / JOINT_DIR / GENERATOR_FOLDER / "model.safetensors").read_bytes()
    assert (exported["generator"] / "model.safetensors").read_bytes() == want
    # a copy, not a hard link: damaging the export must leave the run's generator whole
    assert (exported["generator"] / "model.safetensors").stat().st_nlink == 1


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("missing folder", "does not exist"),
        ("not a run folder", "config.yaml is missing"),
        ("no index", "holds no index"),
        ("no generator stage", "trained no generator: ask a run whose stages include 'generator'"),
        ("generator not saved", "generator/config.json is missing"),
        ("empty question", "the question is empty"),
        ("k zero", "-k must be > 0, got 0"),
        ("k above the index", "-k must be between 1 and"),
        ("damaged index", "is corrupt"),
        ("damaged generator weights", "not a loadable generator"),
        ("question too long", "generator.max_source_length"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(runs, quickstart_run, tmp_path: Path, case: str, says: str) -> None:
    cfg, gen, _, _ = runs
    run, question, extra = str(gen), "who founded it?", []
    if case == "missing folder":
        run = str(tmp_path / "nowhere")
    elif case == "not a run folder":
        run = str(tmp_path)
    elif case == "no index":
        run = str(_copy_run(str(gen), tmp_path / "run"))
        shutil.rmtree(Path(run) / "index")
    elif case == "no generator stage":
        run = quickstart_run[0].output_dir  # stages [retriever, index]
    elif case == "generator not saved":
        run = str(_copy_run(str(gen), tmp_path / "run"))
        shutil.rmtree(Path(run) / "generator")
    elif case == "empty question":
        question = "  "
    elif case == "k zero":
        extra = ["-k", "0"]
    elif case == "k above the index":
        extra = ["-k", "100000"]
    elif case == "damaged index":
        run = str(_copy_run(str(gen), tmp_path / "run"))
        _truncate(Path(run) / "index" / "shard-0" / "index.faiss")
    elif case == "damaged generator weights":  # safetensors' own error, not an OSError
        run = str(_copy_run(str(gen), tmp_path / "run"))
        _truncate(Path(run) / "generator" / "model.safetensors")
    elif case == "question too long":
        question = "who founded the observatory " * 200
    res = _ask(run, question, *extra)
    assert res.returncode == 2 and res.stdout == "", res
    assert res.stderr.startswith("ask error: ") and res.stderr.strip().count("\n") == 0, res.stderr
    assert says in res.stderr, res.stderr
    if case in ("missing folder", "not a run folder", "no index", "damaged index", "damaged generator weights"):
        assert run in res.stderr  # the folder or file is named


def test_asking_a_bert2bert_generator_prints_no_load_report(tmp_path: Path, capfd) -> None:
    """The saved BERT2BERT has no encoder pooler (it was trained without one): loading it for an answer must not
    report the pooler's weights as missing and newly initialised (transformers' "LOAD REPORT" table)."""
    import transformers

    from ragtrain.commands.ask import Answerer
    from ragtrain.config import to_typed
    from ragtrain.generator.model import build_generator, load_tokenizer
    from ragtrain.generator.saved import save_generator
    from tests.conftest import compose, tiny_overrides

    over = ["generator=bert2bert_minilm", "generator.encoder_layers=1", "generator.decoder_layers=1"]
    cfg = to_typed(compose(tiny_overrides(tmp_path) + over))
    tok = load_tokenizer(cfg.generator)
    save_generator(build_generator(cfg.generator, tok), tok, tmp_path / "generator")
    before = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()  # as a fresh `python -m ragtrain ask` (building silenced it)
    try:
        capfd.readouterr()
        hits = [{"title": "Acme", "text": "Acme was founded by Ada Lovelace in 1843."}]
        answer = Answerer(cfg, tmp_path / "generator")("Who founded the company?", hits)
        out, err = capfd.readouterr()
    finally:
        transformers.logging.set_verbosity(before)
    assert isinstance(answer, str)
    assert "LOAD REPORT" not in out + err and "newly initialized" not in out + err, err


def test_asking_a_causal_chat_generator_answers_from_the_chat_prompt(tmp_path: Path) -> None:
    """The causal chat path that squad_rag produces (generator=smollm2's layout, the tiny Llama in its place): the
    saved model and its tokenizer load, the prompt is the chat template's, and the answer is what greedy generation
    says from it, cut at its first line."""
    from ragtrain.commands.ask import Answerer
    from ragtrain.config import to_typed
    from ragtrain.generator.model import AnswerDecoder, build_generator, load_tokenizer
    from ragtrain.generator.prompt import passage_text
    from ragtrain.generator.saved import load_generator, save_generator
    from tests.conftest import compose, tiny_overrides
    from tests.generator.tiny_llama import save_tiny_llama

    llama = save_tiny_llama(tmp_path / "llama")
    over = ["generator=smollm2", f"generator.model={llama}", "generator.prompt=chat", "generator.eval.max_new_tokens=6"]
    cfg = to_typed(compose(tiny_overrides(tmp_path) + over))
    tok = load_tokenizer(cfg.generator)
    torch.manual_seed(0)
    save_generator(build_generator(cfg.generator, tok), tok, tmp_path / "generator")
    ask = Answerer(cfg, tmp_path / "generator")
    question = "which team won super bowl 50?"
    assert tok.decode(ask.builder.source(question, [])).endswith("<|im_start|>assistant\n")  # the chat template's
    hits = [{"title": "Super_Bowl_50", "text": "the denver broncos won super bowl 50."}]
    answer = ask(question, hits)
    m = load_generator(cfg, tmp_path / "generator")  # the same greedy decode, by hand
    src = ask.builder.source(question, [passage_text(h["title"], h["text"], cfg.generator.include_title) for h in hits])
    batch = m.arch.collate([src], [[]], m.pad_id, for_generation=True)
    with torch.no_grad():
        ids = m.generate(batch["input_ids"], batch["attention_mask"], 1, cfg.generator.eval.max_new_tokens)
    assert isinstance(answer, str) and "\n" not in answer
    assert answer == AnswerDecoder(tok)(ids[0])
