"""Tests for the BEIR loader/writer: round trips, split semantics and precise error messages."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest

from ragtrain.data import DataError, Passage, RetrievalData, load_beir, write_beir

SCIFACT = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "scifact"


def _small(n_docs: int = 6, n_queries: int = 5) -> RetrievalData:
    """Build a small in-memory dataset whose query i is relevant to doc i."""
    corpus = {
        f"d{i}": Passage(f"d{i}", f"Title {i}" if i % 2 else "", f"text of doc {i} ünïcode") for i in range(n_docs)
    }
    queries = {f"q{i}": f"question {i}?" for i in range(n_queries)}
    return RetrievalData("small", corpus, queries, {}, {}, "dev")


def _folder(tmp_path: Path, train: int = 5, extra: dict[str, str] | None = None) -> Path:
    """Write a small BEIR folder with ``train`` train queries plus optional raw qrels files."""
    root = tmp_path / "ds"
    data = _small(n_queries=max(train, 5))
    write_beir(data, root, {"train": {f"q{i}": {f"d{i}": 1} for i in range(train)}})
    for name, body in (extra or {}).items():
        (root / "qrels" / f"{name}.tsv").write_text(body, encoding="utf-8")
    return root


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- round trips and formats -------------------------------------------------------------


def test_round_trip_with_dev_file(tmp_path: Path) -> None:
    data = _small()
    train = {"q0": {"d0": 1, "d1": 0}, "q1": {"d1": 2}, "q2": {"d2": 1}}
    dev = {"q3": {"d3": 1}, "q4": {"d4": 1, "d5": -1}}
    write_beir(data, tmp_path / "small", {"train": train, "dev": dev})
    loaded = load_beir(tmp_path / "small", split="dev")
    assert loaded.name == "small"
    assert loaded.corpus == data.corpus and list(loaded.corpus) == list(data.corpus)
    assert loaded.queries == data.queries
    assert loaded.train_qrels == train  # dev.tsv exists -> train is all of train.tsv
    assert loaded.eval_qrels == dev  # graded and non-positive rows are kept
    assert loaded.fingerprint() == data.fingerprint()


def test_round_trip_answers_via_metadata(tmp_path: Path) -> None:
    data = _small()
    data.answers = {"q0": ["forty two", "42"], "q1": ["x"]}
    write_beir(data, tmp_path / "a", {"test": {"q0": {"d0": 1}}})
    assert load_beir(tmp_path / "a", split="test").answers == {"q0": ["forty two", "42"], "q1": ["x"]}


def test_a_single_metadata_answer_is_read_as_a_list(tmp_path: Path) -> None:
    write_beir(_small(), tmp_path / "a", {"test": {"q0": {"d0": 1}}})
    queries = tmp_path / "a" / "queries.jsonl"
    lines = queries.read_text().splitlines()
    lines[0] = json.dumps({**json.loads(lines[0]), "metadata": {"answer": "forty two"}})
    queries.write_text("\n".join(lines) + "\n")
    assert load_beir(tmp_path / "a", split="test").answers == {"q0": ["forty two"]}


def test_gzip_corpus_and_title_handling(tmp_path: Path) -> None:
    root = tmp_path / "gz"
    (root / "qrels").mkdir(parents=True)
    with gzip.open(root / "corpus.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"_id": "a", "title": "Alpha", "text": "first", "metadata": {"x": 1}}) + "\n")
        f.write("\n")
        f.write(json.dumps({"_id": "b", "text": "no title here"}) + "\n")
    _write(root / "queries.jsonl", '{"_id": "1", "text": "q?"}\n')
    _write(root / "qrels" / "test.tsv", "query-id\tcorpus-id\tscore\n1\tb\t1\n")
    data = load_beir(root, split="test")
    assert list(data.corpus) == ["a", "b"]
    assert data.corpus["a"].full_text() == "Alpha first"
    assert data.corpus["b"].title == "" and data.corpus["b"].full_text() == "no title here"
    assert data.train_qrels == {} and data.eval_qrels == {"1": {"b": 1}}


def test_full_text_strips() -> None:
    assert Passage("x", "", " body ").full_text() == "body"
    assert Passage("x", "T", "body").full_text() == "T body"


def test_fingerprint_sensitive_and_unambiguous() -> None:
    a = RetrievalData("a", {"1": Passage("1", "ab", "c")}, {}, {}, {}, "dev")
    b = RetrievalData("b", {"1": Passage("1", "a", "bc")}, {}, {}, {}, "dev")
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == RetrievalData("z", dict(a.corpus), {}, {}, {}, "test").fingerprint()


# --- split semantics -----------------------------------------------------------------------


def test_dev_carve_deterministic_and_disjoint(tmp_path: Path) -> None:
    root = tmp_path / "carve"
    data = _small(n_docs=40, n_queries=40)
    train = {f"q{i}": {f"d{i}": 1} for i in range(40)}
    write_beir(data, root, {"train": train})
    a = load_beir(root, dev_size=10, seed=0)
    b = load_beir(root, dev_size=10, seed=0)
    c = load_beir(root, dev_size=10, seed=1)
    assert a.eval_qrels == b.eval_qrels and a.train_qrels == b.train_qrels
    assert set(a.eval_qrels) != set(c.eval_qrels)
    assert len(a.eval_qrels) == 10 and len(a.train_qrels) == 30
    assert not set(a.eval_qrels) & set(a.train_qrels)
    assert set(a.eval_qrels) | set(a.train_qrels) == set(train)
    frac = load_beir(root, dev_size=0.25, seed=0)
    assert len(frac.eval_qrels) == 10
    # split=train evaluates on train minus dev; split=test leaves training data unchanged.
    tr = load_beir(root, split="train", dev_size=10, seed=0)
    assert tr.eval_qrels == tr.train_qrels == a.train_qrels


def test_split_test_keeps_carved_train(tmp_path: Path) -> None:
    root = _folder(tmp_path, extra={"test": "query-id\tcorpus-id\tscore\nq4\td5\t1\n"})
    dev = load_beir(root, split="dev", dev_size=2)
    test = load_beir(root, split="test", dev_size=2)
    assert test.split == "test" and test.eval_qrels == {"q4": {"d5": 1}}
    assert test.train_qrels == dev.train_qrels and len(test.train_qrels) == 3


def test_eval_only_folder(tmp_path: Path) -> None:
    root = tmp_path / "evalonly"
    write_beir(_small(), root, {"test": {"q0": {"d0": 1}}})
    data = load_beir(root, split="test")
    assert data.train_qrels == {} and data.eval_qrels == {"q0": {"d0": 1}}
    with pytest.raises(DataError, match=r"dev\.tsv not found.*valid splits.*: test$"):
        load_beir(root, split="dev")


# --- errors --------------------------------------------------------------------------------


def test_missing_root_and_not_dir(tmp_path: Path) -> None:
    with pytest.raises(
        DataError, match=r"^data.root=.*nope. does not exist: point data.root at a BEIR folder, or set RAGTRAIN_DATA"
    ):
        load_beir(tmp_path / "nope")
    f = _write(tmp_path / "file", "x")
    with pytest.raises(DataError, match="not a directory"):
        load_beir(f)


def test_missing_files(tmp_path: Path) -> None:
    root = _folder(tmp_path, extra={"test": "q0\td0\t1\n"})
    with pytest.raises(DataError, match=r"qrels/validation\.tsv not found; valid splits .*: dev, test, train"):
        load_beir(root, split="validation")
    (root / "queries.jsonl").unlink()
    with pytest.raises(DataError, match=r"queries\.jsonl does not exist"):
        load_beir(root)
    (root / "corpus.jsonl").unlink()
    with pytest.raises(DataError, match=r"corpus\.jsonl nor .*corpus\.jsonl\.gz"):
        load_beir(root)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"_id": "a", "text": "x"}\n\n{"_id": "b", "text": \n', r"corpus\.jsonl:3: invalid JSON \("),
        ('{"_id": "a", "text": "x"}\n{"text": "y"}\n', r"corpus\.jsonl:2: missing key '_id'"),
        ('\n{"_id": "a"}\n', r"corpus\.jsonl:2: missing key 'text'"),
        ('{"_id": 5, "text": "x"}\n', r"corpus\.jsonl:1: key '_id' must be a string"),
        ('{"_id": "a", "title": null, "text": "x"}\n', r"corpus\.jsonl:1: key 'title' must be a string"),
        ('{"_id": "a", "text": "x"}\n\n\n{"_id": "a", "text": "y"}\n', r"corpus\.jsonl:4: duplicate _id 'a'"),
        ("[1, 2]\n", r"corpus\.jsonl:1: expected a JSON object"),
        ("\n\n", r"corpus\.jsonl: corpus is empty"),
        (
            '{"_id": "a", "text": "x"}\n{"_id": "b", "title": " ", "text": " \\n "}\n',
            r"corpus\.jsonl:2: document 'b' has no text \(empty title and text\)",
        ),
    ],
)
def test_corpus_errors(tmp_path: Path, body: str, expected: str) -> None:
    root = _folder(tmp_path)
    _write(root / "corpus.jsonl", body)
    with pytest.raises(DataError, match=expected):
        load_beir(root, dev_size=1)


def test_queries_errors(tmp_path: Path) -> None:
    root = _folder(tmp_path)
    _write(root / "queries.jsonl", '{"_id": "q0", "text": "a"}\n{"_id": "q1"}\n')
    with pytest.raises(DataError, match=r"queries\.jsonl:2: missing key 'text'"):
        load_beir(root)
    _write(root / "queries.jsonl", '{"_id": "q0", "text": "a"}\n{"_id": "q1", "text": "  "}\n')
    with pytest.raises(DataError, match=r"queries\.jsonl:2: query 'q1' has no text"):
        load_beir(root)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("query-id\tcorpus-id\tscore\nq0\td0\n", r"test\.tsv:2: expected 3 tab-separated columns .* got 2"),
        ("query-id\tcorpus-id\tscore\n\nq0\td0\tyes\n", r"test\.tsv:3: score 'yes' is not an integer"),
        ("q0\td0\t1\nq0\td0\t2\n", r"test\.tsv:2: pair .* repeated with a different score"),
        ("query-id\tcorpus-id\tscore\n", r"test\.tsv: no qrels for split 'test'"),
    ],
)
def test_qrels_line_errors(tmp_path: Path, body: str, expected: str) -> None:
    root = _folder(tmp_path, extra={"test": body})
    with pytest.raises(DataError, match=expected):
        load_beir(root, split="test", dev_size=1)


def test_qrels_unknown_ids(tmp_path: Path) -> None:
    rows = "".join(f"qx{i}\td0\t1\n" for i in range(7)) + "q0\tdz\t1\nq1\tdz\t1\n"
    root = _folder(tmp_path, extra={"test": rows})
    with pytest.raises(DataError) as err:
        load_beir(root, split="test", dev_size=1)
    msg = str(err.value)
    assert "test.tsv" in msg and "7 unknown query id(s)" in msg and "1 unknown corpus id(s)" in msg
    assert "['qx0', 'qx1', 'qx2', 'qx3', 'qx4']" in msg and "qx5" not in msg and "['dz']" in msg


@pytest.mark.parametrize("dev_size", [0, -3, 5, 9, 0.0, 1.0, 0.05, True, "10"])
def test_bad_dev_size(tmp_path: Path, dev_size: object) -> None:
    root = _folder(tmp_path, train=5)
    with pytest.raises(DataError, match=r"data\.dev_size"):
        load_beir(root, dev_size=dev_size)  # type: ignore[arg-type]


def test_header_only_skipped_on_first_line(tmp_path: Path) -> None:
    root = _folder(tmp_path, extra={"test": "\nquery-id\tcorpus-id\tscore\nq0\td0\t0\n"})
    assert load_beir(root, split="test", dev_size=1).eval_qrels == {"q0": {"d0": 0}}


def test_write_rejects_path_like_split(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="invalid qrels split name"):
        write_beir(_small(), tmp_path / "w", {"../evil": {}})


# --- real data -----------------------------------------------------------------------------


def test_scifact() -> None:
    if not SCIFACT.is_dir():
        pytest.skip(f"SciFact not present at {SCIFACT}")
    start = time.perf_counter()
    data = load_beir(SCIFACT, split="dev", dev_size=100, seed=0)
    assert time.perf_counter() - start < 2.0
    assert len(data.corpus) == 5183 and len(data.queries) == 1109
    assert len(data.eval_qrels) == 100 and len(data.train_qrels) == 709
    # Before carving: 919 train pairs over 809 queries; the carve only moves whole queries.
    full = {**data.train_qrels, **data.eval_qrels}
    assert len(full) == 809 and sum(len(g) for g in full.values()) == 919
    assert not set(data.train_qrels) & set(data.eval_qrels)
    with pytest.raises(DataError, match=r"valid splits .*: dev, train"):
        load_beir(SCIFACT, split="test")


def test_a_bom_is_dropped_and_bad_utf8_names_its_line_and_the_files_byte_offset(tmp_path: Path) -> None:
    """Files saved by Windows tools start with a BOM; a bad byte is reported at its offset in the file (the
    text reader's offsets were those of its internal buffer), gzipped or not."""
    root = _folder(tmp_path, extra={"test": "\ufeffquery-id\tcorpus-id\tscore\nq0\td0\t1\n"})
    for name in ("corpus.jsonl", "queries.jsonl"):
        (root / name).write_bytes(b"\xef\xbb\xbf" + (root / name).read_bytes())
    data = load_beir(root, split="test", dev_size=1)
    assert data.eval_qrels == {"q0": {"d0": 1}} and "d0" in data.corpus and "q0" in data.queries
    body = (root / "corpus.jsonl").read_bytes()
    lines = body.splitlines(keepends=True)
    bad = lines[2].replace(b"text", b"t\xe9xt", 1)
    (root / "corpus.jsonl").write_bytes(b"".join(lines[:2]) + bad + b"".join(lines[3:]))
    at = len(b"".join(lines[:2])) + bad.index(b"\xe9")
    with pytest.raises(DataError, match=rf"corpus\.jsonl:3: not valid UTF-8 at byte offset {at} \("):
        load_beir(root, split="test", dev_size=1)
    (root / "corpus.jsonl").unlink()
    with gzip.open(root / "corpus.jsonl.gz", "wb") as f:
        f.write(b"".join(lines[:2]) + bad)
    with pytest.raises(
        DataError,
        match=rf"corpus\.jsonl\.gz:3: not valid UTF-8 at byte offset {at} of the "
        r"uncompressed text",
    ):
        load_beir(root, split="test", dev_size=1)
