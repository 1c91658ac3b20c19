"""The generated docs_synthetic folder: deterministic, readable by data=documents, confusable, judged on documents."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragtrain.corpus.dataset import load_documents
from ragtrain.corpus.docs_synthetic import write_docs_synthetic
from ragtrain.data.types import DataError


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_generation_is_deterministic_and_seeded(tmp_path: Path) -> None:
    a, b = write_docs_synthetic(tmp_path / "a", 30, seed=1), write_docs_synthetic(tmp_path / "b", 30, seed=1)
    assert _files(a) == _files(b)
    assert _files(write_docs_synthetic(tmp_path / "c", 30, seed=2)) != _files(a)
    write_docs_synthetic(tmp_path / "a", 30, seed=1)  # regenerating its own folder is fine
    assert _files(a) == _files(b)


def test_refuses_a_folder_it_did_not_write(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not empty and was not written by write_docs_synthetic"):
        write_docs_synthetic(tmp_path / "mine", 30)


def test_loads_as_documents_with_confusable_entities(tmp_path: Path) -> None:
    root = write_docs_synthetic(tmp_path / "d", 30, seed=0)
    data, report = load_documents(root, log=lambda m: None)
    assert report["documents"] == 30 and report["skipped_files"] == 0
    suffixes = {p.suffix for p in (root / "articles").iterdir()}
    assert suffixes == {".md", ".html", ".txt"}
    for doc in data.corpus.values():
        assert "tracker" not in doc.text and "color" not in doc.text  # html script/style dropped
        assert len(doc.text.split()) > 120  # long, multi-section: chunking matters
    names = [d.title for d in data.corpus.values() if d.title]
    # near-identical names: families share a last name, first names differ by one letter
    assert any(
        a != b and a.split()[1] == b.split()[1] and a.split()[0][:-1] == b.split()[0] for a in names for b in names
    )
    judged = {d for split in (data.train_qrels, data.eval_qrels) for g in split.values() for d in g}
    assert judged <= set(data.corpus) and all(len(g) == 1 for g in data.eval_qrels.values())
    train_people = {d for g in data.train_qrels.values() for d in g}
    assert not train_people & {d for g in data.eval_qrels.values() for d in g}  # split by family
