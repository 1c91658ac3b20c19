"""`python -m ragtrain experiment=squad_rag ... 'data.test_titles=[Super_Bowl_50,Warsaw]' data.split=test`'s
overrides, composed as the command composes them, on a small SQuAD v1.1 file that asks questions about those two
articles: the shipped MiniLM indexes every paragraph (real Ray, real FAISS, real MLflow SQLite store) and only those
articles' questions are evaluated."""

from __future__ import annotations

import json
from pathlib import Path

from ragtrain.index.sharded import open_saved
from tests.conftest import mlflow_db
from tests.data.test_squad import qa

SB = "Super Bowl 50 was played in 2016. The Denver Broncos defeated the Carolina Panthers 24-10 to win it."
SB2 = "The game was played at Levi's Stadium in Santa Clara, California."
WARSAW = "Warsaw is the capital of Poland. The Vistula river flows through the city."
OTHER = ["Normans came from Normandy in France.", "Oxygen is a chemical element with symbol O."]


def squad_file(path: Path) -> None:
    data = [
        {
            "title": "Super_Bowl_50",
            "paragraphs": [
                {"context": SB, "qas": [qa("s1", "Who won Super Bowl 50?", SB, "Denver Broncos", "Broncos")]},
                {"context": SB2, "qas": [qa("s2", "Where was Super Bowl 50 played?", SB2, "Santa Clara, California")]},
            ],
        },
        {"title": "Warsaw", "paragraphs": [{"context": WARSAW, "qas": [qa("w1", "Which river?", WARSAW, "Vistula")]}]},
        {
            "title": "Normans",
            "paragraphs": [{"context": OTHER[0], "qas": [qa("n1", "From where?", OTHER[0], "Normandy")]}],
        },
        {"title": "Oxygen", "paragraphs": [{"context": OTHER[1], "qas": [qa("o1", "Its symbol?", OTHER[1], "O")]}]},
        {"title": "Held", "paragraphs": [{"context": "A paragraph no question asks about.", "qas": []}]},
    ]
    path.write_text(json.dumps({"version": "1.1", "data": data}))


def test_the_squad_rag_command_evaluates_the_named_articles_with_every_paragraph_indexed(ray_session, tmp_path) -> None:
    """The command's overrides, composed as `python -m ragtrain` composes them and run on the test session's Ray
    (a subprocess would start a Ray cluster and import everything again; the CLI's own path is tested in
    tests/test_checks.py and by the experiments' slow tests)."""
    from ragtrain.commands.variants import run_variants
    from ragtrain.config.variants import override_variants
    from tests.conftest import compose

    (tmp_path / "squad").mkdir()
    squad_file(tmp_path / "squad" / "dev-v1.1.json")
    out = tmp_path / "out"
    args = [
        "experiment=squad_rag",
        f"data.root={tmp_path / 'squad'}",
        "data.test_titles=[Super_Bowl_50,Warsaw]",
        "data.split=test",
        "compare.only=[retrieval]",  # the retrieval-only evaluation, not the experiment's four RAG variants
        "compare.seeds=[]",  # once: the shipped encoder's index does not depend on the seed
        "data.dev_articles=1",  # of the file's 4 articles with questions; the shipped 4 would leave no train article
        f"output_dir={out}",
        f"logger.tracking_uri={mlflow_db(tmp_path / 'mlflow.db')}",
        "resources.num_cpus=4",  # the test session's Ray cluster (tests/conftest.py: RAY_CPUS)
        # the experiment's vector cache is relative to the working folder: one left there by an earlier run would
        # skip the encode this test covers (and the test would write into the checkout)
        f"index.cache_dir={tmp_path / 'cache'}",
        "resources.pool.num_actors=1",  # one encode actor for 6 passages: each loads torch and MiniLM (~4 CPU-s)
    ]
    variants = override_variants(compose(args))  # as the CLI dispatches an experiment with variants
    assert list(variants) == ["retrieval"]
    run_variants(variants, out)
    out = out / "retrieval"  # the variant's folder
    assert open_saved(out / "index").doc_ids == [
        "Super_Bowl_50#0",
        "Super_Bowl_50#1",
        "Warsaw#0",
        "Normans#0",
        "Oxygen#0",
        "Held#0",
    ]
    assert "3 test queries" in (out / "ragtrain.log").read_text()  # s1, s2, w1: the two articles' questions only
    m = json.loads((out / "metrics.json").read_text())["zeroshot"]
    assert {"ndcg@10", "recall@100", "answer_recall@1", "answer_recall@5", "answer_recall@100"} <= set(m)
    # 6 passages: every gold paragraph and answer is within the top 100, and MiniLM finds these easy ones first
    assert m["recall@100"] == 1.0 and m["answer_recall@100"] == 1.0
    assert m["answer_recall@5"] == 1.0 and m["ndcg@10"] > 0.5
