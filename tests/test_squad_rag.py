"""`python -m ragtrain experiment=squad_rag ... 'data.test_titles=[Super_Bowl_50,Warsaw]' data.split=test`, as users
type it, on a small SQuAD v1.1 file that asks questions about those two articles: the shipped MiniLM indexes every
paragraph (real Ray, real FAISS, real MLflow SQLite store) and only those articles' questions are evaluated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, mlflow_db
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


def test_the_squad_rag_command_evaluates_the_named_articles_with_every_paragraph_indexed(tmp_path: Path) -> None:
    (tmp_path / "squad").mkdir()
    squad_file(tmp_path / "squad" / "dev-v1.1.json")
    out = tmp_path / "out"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    args = [
        "experiment=squad_rag",
        f"data.root={tmp_path / 'squad'}",
        "data.test_titles=[Super_Bowl_50,Warsaw]",
        "data.split=test",
        "compare.only=[retrieval]",  # the retrieval-only evaluation, not the experiment's four RAG variants
        "data.dev_articles=1",  # of the file's 4 articles with questions; the shipped 4 would leave no train article
        f"output_dir={out}",
        f"logger.tracking_uri={mlflow_db(tmp_path / 'mlflow.db')}",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "ragtrain", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-4000:]
    out = out / "retrieval"  # the variant's folder
    assert (out / "index" / "doc_ids.txt").read_text().split() == [
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
