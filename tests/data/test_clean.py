"""Cleaning (NFC, whitespace), id checks, exact-duplicate removal, and the document-level bad inputs."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest

from ragtrain.corpus.dataset import load_documents
from ragtrain.data.clean import clean, clean_text, dedupe
from ragtrain.data.types import DataError
from tests.corpus.helpers import small_folder, write_folder


def test_clean_text_nfc_and_whitespace() -> None:
    decomposed = unicodedata.normalize("NFD", "Café")
    assert decomposed != "Café"
    raw = f"  {decomposed}\t\u00a0 au   lait \r\n\r\n\r\n\n second\u2009line  \rthird"
    assert clean_text(raw) == "Café au lait\n\nsecond line\nthird"


def test_clean_puts_title_on_one_line() -> None:
    doc = clean({"id": "x", "title": " A\n  title ", "text": "t", "source": "f"})
    assert doc["title"] == "A title" and doc["text"] == "t"


def test_document_without_text_after_cleaning_names_file_and_id() -> None:
    with pytest.raises(DataError, match=r"f\.txt: document 'x' has no text after cleaning"):
        clean({"id": "x", "title": "T", "text": " \n\t\u00a0\n ", "source": "f.txt"})


def test_html_without_text_is_an_error(tmp_path: Path) -> None:
    root = small_folder(tmp_path / "d")
    write_folder(root, {"blank.html": "<html><head><title>T</title><script>x()</script></head><body> </body></html>"})
    with pytest.raises(DataError, match=r"blank\.html: no text to index .* \(data.on_error=fail; data.on_error=skip"):
        load_documents(root, log=lambda m: None)
    assert "blank" not in load_documents(root, on_error="skip", log=lambda m: None)[0].corpus  # a bad file: skipped


@pytest.mark.parametrize("bad", ["a\nb", "a\tb", "a\rb", ""])
def test_ids_with_newlines_or_tabs_are_rejected(bad: str) -> None:
    with pytest.raises(DataError, match=r"src\.jsonl:3: (empty document id|document id .* contains)"):
        clean({"id": bad, "title": "", "text": "t", "source": "src.jsonl:3"})


def test_id_with_newline_in_a_jsonl_folder(tmp_path: Path) -> None:
    root = small_folder(tmp_path / "d")
    write_folder(root, {"more.jsonl": '{"_id": "bad\\nid", "text": "x"}\n'})
    with pytest.raises(DataError, match=r"more\.jsonl:1: document id 'bad\\nid' contains '\\n'"):
        load_documents(root, log=lambda m: None)


def test_duplicate_ids_across_files_name_both_files(tmp_path: Path) -> None:
    root = small_folder(tmp_path / "d")
    write_folder(root, {"extra.jsonl": '{"_id": "c", "text": "another c"}\n'})
    with pytest.raises(DataError, match=r"duplicate document id 'c': in .*c\.html and in .*extra\.jsonl:1"):
        load_documents(root, log=lambda m: None)


def test_exact_duplicates_are_dropped_counted_and_their_qrels_follow(tmp_path: Path) -> None:
    root = small_folder(tmp_path / "d")
    # same content as a.txt after cleaning (whitespace differs): dropped, and q5's judgment moves to "a"
    write_folder(
        root,
        {"copy.txt": "Alpha  is the first letter.\r\nIt starts the alphabet.".replace("\r\n", " ")},
        queries={"q1": "first letter", "q2": "second letter", "q3": "third letter", "q4": "pilots", "q5": "alphabet"},
        qrels={"train": [("q1", "a"), ("q2", "sub/b"), ("q5", "copy")], "dev": [("q3", "c"), ("q4", "sub/b")]},
    )
    logs: list[str] = []
    data, report = load_documents(root, log=logs.append)
    assert report["duplicates_dropped"] == 1 and "copy" not in data.corpus
    assert data.train_qrels["q5"] == {"a": 1}
    assert any("1 exact duplicates dropped" in m for m in logs)
    # the two copies judged differently for one query: the message says deduplication made them one document
    (root / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq5\tcopy\t1\nq5\ta\t0\n")
    with pytest.raises(
        DataError,
        match=r"train\.tsv:3: \('q5', 'a'\) has score 0, but this query scores 'copy' 1, "
        r"and the two are exact duplicates",
    ):
        load_documents(root, log=logs.append)


def test_dedupe_keeps_first_and_maps_the_rest() -> None:
    docs = [{"id": i, "title": "T", "text": t, "source": i} for i, t in (("x", "same"), ("y", "other"), ("z", "same"))]
    kept, dropped = dedupe(docs)
    assert [d["id"] for d in kept] == ["x", "y"] and dropped == {"z": "x"}


def test_qrels_naming_unknown_documents_name_the_file(tmp_path: Path) -> None:
    root = small_folder(tmp_path / "d")
    write_folder(root, {}, qrels={"dev": [("q3", "c"), ("q4", "no/such/doc")]})
    with pytest.raises(
        DataError, match=r"qrels/dev\.tsv: 1 unknown corpus id\(s\) \(not in corpus\), first: \['no/such/doc'\]"
    ):
        load_documents(root, log=lambda m: None)


def test_folder_without_queries_is_an_error(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "d", {"a.txt": "text"})
    with pytest.raises(DataError, match=r"queries file missing: .*queries\.jsonl"):
        load_documents(root, log=lambda m: None)


def test_load_documents_end_to_end(tmp_path: Path) -> None:
    data, report = load_documents(small_folder(tmp_path / "d"), log=lambda m: None)
    assert list(data.corpus) == ["a", "c", "sub/b"] and report == {
        "files": 3,
        "skipped_files": 0,
        "documents": 3,
        "duplicates_dropped": 0,
    }
    assert data.corpus["c"].title == "Charlie" and data.corpus["c"].text == "Charlie is third."
    assert data.train_qrels == {"q1": {"a": 1}, "q2": {"sub/b": 1}} and data.eval_qrels["q3"] == {"c": 1}
    assert data.doc_of == {}
