"""ragtrain/commands/variants.py with experiment=sync_compare end to end (tiny encoder): one MLflow run per strategy,
table + plot that match them."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from ragtrain.commands.variants import paired_answers, run_variants
from ragtrain.config import to_typed
from ragtrain.config.variants import override_variants, sync_variants
from ragtrain.runtime.errors import ConfigError
from ragtrain.track.report import write_comparison
from tests.conftest import CONF_DIR, compose, tiny_overrides


@pytest.mark.slow(reason="an end-to-end run of its own, beyond the default suite's budget (make test-slow)")
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


def _answers(
    folder: Path, stage: str, hits: list[bool], qids: tuple[str, ...] = ("a", "b", "c", "d"), moved: int = 0
) -> None:
    """rag answers to 4 questions, right where `hits`; the first `moved` prompts hold another passage."""
    rows = [
        {"qid": q, "question": "?", "prediction": "Paris" if hit else "Rome", "answers": ["Paris"],
         "passages": ["p2" if i < moved else "p1"]}
        for i, (q, hit) in enumerate(zip(qids, hits))
    ]  # fmt: skip
    (folder / stage).mkdir(parents=True)
    (folder / stage / "predictions.json").write_text(json.dumps({"rag": rows}))


def test_squad_rag_comparison_pairs_each_variant_with_frozen_per_question_and_seed(tmp_path: Path, caplog) -> None:
    variants = override_variants(
        compose(["experiment=squad_rag", f"output_dir={tmp_path}", "compare.only=[retrieval,frozen,joint_query]"])
    )
    assert list(variants) == [f"{v}/seed={s}" for v in ("retrieval", "frozen", "joint_query") for s in (0, 1)]
    out = {label: Path(cfg.output_dir) for label, cfg in variants.items()}
    _answers(out["frozen/seed=0"], "generator", [True, False, False, False])
    _answers(out["frozen/seed=1"], "generator", [True, True, False, False])
    _answers(out["joint_query/seed=0"], "joint", [True, True, True, False], moved=3)  # 2 better
    _answers(out["joint_query/seed=1"], "joint", [False, True, False, False], moved=1)  # 1 worse
    section = paired_answers(variants)  # the retrieval-only variant saved no answers: not in the table
    assert section.startswith("## rag/em paired against frozen, per question over 2 seed(s)")
    row = next(line for line in section.splitlines() if line.startswith("| joint_query"))
    assert "+0.1250" in row and "2 / 1" in row and "(8 questions, paired bootstrap)" in section
    assert "| retrieval" not in section
    assert "Prompts (rag) holding other passages than frozen's: joint_query 4 of 8." in section
    df = pd.DataFrame([{"strategy": "frozen", "seed": 0, "rag/em": 0.25}, {"strategy": "joint_query", "seed": 0}])
    write_comparison(df, tmp_path, "squad_rag", [section, ""])
    md = (tmp_path / "comparison.md").read_text()
    assert md.count("## rag/em paired against frozen") == 1 and md.rstrip().endswith("joint_query 4 of 8.")
    # a variant scored on other questions: the comparison is still written, with one warning line and no section
    (out["joint_query/seed=1"] / "joint" / "predictions.json").unlink()
    _answers(out["joint_query/seed=1"], "generator", [True] * 4, qids=("a", "b", "c", "e"))
    assert paired_answers(variants) == ""
    assert "no paired rag/em section" in caplog.text and "other queries" in caplog.text
