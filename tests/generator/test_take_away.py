"""The trained generator leaves the run as a Hugging Face model folder and, for causal LMs, as an MLflow
transformers model in the run (real SQLite store): both load without ragtrain and compute the same logits."""

from __future__ import annotations

from pathlib import Path

import torch

from ragtrain.config import LoggerConfig
from ragtrain.config.generator import Arch, GeneratorConfig, PromptStyle
from ragtrain.export import export_generator
from ragtrain.generator.model import build_generator, load_tokenizer
from ragtrain.generator.train import save_generator
from ragtrain.track.mlflow import RunLogger, open_client
from tests.conftest import mlflow_db
from tests.generator.tiny_llama import save_tiny_llama


def test_causal_generator_is_logged_as_an_mlflow_transformers_model(tmp_path: Path) -> None:
    import mlflow.transformers

    g = GeneratorConfig(arch=Arch.causal, model=str(save_tiny_llama(tmp_path / "base")), prompt=PromptStyle.chat)
    tok = load_tokenizer(g)
    torch.manual_seed(0)
    model = build_generator(g, tok).eval()
    with torch.no_grad():  # stands in for fine-tuning: the logged weights must be these, not the base model's
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_generator(model, tok, tmp_path / "run" / "generator")
    (tmp_path / "run" / "generator" / "predictions.json").write_text("{}")
    folder = export_generator(tmp_path / "run" / "generator", tmp_path / "run" / "export" / "generator")

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
    ids = torch.tensor([tok("where is warsaw?")["input_ids"]])
    with torch.no_grad():
        want = model.hf(input_ids=ids).logits
        got = parts["model"].eval()(input_ids=ids).logits
    assert torch.allclose(want, got, atol=1e-6)
    assert parts["tokenizer"].chat_template == tok.chat_template
