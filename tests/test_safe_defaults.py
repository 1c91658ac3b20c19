"""Safe defaults: the embedded Ray binds 127.0.0.1 by itself, data paths do not depend on the cwd."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import REPO, compose

SHARED_DATA = (REPO.parent / "shared" / "data").resolve()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO), **extra})
    return env


PROBE = (
    "import os, ragtrain.__main__, ray._private.ray_constants as c; "
    "print(os.environ.get('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER'), c.ENABLE_RAY_CLUSTER)"
)


def test_embedded_ray_starts_on_loopback_without_the_env_var(tmp_path: Path) -> None:
    """A process that imports the entry point and starts the embedded Ray (init_ray) gets a 127.0.0.1 node,
    with nothing set by the user; the test environment's own setting is removed first."""
    code = (
        "import ragtrain.__main__, ray; from ragtrain.cluster.resources import init_ray; "
        "from ragtrain.config import ResourcesConfig; init_ray(ResourcesConfig(num_cpus=1)); "
        "print('node', ray.util.get_node_ip_address()); "
        "print('watcher', ray.get_runtime_context().runtime_env['env_vars'].get('RAY_TRAIN_ENABLE_PREEMPTION_WATCHER'))"
        "; ray.shutdown()"
    )
    env = _env()
    env.pop("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", None)  # (the tests' conftest sets it for their own Ray)
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "node 127.0.0.1" in res.stdout
    # one machine drains no nodes: no preemption watcher actor per fit (Train V2 reads this in its controller)
    assert "watcher 0" in res.stdout


def test_a_cluster_address_keeps_rays_own_networking(tmp_path: Path) -> None:
    plain = subprocess.run(
        [sys.executable, "-c", PROBE], env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert plain.stdout.split() == ["0", "False"], plain.stderr[-2000:]
    cluster = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=_env(RAY_ADDRESS="ray://head:10001"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cluster.stdout.split() == ["None", "True"], cluster.stderr[-2000:]


def _scifact_root(overrides: list[str]) -> str:
    return OmegaConf.to_container(compose(["data=scifact", *overrides]).data, resolve=True)["root"]


def test_default_data_root_is_relative_to_the_project_not_the_cwd(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("RAGTRAIN_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    assert _scifact_root([]) == str(SHARED_DATA / "scifact")
    monkeypatch.setenv("RAGTRAIN_DATA", "elsewhere/beir")  # relative: from the project root too
    assert _scifact_root([]) == str((REPO / "elsewhere" / "beir" / "scifact").resolve())
    monkeypatch.setenv("RAGTRAIN_DATA", str(tmp_path / "beir"))
    assert _scifact_root([]) == str(tmp_path / "beir" / "scifact")
    assert _scifact_root(["data.root=/data/x"]) == "/data/x"  # an explicit data.root still wins


def test_the_cli_composes_the_same_data_root_from_another_cwd(tmp_path: Path) -> None:
    env = _env()
    env.pop("RAGTRAIN_DATA", None)
    res = subprocess.run(
        [sys.executable, "-m", "ragtrain", "data=scifact", f"output_dir={tmp_path}", "--cfg", "job", "--resolve"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    data = OmegaConf.create(res.stdout).data
    assert data.root == str(SHARED_DATA / "scifact")


@pytest.mark.parametrize("key", ["query_prefix", "passage_prefix"])
def test_prefixes_are_retriever_keys(key: str) -> None:
    cfg = compose(["retriever=tiny", f"retriever.{key}='query: '"])  # quoted: Hydra trims bare values
    assert cfg.retriever[key] == "query: "


def test_the_encode_path_prefixes_queries_and_passages(ray_session) -> None:
    """The corpus actors' class (passages) and its in-driver twin (queries) apply their own prefix, and only it."""
    import numpy as np
    import torch

    from ragtrain.config.retriever import RetrieverConfig
    from ragtrain.embed.encoders import EncodeBatch, QueryEncoder
    from ragtrain.embed.model import build_encoder, encode_texts, load_tokenizer

    r = RetrieverConfig(model="tiny", query_prefix="query: ", passage_prefix="passage: ")
    torch.manual_seed(0)
    model = build_encoder(r)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plain = load_tokenizer(RetrieverConfig(model="tiny"))

    def by_hand(texts: list[str]) -> np.ndarray:
        return encode_texts(model, plain, texts, 32).numpy()

    text = "the mill on the river Tessin"
    q = QueryEncoder(r, [weights]).encode([text], 32, role="query")
    np.testing.assert_allclose(q, by_hand([f"query: {text}"]), atol=1e-5)
    table = EncodeBatch(r, weights, 32)({"id": np.array(["d1"]), "text": np.array([text])})
    p = np.asarray(table.column("vector").to_pylist(), dtype=np.float32)
    np.testing.assert_allclose(p, by_hand([f"passage: {text}"]), atol=1e-5)
    assert not np.allclose(p, by_hand([text]), atol=1e-3)  # the prefix changes the vector


def test_prefixes_compose_with_live_refresh_and_distillation() -> None:
    """Both tokenise by role now (the pool: tests/index/test_pool.py; distill: tests/repair/test_distill.py)."""
    from ragtrain.config import to_typed

    cfg = to_typed(
        compose(
            [
                "retriever=tiny",
                "retriever.query_prefix='query: '",
                "refresh.enabled=true",
                "output_dir=x",
                "refresh.every_steps=2",
            ]
        )
    )
    assert cfg.retriever.query_prefix == "query: " and cfg.refresh.enabled


@pytest.mark.parametrize("extra", [["logger=none"], ["export=false"]])
def test_register_as_without_mlflow_or_export_is_a_config_error(extra: list[str]) -> None:
    from ragtrain.config import to_typed
    from ragtrain.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="logger.register_as"):
        to_typed(compose(["retriever=tiny", "logger.register_as=my-retriever", "output_dir=x", *extra]))
