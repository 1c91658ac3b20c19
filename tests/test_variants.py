"""ragtrain.variants with experiment=sync_compare end to end (tiny encoder): one MLflow run per strategy, table + plot
that match them."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from ragtrain.config import ConfigError, sync_variants, to_typed
from ragtrain.variants import run_variants
from tests.conftest import CONF_DIR, compose, tiny_overrides


@pytest.mark.slow  # an end-to-end run of its own, beyond the default suite's budget (make test-slow)
def test_sync_compare_writes_table_matching_mlflow(ray_session, tmp_path: Path) -> None:
    cfg = compose(
        [
            "experiment=sync_compare",
            *tiny_overrides(tmp_path),
            "compare.strategies=[ddp,local_sgd,topk]",
            "logger.experiment_name=sc-test",
        ]
    )
    variants = sync_variants(cfg, str(CONF_DIR))
    assert list(variants) == ["ddp", "local_sgd", "topk"]
    assert variants["topk"].sync.reducer.kind == "topk" and variants["topk"].sync.eval_every == 5
    assert [v.zeroshot_eval for v in variants.values()] == [True, False, False]
    df = run_variants(variants, to_typed(cfg).output_dir)

    out = Path(to_typed(cfg).output_dir)
    csv = pd.read_csv(out / "comparison.csv")
    assert list(csv["strategy"]) == ["ddp", "local_sgd", "topk"]
    assert (out / "comparison.png").stat().st_size > 1000
    assert "| ddp" in (out / "comparison.md").read_text()
    # Fewer bytes than DDP for the strategies that exist to send fewer bytes.
    by = csv.set_index("strategy")["comm/bytes_per_step"]
    assert by["local_sgd"] < by["ddp"] and by["topk"] < by["ddp"]
    assert csv.set_index("strategy").loc["ddp", "drift/param_divergence_mean"] < 1e-6

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sc-test")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert {"sync_compare/ddp", "sync_compare/local_sgd", "sync_compare/topk", "sync_compare/comparison"} <= set(runs)
    for name, row in csv.set_index("strategy").iterrows():
        m = runs[f"sync_compare/{name}"].data.metrics
        assert m["trained/ndcg_at_10"] == pytest.approx(row["ndcg@10"])
        assert m["run/comm/bytes_per_step"] == pytest.approx(row["comm/bytes_per_step"])
        assert runs[f"sync_compare/{name}"].data.params["sync.strategy"] == variants[name].sync.strategy
    arts = {a.path for a in client.list_artifacts(runs["sync_compare/comparison"].info.run_id)}
    assert {"comparison.csv", "comparison.md", "comparison.png"} <= arts
    assert len(df) == 3


def test_unknown_strategy_in_compare_lists_choices(tmp_path: Path) -> None:
    cfg = compose(["experiment=sync_compare", f"output_dir={tmp_path}", "compare.strategies=[ddp,warp]"])
    with pytest.raises(ConfigError) as e:
        sync_variants(cfg, str(CONF_DIR))
    assert "warp" in str(e.value) and "powersgd" in str(e.value)
