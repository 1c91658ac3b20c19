"""Tests for the synthetic fictional-people KB: determinism, splits, answers and sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from ragtrain.data import DataError, RetrievalData, load_beir, make_synthetic, write_beir
from ragtrain.data.synthetic import RELATIONS

REPO = Path(__file__).resolve().parents[2]


def _entity_of(data: RetrievalData, qrels: dict[str, dict[str, int]]) -> set[str]:
    """Entity names (passage titles) asked about in ``qrels``."""
    return {data.corpus[d].title for grades in qrels.values() for d in grades}


def test_deterministic_within_process() -> None:
    a, b = make_synthetic(60, seed=3), make_synthetic(60, seed=3)
    assert a == b
    assert list(a.corpus) == list(b.corpus) and list(a.queries) == list(b.queries)
    assert a.fingerprint() == b.fingerprint()
    assert make_synthetic(60, seed=4).fingerprint() != a.fingerprint()


def test_deterministic_across_hash_seeds() -> None:
    code = (
        "import hashlib, json; from ragtrain.data import make_synthetic; d = make_synthetic(50, seed=7);"
        "print(d.fingerprint(), hashlib.sha256(json.dumps([d.queries, d.answers, d.train_qrels, d.eval_qrels])"
        ".encode()).hexdigest())"
    )
    outs = set()
    for hash_seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-c", code]
        res = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=True)
        outs.add(res.stdout)
    assert len(outs) == 1


def test_sizes_ids_and_names() -> None:
    n = 40
    data = make_synthetic(n)
    assert len(data.corpus) == len(data.queries) == len(data.answers) == n * len(RELATIONS)
    assert list(data.corpus)[:2] == ["d0001", "d0002"] and list(data.queries)[0] == "q0001"
    names = [data.corpus[d].title for d in list(data.corpus)[:: len(RELATIONS)]]
    assert len(set(names)) == n  # unique full names
    # Some first or last name parts are shared, so the name alone is not a shortcut.
    firsts, lasts = Counter(x.split()[0] for x in names), Counter(x.split()[1] for x in names)
    assert max(firsts.values()) > 1 or max(lasts.values()) > 1
    for p in data.corpus.values():
        assert p.title in p.text and 15 <= len(p.text.split()) <= 30


def test_entity_disjoint_splits() -> None:
    n = 100
    parts = {s: make_synthetic(n, split=s) for s in ("train", "dev", "test")}
    train = parts["train"]
    assert train.eval_qrels == train.train_qrels
    ents = {s: _entity_of(d, d.eval_qrels) for s, d in parts.items()}
    assert not ents["train"] & ents["dev"] and not ents["train"] & ents["test"] and not ents["dev"] & ents["test"]
    assert len(ents["dev"]) == 15 and len(ents["test"]) == 15 and len(ents["train"]) == 70
    # Each entity contributes one question per relation; all questions are in exactly one split.
    qids = [q for d in parts.values() for q in d.eval_qrels]
    assert len(qids) == len(set(qids)) == n * len(RELATIONS)
    assert parts["dev"].train_qrels == train.train_qrels  # training data independent of split
    assert all(len(d.corpus) == n * len(RELATIONS) for d in parts.values())


def test_answers_in_gold_passage_not_in_question() -> None:
    data = make_synthetic(200, seed=1, split="train")
    qrels = {**data.train_qrels}
    for other in ("dev", "test"):
        qrels.update(make_synthetic(200, seed=1, split=other).eval_qrels)
    assert set(qrels) == set(data.queries)
    for qid, grades in qrels.items():
        ((gold, grade),) = grades.items()
        (answer,) = data.answers[qid]  # one gold answer per question
        assert grade == 1 and answer
        assert answer in data.corpus[gold].text
        assert answer.lower() not in data.queries[qid].lower()
        assert data.corpus[gold].title in data.queries[qid]  # the question names its entity


def test_question_wording_differs_from_passage() -> None:
    data = make_synthetic(30)
    for i, question in enumerate(data.queries.values()):
        passage = list(data.corpus.values())[i]
        stem = question.replace(passage.title, "").strip(" ?'s")
        assert stem and stem not in passage.text


def test_errors() -> None:
    with pytest.raises(DataError, match=r"data\.num_entities"):
        make_synthetic(9)
    with pytest.raises(DataError, match="valid choices: train, dev, test"):
        make_synthetic(20, split="validation")
    with pytest.raises(DataError, match=r"data\.dev_fraction"):
        make_synthetic(20, dev_fraction=1.5)
    with pytest.raises(DataError, match="leave no training entities"):
        make_synthetic(20, dev_fraction=0.5, test_fraction=0.5)
    with pytest.raises(DataError, match="split 'test' is empty"):
        make_synthetic(20, split="test", test_fraction=0.0)


def test_export_round_trip(tmp_path: Path) -> None:
    data = make_synthetic(20, split="dev")
    test = make_synthetic(20, split="test").eval_qrels
    write_beir(data, tmp_path / "kb", {"train": data.train_qrels, "dev": data.eval_qrels, "test": test})
    loaded = load_beir(tmp_path / "kb", split="dev")
    assert loaded.corpus == data.corpus and loaded.queries == data.queries and loaded.answers == data.answers
    assert loaded.train_qrels == data.train_qrels and loaded.eval_qrels == data.eval_qrels
    assert loaded.fingerprint() == data.fingerprint()
    assert json.loads((tmp_path / "kb" / "queries.jsonl").read_text().splitlines()[0])["metadata"]["answers"]
