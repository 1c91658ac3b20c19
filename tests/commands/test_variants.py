"""ragtrain/commands/variants.py with experiment=sync_compare end to end (tiny encoder): one MLflow run per strategy,
table + plot that match them."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from ragtrain.commands.variants import PAIRED_METRICS, paired_answers, run_variants, write_paired
from ragtrain.config import to_typed
from ragtrain.config.variants import override_variants, sync_variants
from ragtrain.eval.per_question import write_per_question
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
    folder: Path,
    stage: str,
    hits: list[bool],
    qids: tuple[str, ...] = ("a", "b", "c", "d"),
    moved: int = 0,
    nll: list[float] | None = None,
) -> None:
    """rag answers to 4 questions, right where `hits`; the first `moved` prompts hold another passage. With `nll`:
    the run's per_question.jsonl too, written as the stage writes it, with the answer likelihood of 6 questions
    (the 4 and two outside EM's sample)."""
    rows = [
        {"qid": q, "question": "?", "prediction": "Paris" if hit else "Rome", "answers": ["Paris"],
         "passages": ["p2" if i < moved else "p1"]}
        for i, (q, hit) in enumerate(zip(qids, hits))
    ]  # fmt: skip
    predictions: dict[str, list] = {"rag": rows}
    (folder / stage).mkdir(parents=True)
    (folder / stage / "predictions.json").write_text(json.dumps(predictions))
    if nll is not None:
        predictions["likelihood"] = [
            {"qid": q, "rag_nll": v, "rag_nll_top1": v + 0.5, "oracle_nll": 1.0} for q, v in zip(qids + ("e", "f"), nll)
        ]
        write_per_question(folder / stage, predictions)


NLL = [2.0, 1.5, 3.0, 2.5, 1.0, 4.0]


def test_squad_rag_comparison_pairs_each_variant_with_frozen_per_question_and_seed(tmp_path: Path, caplog) -> None:
    variants = override_variants(
        compose(["experiment=squad_rag", f"output_dir={tmp_path}", "compare.only=[retrieval,joint_query,frozen]"])
    )
    assert list(variants) == [f"{v}/seed={s}" for v in ("retrieval", "joint_query", "frozen") for s in (0, 1)]
    out = {label: Path(cfg.output_dir) for label, cfg in variants.items()}
    _answers(out["frozen/seed=0"], "generator", [True, False, False, False], nll=NLL)
    _answers(out["frozen/seed=1"], "generator", [True, True, False, False], nll=NLL)
    # 2 better at seed 0, 1 worse at seed 1; a likelihood lower by 0.3 nats on every question at both seeds
    _answers(out["joint_query/seed=0"], "joint", [True, True, True, False], moved=3, nll=[v - 0.3 for v in NLL])
    _answers(out["joint_query/seed=1"], "joint", [False, True, False, False], moved=1, nll=[v - 0.3 for v in NLL])
    pairs, section = paired_answers(variants)  # the retrieval-only variant saved no answers: not in the table
    assert section.startswith("## Paired against frozen, per question and seed")  # frozen, though listed second
    assert "| retrieval" not in section and "(2 seed(s), pooled)" in section
    rows = {r.split("|")[2].strip(): [c.strip() for c in r.split("|")[1:-1]] for r in section.splitlines()
            if r.startswith("| joint_query")}  # fmt: skip
    assert rows["rag/em"][2:6] == ["8", "0.3750", "0.5000", "+0.1250"] and rows["rag/em"][7:] == ["no", "2 / 1"]
    assert rows["likelihood/rag_nll"][2] == "12" and rows["likelihood/rag_nll"][5:] == [
        "-0.3000", "[-0.3000, -0.3000]", "yes", "12 / 0"]  # fmt: skip
    assert rows["likelihood/oracle_nll"][5:] == ["+0.0000", "[+0.0000, +0.0000]", "no", "0 / 0"]
    assert "Prompts (rag) holding other passages than frozen's: joint_query 4 of 8." in section
    (path,) = write_paired(pairs, tmp_path)
    csv = pd.read_csv(path).set_index(["variant", "metric"])
    assert list(csv.index) == [("joint_query", m) for m in PAIRED_METRICS]
    assert csv.loc[("joint_query", "likelihood/rag_nll"), "significant"] and not csv.loc[("joint_query", "rag/f1"),
                                                                                         "significant"]  # fmt: skip
    df = pd.DataFrame([{"strategy": "frozen", "seed": 0, "rag/em": 0.25}, {"strategy": "joint_query", "seed": 0}])
    write_comparison(df, tmp_path, "squad_rag", [section, ""])
    md = (tmp_path / "comparison.md").read_text()
    assert md.count("## Paired against frozen") == 1 and md.rstrip().endswith("joint_query 4 of 8.")
    # a variant scored on other questions: the comparison is still written, with one warning line and no section
    (out["joint_query/seed=1"] / "joint" / "predictions.json").unlink()
    (out["joint_query/seed=1"] / "joint" / "per_question.jsonl").unlink()
    _answers(out["joint_query/seed=1"], "generator", [True] * 4, qids=("a", "b", "c", "e"))
    assert paired_answers(variants) == ([], "") and write_paired([], tmp_path) == []
    assert "no paired section" in caplog.text and "other questions" in caplog.text
