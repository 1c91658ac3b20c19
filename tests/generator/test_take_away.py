"""The trained generator leaves the run as a Hugging Face model folder and, for causal LMs, as an MLflow
transformers model in the run (real SQLite store): both load without ragtrain and compute the same logits."""

from __future__ import annotations

from pathlib import Path

import torch

from ragtrain.config import to_typed
from ragtrain.config.logger import LoggerConfig
from ragtrain.generator.model import build_generator, load_tokenizer
from ragtrain.generator.saved import save_generator
from ragtrain.pipeline.export import export_generator, generator_card
from ragtrain.track.mlflow import RunLogger, open_client
from tests.conftest import compose, mlflow_db
from tests.generator.tiny_llama import save_tiny_llama


def test_causal_generator_is_logged_as_an_mlflow_transformers_model(tmp_path: Path, capfd) -> None:
    """The export carries its card (README.md) and the base model's declared license into the MLflow model: MLflow
    asks the Hub for neither (it warned twice for every run, offline or not)."""
    import mlflow.transformers

    base = save_tiny_llama(tmp_path / "base")
    (base / "README.md").write_text("---\nlicense: mit\n---\n# tiny llama\n")
    cfg = to_typed(
        compose(["generator=smollm2", f"generator.model={base}", f"output_dir={tmp_path}", "stages=[generator]"])
    )
    g = cfg.generator
    tok = load_tokenizer(g)
    torch.manual_seed(0)
    model = build_generator(g, tok).eval()
    with torch.no_grad():  # stands in for fine-tuning: the logged weights must be these, not the base model's
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_generator(model, tok, tmp_path / "run" / "generator")
    (tmp_path / "run" / "generator" / "predictions.json").write_text("{}")
    card = generator_card(
        cfg, "squad: 3 passages", "metric    rag\n--------  ------\nem        0.5000", "python -m ragtrain"
    )
    folder = export_generator(tmp_path / "run" / "generator", tmp_path / "run" / "export" / "generator", card)
    text = (folder / "README.md").read_text()
    assert text.startswith('---\nlibrary_name: transformers\npipeline_tag: text-generation\nlicense: "mit"\n')
    assert f"**Base model**: {base} (license: mit)" in text and "em        0.5000" in text
    assert f"{g.train.max_steps} steps, global batch {g.train.batch_size * cfg.resources.trainer.num_workers}" in text

    uri = mlflow_db(tmp_path / "mlflow.db")
    logger = RunLogger(LoggerConfig(tracking_uri=uri, experiment_name="take_away"), run_name="gen")
    model_uri = logger.log_generator_model(folder, causal=True)
    logger.end()
    assert model_uri == f"runs:/{logger.run_id}/export/generator"
    assert open_client(uri).get_run(logger.run_id).data.tags["ragtrain.generator_model"] == model_uri

    mlflow.set_tracking_uri(uri)
    try:
        parts = mlflow.transformers.load_model(model_uri, return_type="components")
    finally:
        mlflow.set_tracking_uri(None)
    assert parts["task"] == "text-generation"
    err = capfd.readouterr().err
    assert "model card could not be retrieved" not in err and "Unable to find license" not in err
    saved = Path(mlflow.artifacts.download_artifacts(model_uri, tracking_uri=uri))
    assert "license: mit" in (saved / "model_card_data.yaml").read_text()
    assert "The declared license type is: 'mit'" in (saved / "LICENSE.txt").read_text()
    ids = torch.tensor([tok("where is warsaw?")["input_ids"]])
    with torch.no_grad():
        want = model.hf(input_ids=ids).logits
        got = parts["model"].eval()(input_ids=ids).logits
    assert torch.allclose(want, got, atol=1e-6)
    assert parts["tokenizer"].chat_template == tok.chat_template
