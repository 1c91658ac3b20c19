"""Use what was trained: the sentence-transformers export gives ragtrain's vectors, MLflow holds the model (and the
registry its version). `python -m ragtrain search` on the same finished run's folder: tests/commands/test_search.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ragtrain.config import Config, to_typed
from ragtrain.config.retriever import Pooling, RetrieverConfig, TinyEncoderConfig
from ragtrain.embed.model import build_encoder, encode_texts, load_tokenizer
from ragtrain.pipeline.export import export_retriever
from tests.conftest import REGISTERED_MODEL, compose

TEXTS = [
    "Who founded the Velmora observatory?",
    "The Velmora observatory was founded in 1871 by Ada Quist. " * 6,
    "short",
    "Another passage about the river Tessin and the mill that stood on its bank for three centuries.",
]
TINY = TinyEncoderConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, dropout=0.0)


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


# --- a real tiny run: export, MLflow model + registry

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
    for name in ("predictions.json", "per_question.jsonl"):  # the run's results stay out of the export
        (tmp_path / "generator" / name).write_text("{}")
    folder = export_generator(tmp_path / "generator", tmp_path / "export" / "generator")
    assert not (folder / "predictions.json").exists() and (folder / "config.json").exists()
    assert not (folder / "per_question.jsonl").exists()
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
