"""`data=documents` / `data=beir` composed the way users compose them, through corpus.load.load_data; config errors."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from ragtrain.config import to_typed
from ragtrain.corpus.load import load_data
from ragtrain.data.types import DataError
from ragtrain.runtime.errors import ConfigError
from tests.conftest import REPO, compose

from .helpers import small_folder


def _typed(tmp_path: Path, *overrides: str):
    return to_typed(compose([*overrides, f"output_dir={tmp_path / 'out'}"]))


def test_documents_folder_composed_and_chunked(tmp_path: Path) -> None:
    root = small_folder(tmp_path / "docs")
    cfg = _typed(
        tmp_path,
        "data=documents",
        f"data.root={root}",
        "retriever=tiny",
        "data.chunk.max_tokens=8",
        "data.chunk.overlap=2",
    )
    data = load_data(cfg.data, cfg.retriever)
    assert set(data.doc_of.values()) == {"a", "sub/b", "c"} and len(data.corpus) > 3
    for pid, p in data.corpus.items():
        assert pid == f"{p.doc_id}#{pid.rsplit('#', 1)[1]}" and data.doc_of[pid] == p.doc_id
    assert data.eval_qrels == {"q3": {"c": 1}, "q4": {"sub/b": 1}}  # qrels stay on documents


@pytest.mark.parametrize("source", ["documents", "synthetic"])
def test_run_folder_store_equals_the_in_memory_corpus(tmp_path: Path, source: str) -> None:
    """With a run folder, load_data streams the corpus (and its chunks) into <out>/corpus/*.arrow: same passages,
    same order, same fingerprint, same doc_of and qrels as the in-memory load."""
    from ragtrain.data.store import PassageStore

    if source == "documents":
        root = small_folder(tmp_path / "docs")
        cfg = _typed(
            tmp_path,
            "data=documents",
            f"data.root={root}",
            "retriever=tiny",
            "data.chunk.max_tokens=8",
            "data.chunk.overlap=2",
        )
    else:
        cfg = _typed(tmp_path, "retriever=tiny", "data.num_entities=12")
    memory = load_data(cfg.data, cfg.retriever)
    stored = load_data(cfg.data, cfg.retriever, tmp_path / "run")
    assert isinstance(stored.corpus, PassageStore) and not isinstance(memory.corpus, PassageStore)
    assert stored.corpus.path == (tmp_path / "run" / "corpus" / "passages.arrow").resolve()
    assert dict(stored.corpus.items()) == dict(memory.corpus) and list(stored.corpus) == list(memory.corpus)
    assert stored.fingerprint() == memory.fingerprint() and stored.doc_of == memory.doc_of
    assert (stored.train_qrels, stored.eval_qrels) == (memory.train_qrels, memory.eval_qrels)
    assert sorted(p.name for p in (tmp_path / "run" / "corpus").iterdir()) == (
        ["documents.arrow", "documents.arrow.json", "passages.arrow", "passages.arrow.json"]
        if source == "documents"
        else ["passages.arrow", "passages.arrow.json"]
    )


def test_documents_without_chunking_are_whole_passages(tmp_path: Path) -> None:
    root = small_folder(tmp_path / "docs")
    cfg = _typed(tmp_path, "data=documents", f"data.root={root}", "data.chunk.enabled=false")
    data = load_data(cfg.data)
    assert list(data.corpus) == ["a", "c", "sub/b"] and data.doc_of == {}


def test_beir_folder_selectable_and_chunkable(tmp_path: Path) -> None:
    from ragtrain.data import make_synthetic, write_beir

    syn = make_synthetic(num_entities=12, seed=0)
    write_beir(syn, tmp_path / "beir", {"train": syn.train_qrels, "dev": syn.eval_qrels})
    cfg = _typed(tmp_path, "data=beir", f"data.root={tmp_path / 'beir'}")
    assert list(load_data(cfg.data).corpus) == list(syn.corpus)
    cfg = _typed(
        tmp_path,
        "data=beir",
        f"data.root={tmp_path / 'beir'}",
        "retriever=tiny",
        "data.chunk.enabled=true",
        "data.chunk.max_tokens=16",
        "data.chunk.overlap=4",
    )
    data = load_data(cfg.data, cfg.retriever)
    assert len(data.corpus) > len(syn.corpus) and set(data.doc_of.values()) == set(syn.corpus)


def test_beir_doc_id_with_a_newline_is_rejected(tmp_path: Path) -> None:
    root = tmp_path / "beir"
    (root / "qrels").mkdir(parents=True)
    (root / "corpus.jsonl").write_text(json.dumps({"_id": "a\nb", "text": "x"}) + "\n")
    (root / "queries.jsonl").write_text(json.dumps({"_id": "q", "text": "x"}) + "\n")
    (root / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\nq\ta\\nb\t1\n")
    cfg = _typed(tmp_path, "data=beir", f"data.root={root}")
    with pytest.raises(DataError, match=r"corpus\.jsonl:1: document id 'a\\nb' contains '\\n'"):
        load_data(cfg.data)
    # a Unicode line separator too, with the file and line (before: the folder only, after loading)
    (root / "corpus.jsonl").write_text(
        json.dumps({"_id": "a", "text": "x"}) + "\n" + json.dumps({"_id": "a\u2028b", "text": "y"}) + "\n"
    )
    with pytest.raises(DataError, match=r"corpus\.jsonl:2: document id 'a\\u2028b' contains"):
        load_data(cfg.data)
    (root / "corpus.jsonl").write_text(json.dumps({"_id": "a", "text": "x"}) + "\n")
    (root / "queries.jsonl").write_text(json.dumps({"_id": "q\tr", "text": "x"}) + "\n")
    with pytest.raises(DataError, match=r"queries\.jsonl:1: query id 'q\\tr' contains"):
        load_data(cfg.data)


def test_chunk_larger_than_the_encoder_is_a_config_error(tmp_path: Path) -> None:
    root = small_folder(tmp_path / "docs")
    cfg = _typed(tmp_path, "data=documents", f"data.root={root}", "retriever=tiny")  # passage_max_length=64
    with pytest.raises(ConfigError, match=r"data.chunk.max_tokens must be <= 62 .*got 128"):
        load_data(cfg.data, cfg.retriever)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["data.root=/my/beir"],
            r"data.root is set but data=synthetic .* "
            r"data.source choices: \['synthetic', 'beir', 'documents', 'squad'\]",
        ),
        (["data=documents"], r"data.root must be set for data.source=documents"),
        (["data=beir"], r"data.root must be set for data.source=beir"),
        (
            ["data=documents", "data.root=/x", "data.chunk.overlap=128"],
            r"data.chunk.overlap must be < data.chunk.max_tokens \(128\)",
        ),
        (["data=documents", "data.root=/x", "data.chunk.max_tokens=0"], r"data.chunk.max_tokens must be > 0"),
        (
            ["data=documents", "data.root=/x", "data.generate=true"],
            r"data.root must stay unset with data.generate=true",
        ),
        (
            ["data=documents", "data.root=/x", "stages=[retriever,index,generator]"],
            r"data.chunk.enabled is not supported with the generator",
        ),
        (["data.chunk.enabled=true"], r"data.chunk.enabled needs data=beir, data=documents or data=squad"),
    ],
)
def test_bad_data_config_names_the_key(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _typed(tmp_path, *overrides)


def test_on_error_is_an_enum(tmp_path: Path) -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as e:
        _typed(tmp_path, "data=documents", "data.root=/x", "data.on_error=maybe")
    assert "fail" in str(e.value.__cause__) and "skip" in str(e.value.__cause__)


def test_cli_bad_folder_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ragtrain",
            "data=documents",
            f"data.root={tmp_path / 'empty'}",
            "data.chunk.enabled=false",
            f"output_dir={tmp_path / 'out'}",
            "logger=none",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("data error: data.root=") and "matches no document file" in lines[-1]
    assert "Traceback" not in r.stderr


def test_passages_longer_than_the_encoder_are_reported_when_not_chunked(tmp_path: Path, monkeypatch) -> None:
    """Without chunking, a 2,100-word document was cut to passage_max_length tokens without a word. The report is
    the one line: counting the lengths does not also print the tokenizer's warning about a too-long sequence."""
    import ragtrain.corpus.load as load
    from ragtrain.corpus.load import truncation_report
    from ragtrain.data.store import write_store
    from ragtrain.data.types import Passage

    root = small_folder(tmp_path / "docs")
    (root / "long.txt").write_text(" ".join(f"word{i % 50}" for i in range(2100)))
    cfg = _typed(
        tmp_path,
        "data=documents",
        f"data.root={root}",
        "retriever=tiny",
        "data.chunk.enabled=false",
        "retriever.passage_max_length=64",
    )
    data = load_data(cfg.data, cfg.retriever)

    class Records(logging.Handler):  # transformers logs to its own stderr handler, bound when it was imported
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    seen = Records()
    logging.getLogger("transformers").addHandler(seen)
    try:
        line = truncation_report(data.corpus, cfg.retriever)
    finally:
        logging.getLogger("transformers").removeHandler(seen)
    assert line is not None and line.startswith(
        f"1 of {len(data.corpus)} passages exceed retriever.passage_max_length=64 tokens (longest "
    )
    assert "set data.chunk.enabled=true to split them" in line
    assert not [x for x in seen.lines if "Token indices sequence length" in x]
    assert int(line.split("(longest ")[1].split(", median")[0].replace(",", "")) > 2100  # word pieces, specials
    # a store is read by position, and a corpus larger than the sample is counted on a seeded sample
    store = write_store(
        tmp_path / "p.arrow", [Passage(id=f"p{i}", title="", text="word " * (80 if i % 2 else 5)) for i in range(40)]
    )
    monkeypatch.setattr(load, "TRUNCATION_SAMPLE", 10)
    import random

    odd = sum(i % 2 for i in random.Random(0).sample(range(40), 10))  # the seeded sample's long passages
    assert truncation_report(store, cfg.retriever).startswith(
        f"{odd} of a sample of 10 passages ({odd / 10:.1%} of 40)"
    )
    short = _typed(
        tmp_path,
        "data=documents",
        f"data.root={small_folder(tmp_path / 'short')}",
        "retriever=tiny",
        "data.chunk.enabled=false",
    )
    assert truncation_report(load_data(short.data, short.retriever).corpus, short.retriever) is None
