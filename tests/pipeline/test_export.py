"""Use what was trained: the sentence-transformers export gives ragtrain's vectors, MLflow holds the model (and the
registry its version), and `python -m ragtrain.search` searches a finished run's folder (`python -m ragtrain.ask`,
its generator's answer: tests/test_ask.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ragtrain.config import Config, to_typed
from ragtrain.config.retriever import Pooling, RetrieverConfig, TinyEncoderConfig
from ragtrain.embed.model import build_encoder, encode_texts, load_tokenizer
from ragtrain.pipeline.export import export_retriever
from tests.conftest import REGISTERED_MODEL, REPO, compose

TEXTS = [
    "Who founded the Velmora observatory?",
    "The Velmora observatory was founded in 1871 by Ada Quist. " * 6,
    "short",
    "Another passage about the river Tessin and the mill that stood on its bank for three centuries.",
]
TINY = TinyEncoderConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, dropout=0.0)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _export_and_compare(tmp_path: Path, r: RetrieverConfig) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """Export a (seeded) encoder, reload it with plain sentence-transformers, encode TEXTS both ways."""
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    model = build_encoder(r)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    folder = export_retriever(Config(retriever=r), weights, tmp_path / "retriever", card="# card\n")
    st = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    assert st.max_seq_length == r.passage_max_length
    ours = encode_texts(model, load_tokenizer(r), TEXTS, r.passage_max_length, role="passage")
    theirs = st.encode_document(TEXTS, convert_to_tensor=True)
    return folder, ours, theirs


@pytest.mark.parametrize("model", ["tiny", "minilm"])
def test_export_loads_offline_and_gives_ragtrains_vectors(tmp_path: Path, model: str) -> None:
    r = RetrieverConfig(model=model, tiny=TINY, passage_max_length=48)
    folder, ours, theirs = _export_and_compare(tmp_path, r)
    modules = [m["type"] for m in json.loads((folder / "modules.json").read_text())]
    assert [m.rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "mean"
    # sentence-transformers 6 keeps max_seq_length as the tokenizer's model_max_length
    assert json.loads((folder / "tokenizer_config.json").read_text())["model_max_length"] == 48
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()
    assert (folder / "README.md").read_text() == "# card\n"
    cos = torch.nn.functional.cosine_similarity(ours, theirs.cpu().float())
    assert cos.min().item() >= 0.9999
    assert theirs.norm(dim=-1).sub(1).abs().max().item() < 1e-5  # the Normalize module is there


def test_cls_pooling_no_normalize_and_prefixes_carry_over(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    r = RetrieverConfig(
        model="tiny",
        tiny=TINY,
        pooling=Pooling.cls,
        normalize=False,
        query_prefix="query: ",
        passage_prefix="passage: ",
    )
    folder, ours, theirs = _export_and_compare(tmp_path, r)
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((folder / "modules.json").read_text())]
    assert modules == ["Transformer", "Pooling"]
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "cls"
    assert torch.allclose(ours, theirs.cpu().float(), atol=1e-4)  # unnormalised: compare the vectors themselves
    # queries: the "query" prompt is ragtrain's query prefix; without the prefix the vectors differ
    torch.manual_seed(0)
    model = build_encoder(r)
    q_ours = encode_texts(model, load_tokenizer(r), TEXTS[:1], r.query_max_length, role="query")
    st = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    q_st = st.encode_query(TEXTS[:1], convert_to_tensor=True).cpu().float()
    assert torch.allclose(q_ours, q_st, atol=1e-4)
    assert not torch.allclose(q_ours, st.encode(TEXTS[:1], convert_to_tensor=True).cpu().float(), atol=1e-3)


def test_tokenize_applies_the_prefix_of_its_role() -> None:
    from ragtrain.embed.model import tokenize

    plain = load_tokenizer(RetrieverConfig(model="tiny"))
    tok = load_tokenizer(RetrieverConfig(model="tiny", query_prefix="query: ", passage_prefix="passage: "))
    for role in ("query", "passage"):
        got = tokenize(tok, ["the mill"], 32, role=role)["input_ids"]
        want = tokenize(plain, [f"{role}: the mill"], 32, role=role)["input_ids"]
        assert torch.equal(got, want)
    assert torch.equal(tokenize(plain, ["x"], 8)["input_ids"], tokenize(plain, ["x"], 8, role="query")["input_ids"])
    with pytest.raises(ValueError, match="retriever.query_prefix"):
        tokenize(tok, ["the mill"], 32)  # a caller that names no role would silently skip the prefixes


# --- a real tiny run: export, MLflow model + registry, and the search CLI on its folder

REGISTERED = REGISTERED_MODEL


@pytest.fixture
def finished_run(quickstart_run):
    """The session's one finished tiny quickstart (tests/conftest.py): it exports and registers its retriever."""
    return quickstart_run


@pytest.mark.integration
def test_run_exports_the_trained_retriever(finished_run) -> None:
    from sentence_transformers import SentenceTransformer

    from ragtrain.embed.weights import load_weights

    cfg, results, _ = finished_run
    out = Path(cfg.output_dir)
    folder = out / "export" / "retriever"
    st = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    model = build_encoder(cfg.retriever)
    model.load_state_dict(load_weights(out / "encoder"))  # the trained weights, not the seeded init
    ours = encode_texts(model, load_tokenizer(cfg.retriever), TEXTS, cfg.retriever.passage_max_length)
    cos = torch.nn.functional.cosine_similarity(ours, st.encode(TEXTS, convert_to_tensor=True).cpu().float())
    assert cos.min().item() >= 0.9999
    card = (folder / "README.md").read_text()
    assert "library_name: sentence-transformers" in card and "tiny BERT" in card
    assert "batch_size: 4" in card  # the resolved config
    assert f"{results['trained']['ndcg@10']:.4f}" in card  # the evaluation table
    assert "## Reproduce" in card and "synthetic" in card
    assert not (out / "export" / "generator").exists()  # no generator stage ran


@pytest.mark.integration
def test_mlflow_holds_the_model_and_the_registry_its_version(finished_run, monkeypatch) -> None:
    import mlflow.sentence_transformers
    from mlflow.tracking import MlflowClient

    cfg, _, tmp = finished_run
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(uri, registry_uri=uri)
    run = client.search_runs([client.get_experiment_by_name(cfg.logger.experiment_name).experiment_id])[0]
    assert run.info.status == "FINISHED"
    model_uri = run.data.tags["ragtrain.retriever_model"]
    assert model_uri == f"runs:/{run.info.run_id}/retriever"
    assert "MLmodel" in {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "retriever")}
    versions = client.search_model_versions(f"name='{REGISTERED}'")
    assert [(int(v.version), v.run_id) for v in versions] == [(1, run.info.run_id)]
    assert run.data.tags["ragtrain.registered_model"] == f"models:/{REGISTERED}/1"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the flavour's loader resolves models:/ through these
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", uri)
    loaded = mlflow.sentence_transformers.load_model(f"models:/{REGISTERED}/1")
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(Path(cfg.output_dir) / "export" / "retriever"), device="cpu", local_files_only=True)
    assert torch.allclose(torch.as_tensor(loaded.encode(TEXTS)), torch.as_tensor(st.encode(TEXTS)), atol=1e-5)


def _search_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m ragtrain.search`, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "ragtrain.search", *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300
    )


def _search(*args: str) -> subprocess.CompletedProcess:
    """The same entry point in this process (its exit status and what it prints): a new interpreter costs seconds
    of imports, and one CLI run above checks the real command."""
    import contextlib
    import io

    from ragtrain.search import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["ragtrain.search", *args], code, out.getvalue(), err.getvalue())


@pytest.mark.integration
def test_search_cli_returns_the_runs_ranking(finished_run) -> None:
    import numpy as np

    from ragtrain.data import make_synthetic
    from ragtrain.embed.encoders import QueryEncoder
    from ragtrain.embed.weights import load_weights
    from ragtrain.index.sharded import open_saved

    cfg, _, _ = finished_run
    out = Path(cfg.output_dir)
    data = make_synthetic(num_entities=cfg.data.num_entities, seed=cfg.data.seed)
    question = data.queries[sorted(data.eval_qrels)[0]]
    res = _search_cli(cfg.output_dir, question, "-k", "3", "--json")
    assert res.returncode == 0 and "warning" not in res.stderr, res.stderr  # a complete run: no status warning
    hits = json.loads(res.stdout)["hits"]
    assert [h["rank"] for h in hits] == [1, 2, 3]
    assert all(h["text"] == data.corpus[h["id"]].text and h["title"] == data.corpus[h["id"]].title for h in hits)
    # the same ranking as the trained encoder + the saved index in this process
    model = build_encoder(cfg.retriever)
    model.load_state_dict(load_weights(out / "encoder"))
    # encoded as the CLI encodes queries: the index's precision (auto: bf16 weights where the CPU runs bf16)
    q = QueryEncoder(cfg.retriever, [model.state_dict()], precision=cfg.index.precision.value).encode([question])
    index = open_saved(out / "index")
    scores, rows = index.search(np.ascontiguousarray(q), 3)
    assert [h["id"] for h in hits] == [index.doc_ids[r] for r in rows[0]]
    assert [h["score"] for h in hits] == pytest.approx(scores[0].tolist(), abs=1e-5)


def test_search_of_a_folder_without_index_fails_in_one_line(tmp_path: Path) -> None:
    res = _search(str(tmp_path), "who founded it?")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert "holds no index" in res.stderr and str(tmp_path) in res.stderr


@pytest.mark.parametrize("generator", ["tiny_t5", "bert2bert_minilm"])
def test_generator_export_is_a_plain_transformers_folder(tmp_path: Path, generator: str) -> None:
    """save_pretrained's folder loads with plain transformers and gives the trained model's logits; BERT2BERT's
    encoder/decoder embedding tie (generator.tie_embeddings) is exported as two equal matrices."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, EncoderDecoderModel

    from ragtrain.generator.model import build_generator
    from ragtrain.generator.model import load_tokenizer as gen_tokenizer
    from ragtrain.generator.saved import save_generator
    from ragtrain.pipeline.export import export_generator

    extra = ["generator.encoder_layers=1", "generator.decoder_layers=1"] if generator == "bert2bert_minilm" else []
    cfg = to_typed(compose([f"generator={generator}", f"output_dir={tmp_path}", *extra]))
    torch.manual_seed(0)
    model = build_generator(cfg.generator, gen_tokenizer(cfg.generator)).eval()
    (tmp_path / "generator").mkdir()
    save_generator(model, gen_tokenizer(cfg.generator), tmp_path / "generator")
    (tmp_path / "generator" / "predictions.json").write_text("{}")  # the run's results stay out of the export
    folder = export_generator(tmp_path / "generator", tmp_path / "export" / "generator")
    assert not (folder / "predictions.json").exists() and (folder / "config.json").exists()
    cls = EncoderDecoderModel if generator == "bert2bert_minilm" else AutoModelForSeq2SeqLM
    hf = cls.from_pretrained(str(folder)).eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    batch = tok(["question: who founded it? context: Ada Quist founded it."], return_tensors="pt")
    batch.pop("token_type_ids", None)
    dec = torch.tensor([[model.start_id, 5, 6]])
    with torch.no_grad():
        want = model.hf(**batch, decoder_input_ids=dec).logits
        got = hf(**batch, decoder_input_ids=dec).logits
    assert torch.allclose(want, got, atol=1e-5)


def test_search_on_a_config_this_schema_cannot_read_fails_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "index_meta.json").write_text("{}")
    (tmp_path / "config.yaml").write_text("sync:\n  no_such_key: 1\n")  # e.g. written by another ragtrain version
    res = _search(str(tmp_path), "who founded it?")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert "config.yaml" in res.stderr and "no_such_key" in res.stderr


def test_a_search_hit_is_one_line_and_a_cut_says_so() -> None:
    from ragtrain.search import hit_line

    h = {"rank": 1, "score": 0.5, "id": "doc#3", "title": "T", "text": "Namesakes\n\nNot to be   confused"}
    assert hit_line(h) == "  1  0.5000  doc#3  T: Namesakes Not to be confused"
    long = hit_line({**h, "text": "word " * 100}, width=40)
    assert long.endswith("...") and len(long.split("  doc#3  ")[1]) == 40


def test_the_mlflow_model_embeds_documents_and_queries_with_their_prefixes(tmp_path: Path) -> None:
    # MLflow's default signature has no params: a prompt_name passed to predict() was dropped, and neither side
    # got its prefix (cosine 0.96 against ragtrain's vectors)
    import mlflow.pyfunc

    from ragtrain.track.mlflow import save_retriever_model

    r = RetrieverConfig(
        model="tiny",
        tiny=TINY,
        query_prefix="query: ",
        passage_prefix="passage: ",
        query_max_length=48,
        passage_max_length=48,
    )
    folder, ours, _ = _export_and_compare(tmp_path, r)
    save_retriever_model(folder, tmp_path / "mlflow_model")
    pyfunc = mlflow.pyfunc.load_model(str(tmp_path / "mlflow_model"))
    torch.manual_seed(0)
    model = build_encoder(r)
    q_ours = encode_texts(model, load_tokenizer(r), TEXTS[:1], r.query_max_length, role="query")
    docs = torch.tensor(pyfunc.predict(TEXTS), dtype=torch.float32)  # the default: documents
    query = torch.tensor(pyfunc.predict(TEXTS[:1], params={"prompt_name": "query"}), dtype=torch.float32)
    assert torch.nn.functional.cosine_similarity(docs, ours).min().item() >= 0.9999
    assert torch.nn.functional.cosine_similarity(query, q_ours).min().item() >= 0.9999


def test_search_on_an_index_of_another_dimension_fails_in_one_line(finished_run, tmp_path: Path) -> None:
    # an index folder from another run (or a config edited after the index was built): a FAISS assertion before
    import shutil
    from dataclasses import asdict

    import numpy as np

    from ragtrain.index.faiss_index import build_index
    from ragtrain.index.integrity import seal_shard_list, sha256_file
    from ragtrain.index.sharded import MANIFEST, SHARDED, open_saved, persist

    cfg, _, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(cfg.output_dir, run, ignore=shutil.ignore_patterns("mlflow*", "checkpoints"))
    saved = open_saved(run / "index")
    other = np.random.default_rng(0).standard_normal((len(saved.doc_ids), 8)).astype(np.float32)
    built = build_index(other, saved.doc_ids, "Flat", saved.meta.corpus_fingerprint, saved.meta.encoder)
    shutil.rmtree(run / "index")  # the same layout as a run's (one index shard), with 8-dim vectors
    n = len(saved.doc_ids)
    meta = built.meta
    about = {"shard": 0, "start": 0, "stop": n, "version": 1, "encoder": meta.encoder}
    m = persist(built, run / "index" / "shard-0", {**about, "corpus_fingerprint": meta.corpus_fingerprint})
    (run / "index" / "index_meta.json").write_text(json.dumps(asdict(meta)))
    entry = {"shard": 0, "folder": "shard-0", "start": 0, "stop": n, "rows": n, "version": 1, "checksum": m["checksum"]}
    entry["manifest"] = sha256_file(run / "index" / "shard-0" / MANIFEST)  # sealed as a save seals its list
    listed = {"shards": [entry], "index_meta": sha256_file(run / "index" / "index_meta.json")}
    (run / "index" / SHARDED).write_text(json.dumps(seal_shard_list(listed)))
    open_saved(run / "index")  # a well-formed saved index: only its dimension differs from the run's encoder
    res = _search(str(run), "who founded it?")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert "the index holds 8-dim vectors but the run's encoder" in res.stderr


@pytest.mark.parametrize(
    ("broken", "names", "says"),
    [
        ("corpus/passages.arrow", "corpus/passages.arrow", "not a readable "),
        # an index file is checked against its shard's manifest before FAISS reads it
        ("index/shard-0/index.faiss", "index/shard-0", "is corrupt"),
    ],
)
def test_search_on_a_truncated_file_names_it_in_one_line(
    finished_run, tmp_path: Path, broken: str, names: str, says: str, capsys
) -> None:
    """Arrow's and FAISS's own tracebacks before."""
    import shutil

    cfg, _, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(cfg.output_dir, run, ignore=shutil.ignore_patterns("mlflow*", "checkpoints"))
    data = (run / broken).read_bytes()
    (run / broken).write_bytes(data[: len(data) // 2])
    from ragtrain.search import main  # the CLI's own entry point, in this process (the subprocess form is above)

    assert main([str(run), "who founded it?"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0, err
    assert err.startswith("search error: ") and str(run / names) in err and says in err and "corrupt" in err


def test_search_of_a_run_that_did_not_finish_says_so(finished_run, tmp_path: Path, capsys) -> None:
    import shutil

    cfg, _, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(cfg.output_dir, run, ignore=shutil.ignore_patterns("mlflow*", "checkpoints"))
    assert json.loads((run / "status.json").read_text())["status"] == "complete"  # searched without a warning above
    (run / "status.json").write_text(json.dumps({"status": "running"}))
    from ragtrain.search import main

    assert main([str(run), "who founded it?", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["hits"]  # it still answers
    assert (
        err.strip() == f"warning: {run / 'status.json'} says the run is 'running': it is still running or "
        "was stopped before it finished, so its index may not be the trained one"
    )


@pytest.mark.parametrize(
    ("readme", "want"),
    [
        (None, None),  # no card
        ("# a model\n", None),  # no front matter
        ("---\n---\n# a model\n", None),  # empty front matter
        ("---\n- a\n- b\n---\n", None),  # front matter that is not a mapping
        ("---\nlicense: [mit\n---\n", None),  # not YAML
        ("---\nlicense: mit\n---\n", "mit"),
        ('---\nlicense: "CC BY-NC 4.0: see LICENSE"\n---\n', "CC BY-NC 4.0: see LICENSE"),
        ("---\nlicense: [mit, apache-2.0]\n---\n", "mit, apache-2.0"),
    ],
)
def test_the_base_license_is_read_from_any_card_or_none(tmp_path: Path, readme: str | None, want: str | None) -> None:
    """A base model's card may lack front matter or a license, or hold a list: the export never fails on it."""
    from ragtrain.pipeline.export import base_license

    if readme is not None:
        (tmp_path / "README.md").write_text(readme)
    assert base_license(tmp_path) == want
    assert base_license(tmp_path / "no-such-folder") is None  # neither a folder nor a cached Hub card


def test_a_license_of_free_text_stays_one_yaml_value_in_the_generator_card(tmp_path: Path) -> None:
    """The card's front matter quotes the base model's license: `a: b` or `# note` in it must not break the YAML
    (mlflow reads the card back) nor be cut."""
    import yaml

    from ragtrain.pipeline.export import generator_card

    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text('---\nlicense: "CC BY-NC 4.0: see LICENSE # and more"\n---\n')
    cfg = to_typed(compose(["generator=t5_pretrained", f"generator.model={base}", f"output_dir={tmp_path}"]))
    card = generator_card(cfg, "data", "table", "command")
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["license"] == "CC BY-NC 4.0: see LICENSE # and more" and front["library_name"] == "transformers"
    assert "(license: CC BY-NC 4.0: see LICENSE # and more)" in card
