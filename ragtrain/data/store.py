"""Passages on disk: one Arrow IPC file, memory-mapped, that every stage reads instead of a corpus dict in memory.

The driver keeps ids (and, once asked for, an id -> row map) at most; texts stay in the file and are read a batch at a
time by whoever needs them: the Ray Data encode (rows by range), the trainer workers (texts by corpus position),
evaluation and the generator (texts by id). Pickling a store or its text view sends only the file's path, so the
file must sit where every worker can read it (`<output_dir>/corpus/`, like Ray Train's storage on a cluster).

Written once by `StoreWriter` (batches of rows, a temporary name renamed on close). The fingerprint that saved
indexes carry (`corpus_fingerprint`) hashes the passage count first, so the writer hashes the finished file once, a
record batch at a time, and keeps the digest beside it: later readers never re-hash the corpus.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .types import DataError, Passage, corpus_fingerprint

__all__ = ["PassageStore", "PassageTexts", "StoreWriter", "write_store"]

COLUMNS = ("id", "title", "text", "doc_id", "start", "end")
BATCH_ROWS = 4096  # rows per record batch: the unit the writer buffers and a reader touches


def _schema():
    import pyarrow as pa  # lazy: pyarrow loads a native library; this module imports without it

    return pa.schema(
        [
            ("id", pa.string()),
            ("title", pa.string()),
            ("text", pa.string()),
            ("doc_id", pa.string()),
            ("start", pa.int64()),
            ("end", pa.int64()),
        ]
    )


def _full_text(title: str, text: str) -> str:
    return (title + " " + text).strip()  # Passage.full_text: an empty title adds no leading space


class StoreWriter:
    """Append passages a batch at a time; `close()` renames the file into place and returns the open store."""

    def __init__(self, path: str | Path, check_ids: bool = True):
        import pyarrow as pa  # lazy: pyarrow loads a native library; this module imports without it

        self.path = Path(path)
        self.check_ids = check_ids  # False: the caller guarantees unique ids (no set of every id kept here)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self._sink = pa.OSFile(str(self._tmp), "wb")
        self._writer = pa.ipc.new_file(self._sink, _schema())
        self._buf: dict[str, list] = {c: [] for c in COLUMNS}
        self._ids: set[str] = set()
        self.count = 0

    def add(self, p: Passage, where: str = "") -> None:
        """Append one passage (its id must be new)."""
        if self.check_ids:
            if p.id in self._ids:
                raise DataError(f"{where or self.path}: duplicate passage id {p.id!r}")
            self._ids.add(p.id)
        for c, v in zip(COLUMNS, (p.id, p.title, p.text, p.doc_id, p.start, p.end)):
            self._buf[c].append(v)
        self.count += 1
        if len(self._buf["id"]) >= BATCH_ROWS:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa  # lazy: pyarrow loads a native library; this module imports without it

        if self._buf["id"]:
            self._writer.write_batch(pa.record_batch([self._buf[c] for c in COLUMNS], schema=_schema()))
            self._buf = {c: [] for c in COLUMNS}

    def close(self) -> PassageStore:
        """Finish the file (fingerprint in its metadata), move it into place, and open it."""
        self._flush()
        self._writer.close()
        self._sink.close()
        # RetrievalData.fingerprint hashes the passage count first, known only now: hash the finished file (read
        # a record batch at a time from the memory map) rather than change the fingerprint saved indexes carry
        fp = _fingerprint(self.count, self._tmp)
        os.replace(self._tmp, self.path)
        _meta_path(self.path).write_text(json.dumps({"count": self.count, "fingerprint": fp}))
        return PassageStore(self.path)

    def abort(self) -> None:
        """Drop the half-written file (nothing half-written is left behind)."""
        try:
            self._writer.close()
            self._sink.close()
        finally:
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        if exc_type is not None:
            self.abort()


def _meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _fingerprint(count: int, path: Path) -> str:
    """`corpus_fingerprint` of the rows in `path`, read a record batch at a time."""
    import pyarrow as pa  # lazy: pyarrow loads a native library; this module imports without it

    def rows() -> Iterator[tuple[str, str, str]]:
        with pa.memory_map(str(path)) as src:
            reader = pa.ipc.open_file(src)
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                yield from zip(*(batch.column(c).to_pylist() for c in ("id", "title", "text")))

    return corpus_fingerprint(count, rows())


def write_store(path: str | Path, passages: Iterable[Passage], check_ids: bool = True) -> PassageStore:
    """Write passages (any iterable, consumed once) into a store at `path` and open it; `check_ids=False` when the
    ids are unique by construction."""
    with StoreWriter(path, check_ids) as w:
        for p in passages:
            w.add(p)
        return w.close()


class PassageStore(Mapping[str, Passage]):
    """A read-only {passage id: Passage} mapping over a store file; texts are read on demand from the memory map."""

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()
        if not self.path.is_file():
            raise DataError(f"passage store {self.path} does not exist")
        self._table: Any = None
        self._ids: list[str] | None = None
        self._row: dict[str, int] | None = None

    def __reduce__(self):  # pickles as its path: workers open the file themselves
        return (PassageStore, (str(self.path),))

    @property
    def table(self):
        """The whole file as a zero-copy Arrow table over the memory map (pages are read when touched)."""
        if self._table is None:
            import pyarrow as pa  # lazy: pyarrow loads a native library; this module imports without it

            self._table = pa.ipc.open_file(pa.memory_map(str(self.path))).read_all()
        return self._table

    def ids(self) -> list[str]:
        """Passage ids in corpus order (the one per-passage list the driver keeps)."""
        if self._ids is None:
            self._ids = self.table.column("id").to_pylist()
        return self._ids

    def row_of(self, pid: str) -> int:
        """The corpus position of a passage id (KeyError if absent)."""
        if self._row is None:
            self._row = {p: i for i, p in enumerate(self.ids())}
        return self._row[pid]

    def __len__(self) -> int:
        return self.table.num_rows

    def __iter__(self) -> Iterator[str]:
        return iter(self.ids())

    def __contains__(self, pid: object) -> bool:
        try:
            self.row_of(pid)  # type: ignore[arg-type]
        except KeyError:
            return False
        return True

    def __getitem__(self, pid: str) -> Passage:
        return self.passages([self.row_of(pid)])[0]

    def passages(self, rows: Sequence[int]) -> list[Passage]:
        """The passages at these corpus positions."""
        cols = self.table.take(list(rows)).to_pydict()
        return [Passage(*v) for v in zip(*(cols[c] for c in COLUMNS))]

    def full_texts(self, rows: Sequence[int]) -> list[str]:
        """`Passage.full_text()` of the passages at these corpus positions."""
        t = self.table.select(["title", "text"]).take(list(rows)).to_pydict()
        return [_full_text(a, b) for a, b in zip(t["title"], t["text"])]

    def slice_texts(self, start: int, stop: int) -> tuple[list[str], list[str]]:
        """(ids, full texts) of rows [start, stop): the encode pipeline's read."""
        t = self.table.slice(start, stop - start).select(["id", "title", "text"]).to_pydict()
        return t["id"], [_full_text(a, b) for a, b in zip(t["title"], t["text"])]

    def iter_batches(self, rows: int = BATCH_ROWS) -> Iterator[list[Passage]]:
        """Every passage in corpus order, `rows` at a time."""
        for start in range(0, len(self), rows):
            yield self.passages(range(start, min(len(self), start + rows)))

    def values(self) -> Iterator[Passage]:  # type: ignore[override]
        for batch in self.iter_batches():
            yield from batch

    def items(self) -> Iterator[tuple[str, Passage]]:  # type: ignore[override]
        for p in self.values():
            yield p.id, p

    def texts(self) -> PassageTexts:
        """A list-like view of the full texts by corpus position (what the trainer indexes), pickled as the path."""
        return PassageTexts(self)

    def fingerprint(self) -> str:
        """RetrievalData.fingerprint of this corpus (computed when the store was written)."""
        meta = _meta_path(self.path)
        if meta.is_file():
            return json.loads(meta.read_text())["fingerprint"]
        fp = _fingerprint(len(self), self.path)
        try:  # cache it beside the file; a run folder someone else owns is read-only, and then it is recomputed
            meta.write_text(json.dumps({"count": len(self), "fingerprint": fp}))
        except OSError:
            pass
        return fp

    def doc_of(self) -> dict[str, str]:
        """{passage id: document id} for chunk passages (empty when every passage is a whole document)."""
        docs = self.table.column("doc_id").to_pylist()
        return {p: d for p, d in zip(self.ids(), docs) if d}


class PassageTexts(Sequence[str]):
    """Full passage texts by corpus position, read from the store on access (`texts[i]`, `texts[a:b]`,
    `texts[[i, j]]`)."""

    def __init__(self, store: PassageStore):
        self.store = store

    def lengths(self) -> list[int]:
        """Characters of every full text (title + " " + text, as embedded), computed in Arrow without the texts
        (for sorting shards by length: whitespace at the ends that `full_text`'s strip drops is still counted)."""
        import pyarrow.compute as pc  # lazy: pyarrow loads a native library; this module imports without it

        title = pc.utf8_length(self.store.table.column("title"))
        text = pc.utf8_length(self.store.table.column("text"))
        both = pc.add(pc.add(title, text), pc.if_else(pc.and_(pc.greater(title, 0), pc.greater(text, 0)), 1, 0))
        return both.to_pylist()

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.store.full_texts(range(*i.indices(len(self))))
        if isinstance(i, (list, tuple)):  # several positions in one read
            return self.store.full_texts(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"passage position {i} out of range (0..{len(self) - 1})")
        return self.store.full_texts([i])[0]
