"""Clean documents: Unicode NFC, whitespace normalised, ids checked, exact duplicates dropped by content hash."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator

from ragtrain.data.types import DataError

__all__ = ["check_id", "clean", "clean_text", "content_hash", "dedupe", "dedupe_stream"]

_SPACES = re.compile(r"[^\S\n]+")  # any whitespace but a newline (tabs, NBSP, thin spaces, ...)
_BLANKS = re.compile(r"\n{3,}")
_BAD_ID = re.compile(r"[\t\n\r\v\f\x85\u2028\u2029]")
# Control characters carry no text (C0 and C1, but tab, line breaks, form feeds and NEL, which are whitespace)
_CONTROLS = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x84\x86-\x9f]")


def clean_text(text: str) -> str:
    """NFC; control characters removed; line breaks unified; runs of spaces collapsed; lines stripped; at most one
    blank line in a row."""
    text = _CONTROLS.sub("", unicodedata.normalize("NFC", text)).replace("\r\n", "\n").replace("\r", "\n")
    # Paragraph breaks survive (one blank line): the chunker prefers them as boundaries.
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


def check_id(doc_id: str, where: str, kind: str = "document") -> None:
    """Raise DataError if an id is empty or holds a tab or line break (the index's doc_ids.txt is one id a line)."""
    if not doc_id.strip():
        raise DataError(f"{where}: empty {kind} id")
    m = _BAD_ID.search(doc_id)
    if m:
        raise DataError(
            f"{where}: {kind} id {doc_id!r} contains {m.group()!r} (tabs and line breaks are not "
            "allowed in ids: qrels are tab-separated and the saved index lists one id a line)"
        )


def clean(doc: dict[str, str]) -> dict[str, str]:
    """A cleaned copy of {id, title, text, source}: the id checked, text normalised, title on one line."""
    where = doc.get("source", "?")
    check_id(doc["id"], where)
    out = dict(doc)
    out["title"] = _SPACES.sub(" ", unicodedata.normalize("NFC", doc.get("title", "")).replace("\n", " ")).strip()
    out["text"] = clean_text(doc["text"])
    if not out["text"]:
        raise DataError(f"{where}: document {doc['id']!r} has no text after cleaning")
    return out


def content_hash(doc: dict[str, str]) -> bytes:
    """sha256 digest of the cleaned title and text (length-prefixed so no two documents serialise alike); raw
    bytes, not hex: the driver keeps one per document while it deduplicates (65 bytes each instead of 113)."""
    h = hashlib.sha256()
    for value in (doc["title"], doc["text"]):
        raw = value.encode("utf-8")
        h.update(len(raw).to_bytes(8, "big"))
        h.update(raw)
    return h.digest()


def dedupe(docs: Iterable[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, str]]:
    """(kept documents in order, {dropped id: kept id}) for cleaned docs; repeated ids raise DataError."""
    docs = list(docs)
    dropped: dict[str, str] = {}

    def locate(doc_id: str) -> str:
        return next(d.get("source", "?") for d in docs if d["id"] == doc_id)

    return list(dedupe_stream(docs, dropped, locate)), dropped


def dedupe_stream(
    docs: Iterable[dict[str, str]], dropped: dict[str, str], locate: Callable[[str], str] | None = None
) -> Iterator[dict[str, str]]:
    """Yield the cleaned docs whose content is new, recording {dropped id: kept id} in `dropped` as it goes.

    Only ids and content digests are kept, so a corpus of any size streams through. A repeated id raises DataError
    naming both places; the first is found again by `locate(id)` (a re-scan, paid only on that error) rather than
    kept for every document: a source string a document would double the driver's memory per document.
    """
    seen: set[str] = set()
    first_with: dict[bytes, str] = {}
    for doc in docs:
        if doc["id"] in seen:
            first = locate(doc["id"]) if locate is not None else "an earlier document"
            raise DataError(f"duplicate document id {doc['id']!r}: in {first} and in {doc['source']}")
        seen.add(doc["id"])
        digest = content_hash(doc)
        if digest in first_with:  # exact duplicate content: index it once; its qrels point at the kept copy
            dropped[doc["id"]] = first_with[digest]
            continue
        first_with[digest] = doc["id"]
        yield doc
