"""Read raw documents: list the files under a root, and read each file into {id, title, text, source} dicts.

Pure Python (no Ray): `list_documents` and `read_file` are called per file, so a Ray Data pipeline can wrap them.
Supported: .txt, .md/.markdown, .html/.htm (lxml's HTML parser, script/style dropped), .jsonl and .parquet with
{"_id"|"id", "title"?, "text"}. A document's id is its `_id`/`id` field, else its path relative to the root without
extension. `queries.jsonl[.gz]` and `qrels/` at the root are BEIR queries and judgments, never documents.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ragtrain.data.clean import clean_text
from ragtrain.data.types import DataError

__all__ = ["SUPPORTED", "FileError", "MissingFileError", "is_reserved", "list_documents", "open_documents", "read_file"]

SUPPORTED = (".txt", ".md", ".markdown", ".html", ".htm", ".jsonl", ".parquet")
READ_BLOCK = 1 << 20  # bytes a .jsonl file's UTF-8 check reads at a time
# A .txt/.md/.html file is one document, read whole and chunked: past this it is a dump (a 45.6 MB one-line .txt
# became 176,070 chunks of one "document"), and a bad file under data.on_error. Records of a .jsonl have no such limit.
MAX_DOCUMENT_BYTES = 16 << 20
PARQUET_BATCH_ROWS = 4096  # rows of a .parquet file read at a time
_RESERVED_FILES = ("queries.jsonl", "queries.jsonl.gz")
_RESERVED_DIRS = ("qrels",)
_H1 = re.compile(r"^#\s+(.+?)\s*#*\s*$")
_HEADING = re.compile(r"^#{1,6}\s+")
_SETEXT_H1 = re.compile(r"^ {0,3}=+\s*$")
# Elements whose text is never document text (lxml keeps a dropped element's tail, i.e. the text after it).
_DROP = "//script | //style | //noscript | //template | //head | //svg | //iframe"
_BLOCKS = (
    "p",
    "div",
    "br",
    "li",
    "ul",
    "ol",
    "tr",
    "table",
    "section",
    "article",
    "header",
    "footer",
    "pre",
    "blockquote",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "dt",
    "dd",
    "hr",
    "main",
    "nav",
    "aside",
    "figure",
)


class FileError(DataError):
    """A whole file cannot be read (unreadable, binary, not UTF-8, corrupt): subject to `data.on_error`."""


class MissingFileError(DataError):
    """A listed file is gone when read: the folder changed during the run, or (on a cluster) the reading node does
    not mount data.root. Not a bad file, so data.on_error=skip does not skip it: the corpus would silently shrink."""

    def __init__(self, path: Path, where: str = ""):
        super().__init__(
            f"{path}: listed when the run started but missing when read{where}: data.root must not "
            "change during a run, and on a Ray cluster every node must mount it (data.on_error=skip "
            "does not skip a missing file)"
        )


def _not_found(path: Path) -> DataError:
    """A file that vanished after listing (MissingFileError), or a symbolic link to nothing: a bad file, which
    data.on_error decides about (FileError)."""
    if path.is_symlink():
        return FileError(f"{path}: a symbolic link to a missing target ({os.readlink(path)})")
    return MissingFileError(path)


def _glob_regex(pattern: str) -> re.Pattern:
    """`pattern` (pathlib glob syntax: `**` = any folders, `*` `?` `[...]` within one name) as a regex on root-relative
    POSIX paths."""
    regex = ""
    for seg in pattern.split("/"):
        if seg == "**":
            regex += "(?:[^/]+/)*"  # zero or more folders (a trailing `**` names folders only, so no file)
            continue
        i = 0
        while i < len(seg):
            c = seg[i]
            if c == "*":
                regex += "[^/]*"
            elif c == "?":
                regex += "[^/]"
            elif c == "[" and "]" in seg[i + 2 :]:
                end = seg.index("]", i + 2)
                inner = seg[i + 1 : end]
                regex += "[" + ("^" + inner[1:] if inner.startswith("!") else inner) + "]"
                i = end
            else:
                regex += re.escape(c)
            i += 1
        regex += "/"
    return re.compile(regex.removesuffix("/") + r"\Z")


def _walk(root: Path) -> Iterator[Path]:
    """Every non-folder entry under `root`, following symbolic links to folders (a linked folder of documents is
    part of the corpus; pathlib's glob on Python < 3.13 skips them), never into a link back to one of its own
    ancestors (a cycle). A folder that cannot be listed is an error, not silently skipped."""

    def fail(e: OSError) -> None:
        raise DataError(f"{e.filename}: cannot list this folder under data.root ({e.strerror or e})")

    real_root = Path(os.path.realpath(root))
    for folder, dirs, files in os.walk(root, followlinks=True, onerror=fail):
        here = Path(folder)
        ancestors = {os.path.realpath(p) for p in [here, *here.parents] if p == root or root in p.parents}
        # hidden folders (.git) are never documents; a link to an ancestor would loop forever
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and os.path.realpath(here / d) not in ancestors)
        outside = [d for d in dirs if not Path(os.path.realpath(here / d)).is_relative_to(real_root)]
        dirs[:] = [d for d in dirs if d not in outside]
        for name in [*files, *outside]:  # a link out of data.root is listed, and refused when read (check_link)
            yield here / name


def check_link(path: Path, root: Path) -> None:
    """A FileError (data.on_error decides) for a path that is, or goes through, a symbolic link that loops, points
    to nothing, or resolves outside data.root: the corpus is what lies under data.root, never /etc or /dev."""
    try:
        target = path.resolve(strict=True)
    except FileNotFoundError:
        raise _not_found(path) from None
    except (OSError, RuntimeError) as e:  # ELOOP (Python raises RuntimeError for a loop it detects itself)
        raise FileError(f"{path}: a symbolic link cycle ({getattr(e, 'strerror', None) or e})") from None
    real_root = root.resolve()
    if not target.is_relative_to(real_root):
        raise FileError(
            f"{path}: a symbolic link to {target}, outside data.root ({real_root}): links may only "
            "point inside data.root"
        )


def is_reserved(rel: Path) -> bool:
    """Whether a root-relative path is BEIR queries/qrels or hidden (never a document)."""
    if any(part.startswith(".") for part in rel.parts):
        return True  # .DS_Store, .git/, editor swap files: not content anyone means to index
    return rel.as_posix() in _RESERVED_FILES or (len(rel.parts) > 1 and rel.parts[0] in _RESERVED_DIRS)


def list_documents(root: str | Path, glob: str = "**/*") -> list[Path]:
    """Document files under `root` matching `glob`, sorted (deterministic corpus order)."""
    root = Path(root)
    if not root.exists():
        raise DataError(f"data.root={str(root)!r} does not exist")
    if not root.is_dir():
        raise DataError(f"data.root={str(root)!r} is not a directory")
    if not glob or glob.startswith("/") or ".." in glob.split("/"):
        raise DataError(f"data.glob={glob!r} is not a pattern relative to data.root (e.g. '**/*.md')")
    match = _glob_regex(glob)
    files = []
    for p in _walk(root):  # files, links to files, and links to nothing (read as a bad file: data.on_error)
        rel = p.relative_to(root)
        if match.match(rel.as_posix()) and not is_reserved(rel):
            if rel.name in _RESERVED_FILES:  # another folder's BEIR queries: not documents, and not read as queries
                raise DataError(
                    f"{p}: a queries file below data.root is not read (only data.root/{rel.name} "
                    "is): move it out of data.root or narrow data.glob"
                )
            files.append(p)
    files.sort()
    if not files:
        raise DataError(
            f"data.root={str(root)!r} with data.glob={glob!r} matches no document file "
            f"(supported: {', '.join(SUPPORTED)}; queries.jsonl, qrels/ and hidden files are not documents)"
        )
    return files


def read_file(path: str | Path, root: str | Path) -> Iterator[dict[str, str]]:
    """Yield the documents of one file as {id, title, text, source}; FileError if the file cannot be read."""
    yield from open_documents(path, root)


def open_documents(path: str | Path, root: str | Path) -> Iterator[dict[str, str]]:
    """The documents of one file, as an iterator over {id, title, text, source}.

    Whatever makes the whole file unusable (unsupported, unreadable, binary, not UTF-8, not parquet) raises its
    FileError here, before the first document: so data.on_error=skip drops all of a file or none of it. A .jsonl or
    .parquet file is then read a block at a time (memory bounded by the block, not the file: a corpus exported as
    one multi-GB jsonl is common); a record that fails later raises a DataError, which fails the run anyway.
    """
    path, root = Path(path), Path(root)
    check_link(path, root)
    suffix = path.suffix.lower()
    rel = path.relative_to(root)
    if suffix == ".parquet":
        return _read_parquet(path, _open_parquet(path))
    if suffix not in SUPPORTED:
        # Every matching file is meant to be a document: an image or PDF in the folder is a problem to report.
        raise FileError(
            f"{path}: unsupported file type {suffix or '(no extension)'!r} (supported: {', '.join(SUPPORTED)}); "
            "remove it or narrow data.glob"
        )
    if suffix == ".jsonl":
        _check_text(path)
        return _read_jsonl(path)
    return iter(_single_document(path, suffix, rel.with_suffix("").as_posix()))


def _single_document(path: Path, suffix: str, doc_id: str) -> list[dict[str, str]]:
    """The one document of a .txt / .md / .html file (read whole: it is one document)."""
    size = path.stat().st_size
    if size > MAX_DOCUMENT_BYTES:
        raise FileError(
            f"{path}: one document of {size / 2**20:.1f} MiB, over the {MAX_DOCUMENT_BYTES // 2**20} MiB "
            f"a single {suffix} file may hold (a dump rather than a document); split it into files, or into "
            ".jsonl records"
        )
    raw = _read_bytes(path)
    text = _decode(path, raw)
    if suffix in (".html", ".htm"):
        title, body = html_to_text(raw)
    elif suffix in (".md", ".markdown"):
        title, body = markdown_to_text(text)
    else:
        title, body = "", text
    if not clean_text(body):  # e.g. only control characters: nothing to index, a bad file (data.on_error)
        raise FileError(f"{path}: no text to index ({len(text):,} characters, none of them text after cleaning)")
    return [{"id": doc_id, "title": title, "text": body, "source": str(path)}]


def _read_bytes(path: Path) -> bytes:
    """The file's bytes; an OS error (permissions, a dangling link) becomes a FileError."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise _not_found(path) from None
    except OSError as e:
        raise FileError(f"{path}: cannot be read ({e.strerror or e})") from None


def _check_text(path: Path) -> None:
    """FileError if the file is unreadable, binary (a NUL byte) or not strict UTF-8, read a block at a time (the
    same checks and byte offsets as `_decode`, without holding the file)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        with open(path, "rb") as f:
            while block := f.read(READ_BLOCK):
                nul = block.find(b"\x00")
                if nul >= 0:
                    raise FileError(f"{path}: binary file (NUL byte at byte offset {offset + nul})")
                _decode_block(path, decoder, block, offset)
                offset += len(block)
            _decode_block(path, decoder, b"", offset, final=True)
    except FileNotFoundError:
        raise _not_found(path) from None
    except OSError as e:
        raise FileError(f"{path}: cannot be read ({e.strerror or e})") from None


def _decode_block(
    path: Path, decoder: codecs.IncrementalDecoder, block: bytes, offset: int, final: bool = False
) -> None:
    """Feed one block to an incremental UTF-8 decoder; FileError with the file's byte offset of a bad sequence."""
    pending = len(decoder.getstate()[0])  # bytes of an unfinished character carried over from the last block
    try:
        decoder.decode(block, final=final)
    except UnicodeDecodeError as e:
        raise FileError(f"{path}: not valid UTF-8 at byte offset {offset - pending + e.start} ({e.reason})") from None


def _decode(path: Path, raw: bytes) -> str:
    """Strict UTF-8 (a leading BOM dropped); NUL bytes mean a binary file."""
    nul = raw.find(b"\x00")
    if nul >= 0:  # valid UTF-8 may contain NUL, but no text document does: it is a binary file
        raise FileError(f"{path}: binary file (NUL byte at byte offset {nul})")
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise FileError(f"{path}: not valid UTF-8 at byte offset {e.start} ({e.reason})") from None


def html_to_text(raw: bytes) -> tuple[str, str]:
    """(title, visible text) of an HTML page: script/style/head dropped, one line per block element."""
    # lazy: lxml only serves HTML documents
    import lxml.html
    from lxml import etree

    try:
        root = lxml.html.document_fromstring(raw, parser=lxml.html.HTMLParser(encoding="utf-8"))
    except (etree.ParserError, ValueError):  # "Document is empty": no text, reported by the caller
        return "", ""
    title = (root.findtext(".//title") or "").strip()
    for el in root.xpath(_DROP):
        el.drop_tree()
    for el in root.iter(*_BLOCKS):
        el.tail = "\n" + (el.tail or "")  # block boundaries become line breaks (sentence boundaries for chunking)
    body = root.find("body")
    text = (body if body is not None else root).text_content()
    if not title:
        h1 = root.find(".//h1")
        title = h1.text_content().strip() if h1 is not None else ""
    first, _, rest = text.lstrip().partition("\n")
    if title and first.strip() == title:
        text = rest  # a leading <h1> repeating the title: it is prepended to every chunk anyway
    return title, text


def markdown_to_text(text: str) -> tuple[str, str]:
    """(title, text) of a Markdown file: the first level-1 heading (`# T`, or `T` underlined with `===`) is the
    title; heading markers are dropped, except inside fenced code blocks, which are kept as written."""
    title, lines, fence = "", [], ""
    for line in text.splitlines():
        marker = line.lstrip()[:3]
        if fence:  # inside ``` / ~~~: code, where a leading '#' is a comment, not a heading
            fence = "" if marker == fence else fence
            lines.append(line)
            continue
        if marker in ("```", "~~~"):
            fence = marker
            lines.append(line)
            continue
        m = _H1.match(line)
        if m and not title:
            title = m.group(1)
            continue
        if not title and _SETEXT_H1.match(line) and lines and lines[-1].strip():
            title = lines.pop().strip()  # a setext heading: the line above the ===
            continue
        lines.append(_HEADING.sub("", line))
    return title, "\n".join(lines)


def _doc_from_record(obj: Any, where: str) -> dict[str, str]:
    """Validate one jsonl/parquet record and return {id, title, text, source}."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected an object with _id/id, title, text, got {type(obj).__name__}")
    doc_id = obj.get("_id", obj.get("id"))
    if isinstance(doc_id, int) and not isinstance(doc_id, bool):
        doc_id = str(doc_id)  # numeric ids are common in exported tables
    if not isinstance(doc_id, str) or not doc_id:
        raise DataError(f"{where}: missing or non-string document id (key '_id' or 'id'), got {doc_id!r}")
    text, title = obj.get("text"), obj.get("title")
    title = "" if title is None else title  # absent or null: no title; anything else must be a string
    if not isinstance(text, str):
        raise DataError(f"{where}: key 'text' must be a string, got {type(text).__name__}")
    if not isinstance(title, str):
        raise DataError(f"{where}: key 'title' must be a string, got {type(title).__name__}")
    return {"id": doc_id, "title": title, "text": text, "source": where}


def _read_jsonl(path: Path) -> Iterator[dict[str, str]]:
    """One document per non-blank line, streamed (the file was checked by `_check_text` first)."""
    try:
        # utf-8-sig drops a leading BOM; lines end at \n, \r\n or \r only, as JSON Lines define them (a raw
        # U+2028 inside a JSON string is valid JSON, and str.splitlines would have cut the record there)
        with open(path, encoding="utf-8-sig", newline="") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: invalid JSON ({e})") from None
                yield _doc_from_record(obj, f"{path}:{lineno}")
    except (OSError, UnicodeDecodeError) as e:  # checked a moment ago: the file changed while it was being read
        raise DataError(f"{path}: changed or became unreadable while being read ({e})") from None


def _open_parquet(path: Path) -> Any:
    """The open pyarrow ParquetFile and the columns to read; FileError if it is not a parquet file."""
    # lazy: pyarrow loads a native library; this module imports without it
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except FileNotFoundError:
        raise _not_found(path) from None
    except (OSError, pa.ArrowException) as e:  # ArrowInvalid (not parquet at all) is a ValueError, not an OSError
        raise FileError(f"{path}: cannot be read as parquet ({e})") from None
    cols = set(pf.schema_arrow.names)
    if not ({"_id", "id"} & cols) or "text" not in cols:
        raise DataError(f"{path}: parquet columns {sorted(cols)} lack an id column ('_id' or 'id') or 'text'")
    return pf


def _read_parquet(path: Path, pf: Any) -> Iterator[dict[str, str]]:
    """One document per row of a parquet file with columns _id|id, text, title (optional), a batch at a time."""
    import pyarrow as pa  # lazy: pyarrow loads a native library; this module imports without it

    keep = [c for c in ("_id", "id", "title", "text") if c in pf.schema_arrow.names]
    i = 0
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=keep):
            for row in batch.to_pylist():
                yield _doc_from_record(row, f"{path}:row {i}")
                i += 1
    except (OSError, pa.ArrowException) as e:  # opened a moment ago: a corrupt row group, or the file changed
        raise DataError(f"{path}: unreadable at row {i} ({e})") from None
