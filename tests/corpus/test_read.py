"""Reading documents per format, and the file-level bad inputs (empty folder, binary, non-UTF-8, unreadable)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragtrain.corpus.dataset import load_documents
from ragtrain.corpus.read import FileError, list_documents, read_file
from ragtrain.data.types import DataError

from .helpers import small_folder, write_folder


def _read(root: Path, rel: str) -> list[dict]:
    return list(read_file(root / rel, root))


def test_list_documents_skips_queries_qrels_and_hidden_files(tmp_path: Path) -> None:
    root = small_folder(tmp_path / "d")
    write_folder(root, {".DS_Store": b"\x00\x01", ".git/config": "x", "qrels/notes.txt": "not a doc"})
    assert [p.relative_to(root).as_posix() for p in list_documents(root)] == ["a.txt", "c.html", "sub/b.md"]
    assert [p.name for p in list_documents(root, "sub/*.md")] == ["b.md"]  # data.glob narrows


def test_linked_folders_are_followed_once_and_a_link_to_nothing_is_a_bad_file(tmp_path: Path) -> None:
    """A folder of documents linked in from elsewhere under data.root is part of the corpus (pathlib's glob skipped it
    silently); a link back to an ancestor is not followed (no cycle); a link to nothing is a FileError (data.on_error
    decides), not silently dropped."""
    import os

    root = small_folder(tmp_path / "d")
    write_folder(root, {"shelf/x.txt": "Xray is a letter.", "shelf/y/z.txt": "Zulu is a letter."})
    os.symlink(root / "shelf", root / "linked")
    os.symlink(root, root / "sub" / "loop")  # a cycle back to the root
    os.symlink(tmp_path / "gone.txt", root / "dangling.txt")
    files = [p.relative_to(root).as_posix() for p in list_documents(root)]
    assert files == [
        "a.txt",
        "c.html",
        "dangling.txt",
        "linked/x.txt",
        "linked/y/z.txt",
        "shelf/x.txt",
        "shelf/y/z.txt",
        "sub/b.md",
    ]
    assert [p.relative_to(root).as_posix() for p in list_documents(root, "linked/**/*.txt")] == [
        "linked/x.txt",
        "linked/y/z.txt",
    ]
    assert [d["id"] for d in _read(root, "linked/y/z.txt")] == ["linked/y/z"]
    with pytest.raises(FileError, match=r"dangling\.txt: a symbolic link to a missing target"):
        _read(root, "dangling.txt")


def test_links_out_of_data_root_and_link_cycles_are_bad_files(tmp_path: Path) -> None:
    """A link may only resolve inside data.root: a link to / walked into /dev before. A cycle of file links is one
    line, not an OSError traceback. Both are bad files, which data.on_error decides about."""
    import os

    root = small_folder(tmp_path / "d")
    ext = write_folder(tmp_path / "ext", {"x.txt": "Xray is a letter."})
    os.symlink("/", root / "system")
    os.symlink(ext, root / "elsewhere")
    os.symlink(ext / "x.txt", root / "x.txt")
    os.symlink(root / "loop_b.txt", root / "loop_a.txt")
    os.symlink(root / "loop_a.txt", root / "loop_b.txt")
    files = [p.relative_to(root).as_posix() for p in list_documents(root)]
    assert files == ["a.txt", "c.html", "elsewhere", "loop_a.txt", "loop_b.txt", "sub/b.md", "system", "x.txt"]
    for rel, target in [("system", "/"), ("elsewhere", str(ext)), ("x.txt", str(ext / "x.txt"))]:
        with pytest.raises(FileError, match=rf"{rel}: a symbolic link to {target}, outside data.root"):
            _read(root, rel)
    with pytest.raises(FileError, match=r"loop_a\.txt: a symbolic link cycle"):
        _read(root, "loop_a.txt")
    with pytest.raises(DataError, match=r"elsewhere: a symbolic link to .*ext, outside data.root .*data.on_error=fail"):
        load_documents(root)
    assert sorted(load_documents(root, on_error="skip")[0].corpus) == ["a", "c", "sub/b"]


def test_a_queries_file_below_the_root_is_refused(tmp_path: Path) -> None:
    root = small_folder(tmp_path / "d")
    write_folder(root, {"sub/queries.jsonl": '{"_id": "zz", "text": "a question"}\n'})
    with pytest.raises(
        DataError,
        match=r"sub/queries\.jsonl: a queries file below data.root is not read \(only "
        r"data.root/queries\.jsonl is\)",
    ):
        list_documents(root)
    assert [p.name for p in list_documents(root, "*.txt")] == ["a.txt"]  # unless data.glob leaves it out


def test_markdown_setext_titles_and_code_fences() -> None:
    from ragtrain.corpus.read import markdown_to_text

    title, body = markdown_to_text(
        "Bravo Guide\n===========\n\nIntro.\n\n## Use\n\n```sh\n# install it\nmake\n```\n# Not the title\n"
    )
    assert title == "Bravo Guide"
    assert body.splitlines() == ["", "Intro.", "", "Use", "", "```sh", "# install it", "make", "```", "Not the title"]
    assert markdown_to_text("# Alpha\ntext")[0] == "Alpha"


def test_txt_md_ids_are_relative_paths_without_extension(tmp_path: Path) -> None:
    root = small_folder(tmp_path / "d")
    [a] = _read(root, "a.txt")
    assert (a["id"], a["title"]) == ("a", "") and a["text"].startswith("Alpha is")
    [b] = _read(root, "sub/b.md")
    assert b["id"] == "sub/b" and b["title"] == "Bravo"
    assert "# " not in b["text"] and "Use" in b["text"] and "Pilots say bravo." in b["text"]


def test_html_text_drops_script_and_style(tmp_path: Path) -> None:
    html = (
        "<html><head><title>Page T</title><style>body { color: red }</style>"
        "<script>var secret = 'tracker';</script></head><body><h1>Heading</h1>"
        "<p>First para &amp; more.</p><script>alert('no')</script><p>Second para.</p>"
        "<noscript>enable js</noscript><style>.x{}</style>tail text</body></html>"
    )
    root = write_folder(tmp_path / "d", {"p.html": html})
    [doc] = _read(root, "p.html")
    assert doc["id"] == "p" and doc["title"] == "Page T"
    for junk in ("secret", "tracker", "alert", "color", "enable js", ".x{}"):
        assert junk not in doc["text"]
    assert "First para & more." in doc["text"] and "Second para." in doc["text"] and "tail text" in doc["text"]
    assert "First para & more.\n" in doc["text"]  # block elements end lines (sentence boundaries for chunking)
    assert "Heading" in doc["text"]


def test_html_title_from_h1_and_not_repeated(tmp_path: Path) -> None:
    root = write_folder(
        tmp_path / "d",
        {
            "t.html": "<html><head><title>Same</title></head><body><h1>Same</h1><p>Body.</p></body></html>",
            "h.html": "<body><h1>Only H1</h1><p>Text here.</p></body>",
        },
    )
    [t] = _read(root, "t.html")
    assert t["title"] == "Same" and t["text"].strip() == "Body."
    [h] = _read(root, "h.html")
    assert h["title"] == "Only H1" and h["text"].strip() == "Text here."


def test_jsonl_accepts_id_or__id(tmp_path: Path) -> None:
    root = write_folder(
        tmp_path / "d", {"c.jsonl": '{"_id": "x1", "title": "T", "text": "one"}\n\n{"id": 7, "text": "two"}\n'}
    )
    docs = _read(root, "c.jsonl")
    assert [(d["id"], d["title"], d["text"]) for d in docs] == [("x1", "T", "one"), ("7", "", "two")]
    assert docs[1]["source"].endswith("c.jsonl:3")


def test_jsonl_without_id_names_file_and_line(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "d", {"c.jsonl": '{"_id": "a", "text": "x"}\n{"text": "no id"}\n'})
    with pytest.raises(DataError, match=r"c\.jsonl:2: missing or non-string document id"):
        _read(root, "c.jsonl")


def test_a_title_that_is_not_a_string_is_an_error_not_dropped(tmp_path: Path) -> None:
    root = write_folder(
        tmp_path / "d", {"t.jsonl": '{"_id": "a", "title": null, "text": "x"}\n{"_id": "b", "title": 0, "text": "y"}\n'}
    )
    with pytest.raises(DataError, match=r"t\.jsonl:2: key 'title' must be a string, got int"):
        _read(root, "t.jsonl")


def test_parquet_via_pyarrow(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d").mkdir()
    pq.write_table(
        pa.table({"_id": ["p1", "p2"], "title": ["T1", None], "text": ["alpha", "beta"]}), tmp_path / "d" / "t.parquet"
    )
    docs = _read(tmp_path / "d", "t.parquet")
    assert [(d["id"], d["title"], d["text"]) for d in docs] == [("p1", "T1", "alpha"), ("p2", "", "beta")]
    pq.write_table(pa.table({"name": ["x"], "text": ["y"]}), tmp_path / "d" / "bad.parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: parquet columns .* lack an id column"):
        _read(tmp_path / "d", "bad.parquet")
    # not parquet at all: pyarrow raises ArrowInvalid, a ValueError, not an OSError; a FileError (on_error applies)
    (tmp_path / "d" / "fake.parquet").write_text("not parquet")
    with pytest.raises(FileError, match=r"fake\.parquet: cannot be read as parquet \(.*magic bytes"):
        _read(tmp_path / "d", "fake.parquet")


# ---- bad input: each a one-line error naming the file or key ----


def test_empty_folder_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data.root='.*empty' with data.glob='\*\*/\*' matches no document file"):
        list_documents(tmp_path / "empty")


def test_glob_matching_nothing_is_an_error(tmp_path: Path) -> None:
    root = small_folder(tmp_path / "d")
    with pytest.raises(DataError, match=r"data.glob='\*\.pdf' matches no document file"):
        list_documents(root, "*.pdf")


def test_absolute_glob_is_an_error(tmp_path: Path) -> None:
    root = small_folder(tmp_path / "d")
    with pytest.raises(DataError, match=r"data.glob='/etc/\*' is not a pattern relative to data.root"):
        list_documents(root, "/etc/*")


def test_missing_root_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data.root='.*nope' does not exist"):
        list_documents(tmp_path / "nope")


def test_binary_file_fails_or_is_skipped_and_counted(tmp_path: Path) -> None:
    root = small_folder(tmp_path / "d")
    write_folder(root, {"img.png": b"\x89PNG\r\n\x1a\n\x00\x00", "nul.txt": b"text\x00more"})
    with pytest.raises(FileError, match=r"nul\.txt: binary file \(NUL byte at byte offset 4\)"):
        _read(root, "nul.txt")
    with pytest.raises(FileError, match=r"img\.png: unsupported file type '\.png'"):
        _read(root, "img.png")
    with pytest.raises(DataError, match=r"img\.png: unsupported file type.*data.on_error=skip"):
        load_documents(root, on_error="fail", log=lambda m: None)
    logs: list[str] = []
    data, report = load_documents(root, on_error="skip", log=logs.append)
    assert report["skipped_files"] == 2 and set(data.corpus) == {"a", "sub/b", "c"}
    assert any("2 files skipped" in m for m in logs) and any("nul.txt" in m for m in logs)
    assert not any("on_error" in m for m in logs if "skipped" in m and "img.png" in m)  # no hint to set what is set


def test_non_utf8_file_names_file_and_byte_offset(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "d", {"latin.txt": "café au lait".encode("latin-1")})
    with pytest.raises(FileError, match=r"latin\.txt: not valid UTF-8 at byte offset 3"):
        _read(root, "latin.txt")


def test_unreadable_file_fails_or_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = small_folder(tmp_path / "d")
    real = Path.read_bytes

    def deny(self: Path) -> bytes:  # tests run as root here, so chmod 000 would not stop a read
        if self.name == "a.txt":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", deny)
    with pytest.raises(DataError, match=r"a\.txt: cannot be read \(Permission denied\)"):
        load_documents(root, log=lambda m: None)
    # skipping a.txt leaves q1 (judged on a) unknown: qrels naming unknown documents is its own error
    with pytest.raises(DataError, match=r"train\.tsv: 1 unknown corpus id\(s\).*\['a'\]"):
        load_documents(root, on_error="skip", log=lambda m: None)


# ---- large files: read a block at a time, with the same errors and byte offsets ----


def test_jsonl_checks_span_blocks_with_the_files_byte_offsets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ragtrain.corpus.read as read

    monkeypatch.setattr(read, "READ_BLOCK", 5)  # every multi-byte character below straddles a block boundary
    good = '{"_id": "a", "text": "café ☕ naïve 𝔘"}\n{"_id": "b", "text": "second"}\n'.encode()
    root = write_folder(
        tmp_path / "d",
        {
            "ok.jsonl": good,
            "bad.jsonl": good + b'{"_id": "c", "text": "caf\xe9"}\n',
            "cut.jsonl": good[:-1] + "é".encode()[:1],
            "nul.jsonl": good + b"\x00",
        },
    )
    assert [d["text"] for d in _read(root, "ok.jsonl")] == ["café ☕ naïve 𝔘", "second"]
    with pytest.raises(FileError, match=rf"bad\.jsonl: not valid UTF-8 at byte offset {len(good) + 25} "):
        read.open_documents(root / "bad.jsonl", root)  # raised on opening, before any document (skip: none of it)
    with pytest.raises(FileError, match=rf"cut\.jsonl: not valid UTF-8 at byte offset {len(good) - 1} "):
        read.open_documents(root / "cut.jsonl", root)
    with pytest.raises(FileError, match=rf"nul\.jsonl: binary file \(NUL byte at byte offset {len(good)}\)"):
        read.open_documents(root / "nul.jsonl", root)


def test_a_jsonl_record_may_hold_a_raw_line_separator(tmp_path: Path) -> None:
    # JSON allows U+2028 / U+2029 / U+0085 raw inside strings; JSON Lines end records at \n (or \r\n) only
    root = write_folder(
        tmp_path / "d",
        {"c.jsonl": '\ufeff{"_id": "a", "text": "one\u2028two\x85three"}\r\n{"_id": "b", "text": "x"}\n'},
    )
    docs = _read(root, "c.jsonl")
    assert [d["id"] for d in docs] == ["a", "b"] and docs[0]["text"] == "one\u2028two\x85three"
    assert docs[1]["source"].endswith("c.jsonl:2")


def test_a_large_file_is_read_and_sent_in_bounded_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    import ragtrain.corpus.prepare as prepare
    import ragtrain.corpus.read as read

    monkeypatch.setattr(prepare, "ROWS_PER_BLOCK", 4)
    monkeypatch.setattr(read, "PARQUET_BATCH_ROWS", 3)
    root = write_folder(
        tmp_path / "d", {"big.jsonl": "".join(f'{{"_id": "j{i}", "text": "doc {i}"}}\n' for i in range(10))}
    )
    pq.write_table(
        pa.table({"id": [f"p{i}" for i in range(7)], "text": [f"row {i}" for i in range(7)]}),
        root / "big.parquet",
        row_group_size=2,
    )
    seen = []
    real = read._doc_from_record
    monkeypatch.setattr(read, "_doc_from_record", lambda obj, where: seen.append(where) or real(obj, where))
    docs = read.open_documents(root / "big.parquet", root)
    assert seen == []  # opening checks the file; records are read only as they are asked for
    assert [next(docs)["id"] for _ in range(2)] == ["p0", "p1"] and len(seen) <= 3
    # On Ray, a read task yields blocks of ROWS_PER_BLOCK documents: one big file is many blocks, not one
    blocks = list(
        prepare.read_clean_batch(
            {"path": np.array([str(root / "big.jsonl"), str(root / "big.parquet")], dtype=object)}, str(root)
        )
    )
    assert [len(b["id"]) for b in blocks] == [4, 4, 4, 4, 1]
    assert [str(i) for b in blocks for i in b["id"]] == [f"j{i}" for i in range(10)] + [f"p{i}" for i in range(7)]
    monkeypatch.setattr(prepare, "BLOCK_CHARS", 12)  # or fewer rows, once their text reaches BLOCK_CHARS
    blocks = list(prepare.read_clean_batch({"path": np.array([str(root / "big.jsonl")], dtype=object)}, str(root)))
    assert [len(b["id"]) for b in blocks] == [3, 3, 3, 1]  # 5 characters a document: a block closes at 15


def test_a_document_of_only_control_characters_is_a_bad_file(tmp_path: Path) -> None:
    root = small_folder(tmp_path / "d")
    write_folder(root, {"ctl.txt": "\x01\x02\x03\n\x04\x05\x06\x07\x08", "mixed.txt": "Alpha\x01 is\x07 a letter."})
    with pytest.raises(FileError, match=r"ctl\.txt: no text to index \(9 characters, none of them text"):
        _read(root, "ctl.txt")
    data = load_documents(root, on_error="skip")[0]
    assert "ctl" not in data.corpus and data.corpus["mixed"].text == "Alpha is a letter."


def test_a_single_document_file_past_the_limit_is_a_bad_file(tmp_path: Path, monkeypatch) -> None:
    import ragtrain.corpus.read as read

    monkeypatch.setattr(read, "MAX_DOCUMENT_BYTES", 1 << 20)  # the same rule at 1 MiB, to keep the test small
    root = small_folder(tmp_path / "d")
    write_folder(root, {"dump.txt": "word " * 300_000})  # 1.4 MiB on one line
    with pytest.raises(FileError, match=r"dump\.txt: one document of 1\.4 MiB, over the 1 MiB a single \.txt file"):
        _read(root, "dump.txt")
    assert "dump" not in load_documents(root, on_error="skip")[0].corpus
