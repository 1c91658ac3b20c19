"""Checksums over every file a search of a saved sharded index reads, and the consistency of its list of shards.

A shard's `manifest.json` records the sha256 of each of its files (`index.faiss`, `doc_ids.txt`, `index_meta.json`);
the index's `sharded.json` records the sha256 of each shard's manifest and of the index's own `index_meta.json`, and
of itself (`checksum`, over its other content). So an edit anywhere (a row's id, a shard's range, the metadata) is
caught before a search answers with another passage's id. Beyond checksums, the list must describe one index:
contiguous row ranges from 0 that add up to the metadata's rows, every shard of its dim, factory, encoder and corpus.

Hashing every file costs a read of the whole index: fine once, too much for every query of a large one. Inside
`verified_stamps(path)` (`python -m ragtrain search` / `ask`), a file whose checksum matched is recorded with
its stamp (size, mtime_ns, ctime_ns, inode) in `path`; a later check re-hashes only a file whose stamp changed. Any
write to a file changes its ctime (which no user call can set back) and mtime, so a damaged file is hashed again
and still fails; a file written in the last RACY_SECONDS is never stamped (a write in the same timestamp tick
could leave its stamp unchanged).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from ragtrain.index.faiss_index import IDS_FILE, INDEX_FILE, META_FILE, METRIC, IndexMismatchError

SHARD_FILES = (INDEX_FILE, IDS_FILE, META_FILE)  # what `load_index` reads from a shard's folder


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


RACY_SECONDS = 2.0  # younger files are hashed on every check: the file system's timestamp tick is coarser than 1 ns


class VerifiedStamps:
    """{file: [sha256, size, mtime_ns, ctime_ns, inode]} of the files whose checksum matched, read from and saved
    to one JSON file (an unreadable one counts as empty: every file is hashed again)."""

    def __init__(self, path: Path) -> None:
        self.path, self.changed = Path(path), False
        try:
            stamps = json.loads(self.path.read_text())
            self.stamps: dict[str, list] = stamps if isinstance(stamps, dict) else {}
        except (OSError, ValueError):
            self.stamps = {}

    def matches(self, file: Path, digest: str) -> bool:
        """Whether `file` holds the bytes of `digest`: by its stamp when it was verified before and is unchanged."""
        key, st = str(file.resolve()), file.stat()
        stamp = [digest, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        if self.stamps.get(key) == stamp:
            return True
        if sha256_file(file) != digest:
            return False
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_SECONDS * 1e9:
            self.stamps[key], self.changed = stamp, True
        return True

    def save(self) -> None:
        if not self.changed:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.stamps))
            tmp.replace(self.path)  # atomic: a concurrent search reads the old stamps or the new ones
        except OSError:
            tmp.unlink(missing_ok=True)  # a read-only run folder: every search verifies in full, as before


_STAMPS: ContextVar[VerifiedStamps | None] = ContextVar("verified_stamps", default=None)


@contextlib.contextmanager
def verified_stamps(path: Path) -> Iterator[VerifiedStamps]:
    """The checks inside the block skip files verified before and unchanged since; the stamps of the files they
    verified are saved to `path` when the block ends without an error."""
    stamps = VerifiedStamps(path)
    token = _STAMPS.set(stamps)
    try:
        yield stamps
    finally:
        _STAMPS.reset(token)
    stamps.save()


def _matches(path: Path, digest: Any) -> bool:
    stamps = _STAMPS.get()
    return stamps.matches(path, digest) if stamps is not None else sha256_file(path) == digest


def file_checksums(folder: Path) -> dict[str, str]:
    """{file name: sha256} of a shard folder's SHARD_FILES (for its manifest)."""
    return {name: sha256_file(folder / name) for name in SHARD_FILES}


def check_shard_files(folder: Path, manifest: dict[str, Any], manifest_name: str) -> None:
    """Every file the manifest lists matches its checksum (and it lists every file a search reads)."""
    files = manifest.get("files")
    if not isinstance(files, dict) or set(SHARD_FILES) - set(files):
        raise IndexMismatchError(
            f"index shard {folder}: its {manifest_name} holds no checksum of {list(SHARD_FILES)} (saved by an older "
            "ragtrain): rebuild the index"
        )
    for name, digest in sorted(files.items()):
        path = folder / name
        if not path.exists():
            raise IndexMismatchError(f"index shard {folder}: {name} is missing")
        if not _matches(path, digest):
            raise IndexMismatchError(
                f"index shard {folder} is corrupt: {name} does not match the checksum in its {manifest_name}"
            )


def _content_digest(doc: dict[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal_shard_list(doc: dict[str, Any]) -> dict[str, Any]:
    """The list of shards with `checksum` set over the rest of it."""
    return {**doc, "checksum": _content_digest(doc)}


def check_shard_list(folder: Path, name: str, doc: dict[str, Any]) -> dict[str, Any]:
    """The list's own checksum and that of the index's metadata file; returns that metadata (a dict)."""
    path = folder / name
    if doc.get("checksum") != _content_digest(doc):
        raise IndexMismatchError(f"{path} does not match its own checksum: it was edited or damaged; rebuild the index")
    meta_path = folder / META_FILE
    if not meta_path.exists():
        raise IndexMismatchError(f"{meta_path} is missing: rebuild the index")
    if not _matches(meta_path, doc.get("index_meta")):
        raise IndexMismatchError(f"{meta_path} does not match the checksum in {path}: it was edited or damaged")
    return json.loads(meta_path.read_text())


def check_manifest_file(manifest_path: Path, entry: dict[str, Any], list_path: Path) -> None:
    """A shard's manifest is the one the list of shards recorded."""
    if not _matches(manifest_path, entry.get("manifest")):
        raise IndexMismatchError(
            f"{manifest_path} does not match the checksum in {list_path}: it was edited, or the shard folder "
            "holds another build's files"
        )


def check_consistency(folder: Path, entries: list[dict], manifests: list[dict], meta: dict[str, Any]) -> None:
    """The shards make one index: contiguous ranges from row 0 to the metadata's rows, the ranges the manifests
    record, and every shard of the index's dim, factory, encoder and corpus (and the index of the metric searches
    use)."""
    if meta.get("metric") != METRIC:
        raise IndexMismatchError(f"{folder / META_FILE}: index metric is {meta.get('metric')!r}, expected {METRIC!r}")
    row = 0
    for e, m in zip(entries, manifests):
        shard = folder / e["folder"]
        if (e["start"], e["stop"]) != (m.get("start"), m.get("stop")):
            raise IndexMismatchError(
                f"the list of shards says {shard} holds rows [{e['start']}, {e['stop']}) but its manifest.json "
                f"says [{m.get('start')}, {m.get('stop')})"
            )
        if e["start"] != row or e["stop"] - e["start"] != e["rows"]:
            raise IndexMismatchError(
                f"{folder}: the shards are not contiguous ({shard} holds rows [{e['start']}, {e['stop']}), "
                f"{e['rows']} of them, after row {row})"
            )
        row = e["stop"]
        for key, what in (
            ("dim", "dim"),
            ("factory", "factory"),
            ("encoder", "encoder"),
            ("corpus_fingerprint", "corpus"),
        ):
            if m.get(key) != meta.get(key):
                raise IndexMismatchError(
                    f"{shard} was built by {what} {m.get(key)!r}, the index by {meta.get(key)!r}"
                    if key == "encoder"
                    else f"{shard} has {what} {m.get(key)!r}, the index {meta.get(key)!r}"
                )
    if row != meta.get("ntotal"):
        raise IndexMismatchError(f"{folder}: the shards hold rows [0, {row}), its index_meta.json {meta.get('ntotal')}")
