"""Corpus preparation on Ray Data: files -> read + clean, documents -> chunks, each on Ray Data tasks.

The per-document work (`open_documents`, `clean`, `chunk_document`) is the same code the driver runs for small corpora;
here it runs in parallel on the cluster and streams back, in order, to the driver's single store writer, which
only deduplicates (ids and content hashes) and appends. So both ways give the same store, byte for byte, and the
same errors. Errors travel as rows (`error` set), not exceptions: the driver raises the first one in corpus order
as the same one-line DataError, or counts a skipped file under data.on_error=skip.

`data.prepare=auto` (the default) prepares on Ray Data once the corpus files hold `RAY_MIN_BYTES` or more; smaller
corpora are read in the driver, before Ray starts, where a bad file fails fastest.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ragtrain.data.clean import clean
from ragtrain.data.store import PassageStore
from ragtrain.data.types import DataError

from .chunk import chunk_document
from .read import FileError, MissingFileError, open_documents

__all__ = ["RAY_MIN_BYTES", "chunk_batch", "chunk_on_ray", "read_clean_batch", "read_on_ray", "use_ray"]

RAY_MIN_BYTES = 64 << 20  # data.prepare=auto: corpora of at least this many file bytes are prepared on Ray Data
FILES_PER_TASK = 16  # files one read task reads: small files amortise the task, large ones still spread out
DOCS_PER_CALL = 512  # documents one chunk task tokenizes
ROWS_PER_BLOCK = 4096  # documents a read task emits per block at most (a large .jsonl file becomes many blocks),
BLOCK_CHARS = 32 << 20  # and characters of text: 4,096 long documents would still make a large block
PREP_CPUS = 0.25  # per read / chunk task: light next to an encode actor, and a 2-CPU laptop keeps its reserve
FIELDS = ("id", "title", "text", "source", "error", "file_error")


def use_ray(prepare: str, corpus_bytes: int) -> bool:
    """Whether data.prepare (auto | driver | ray) runs on Ray Data for a corpus of `corpus_bytes` file bytes."""
    if prepare not in ("auto", "driver", "ray"):
        raise ValueError(f"data.prepare must be one of ['auto', 'driver', 'ray'], got {prepare!r}")
    return prepare == "ray" or (prepare == "auto" and corpus_bytes >= RAY_MIN_BYTES)


def read_clean_batch(batch: dict[str, np.ndarray], root: str) -> Iterator[dict[str, np.ndarray]]:
    """Ray Data (a task per batch of file paths): each file's cleaned documents as rows, or one error row; yielded
    a block of at most `ROWS_PER_BLOCK` rows or about `BLOCK_CHARS` characters at a time, so a file of millions of
    records never becomes one block."""
    rows: dict[str, list] = {f: [] for f in FIELDS}
    chars = [0]

    def emit(doc: dict[str, str], error: str = "", file_error: bool = False) -> None:
        for f in ("id", "title", "text", "source"):
            rows[f].append(doc.get(f, ""))
        rows["error"].append(error)
        rows["file_error"].append(file_error)

    def block() -> dict[str, np.ndarray]:
        out = {f: np.array(v, dtype=bool if f == "file_error" else object) for f, v in rows.items()}
        for v in rows.values():
            v.clear()
        chars[0] = 0
        return out

    for path in batch["path"].tolist():
        try:  # whatever makes the whole file unusable fails here, before its first document (as in the driver)
            docs = open_documents(path, root)
        except FileError as e:  # subject to data.on_error
            emit({"source": str(path)}, str(e), True)
            continue
        except MissingFileError:  # not a bad file: name the node that cannot see it
            import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

            node = ray.get_runtime_context().get_node_id()[:12] if ray.is_initialized() else "?"
            emit({"source": str(path)}, str(MissingFileError(Path(path), f" on Ray node {node}")))
            continue
        except DataError as e:  # e.g. parquet columns without an id: fails the run whatever on_error says
            emit({"source": str(path)}, str(e))
            continue
        try:
            for d in docs:
                doc = clean(d)
                emit(doc)
                chars[0] += len(doc["text"]) + len(doc["title"])
                if len(rows["id"]) >= ROWS_PER_BLOCK or chars[0] >= BLOCK_CHARS:
                    yield block()
        except DataError as e:  # a bad record, a bad id or an empty document: fails the run whatever on_error says
            emit({"source": str(path)}, str(e))
    if rows["id"]:
        yield block()


@contextmanager
def _ordered():
    """Ray Data keeps the input order while this is open (the store's order must not depend on timing)."""
    from ray.data import DataContext  # lazy: ray is heavy (~0.5 s); this module imports without it

    ctx = DataContext.get_current()
    saved = ctx.execution_options.preserve_order, ctx.enable_progress_bars
    ctx.execution_options.preserve_order, ctx.enable_progress_bars = True, False
    try:
        yield
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved


def _rows(ds: Any) -> Iterator[dict[str, Any]]:
    """A dataset's rows as dicts, in order, converted to Python one row at a time.

    Ray Data merges the batches a task yields into blocks of up to `target_max_block_size` (128 MiB), and turning a
    whole block into numpy object arrays or Python lists holds all its texts at once: the driver's heap grew by
    ~1.3x the corpus text that way (benchmarks/README.md, `large_file.py`). Arrow blocks are read zero-copy from
    the object store.
    """
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        columns = {name: batch.column(name) for name in batch.column_names}
        for i in range(batch.num_rows):
            yield {name: col[i].as_py() for name, col in columns.items()}


def read_on_ray(files: Sequence[Path], root: str | Path) -> Iterator[dict[str, Any]]:
    """The cleaned documents of `files` in file order, read on Ray Data tasks; a file that failed to read yields
    {"file_error": message}; any other error (bad id, empty document) raises its DataError in the driver."""
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    items = [{"path": str(p)} for p in files]
    with _ordered():
        ds = ray.data.from_items(items, override_num_blocks=max(1, -(-len(items) // FILES_PER_TASK)))
        ds = ds.map_batches(
            read_clean_batch,
            fn_kwargs={"root": str(root)},
            batch_size=FILES_PER_TASK,
            batch_format="numpy",
            num_cpus=PREP_CPUS,
        )
        for row in _rows(ds):
            if row["error"]:
                if row["file_error"]:
                    yield {"file_error": row["error"]}
                    continue
                raise DataError(row["error"])
            yield {f: row[f] for f in ("id", "title", "text", "source")}


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(retriever: Any) -> Any:
    """The retriever's tokenizer, loaded once per worker process (Ray reuses task workers across batches)."""
    # lazy: ragtrain.embed.model imports torch; this module imports without it
    from ragtrain.embed.model import load_tokenizer

    key = repr(retriever)  # the config is a mutable dataclass (unhashable); its repr names everything that matters
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(retriever)
    return _TOKENIZERS[key]


def chunk_batch(
    batch: dict[str, np.ndarray], retriever: Any, store: str, max_tokens: int, overlap: int
) -> dict[str, np.ndarray]:
    """Ray Data (a task per range of a documents store): passage rows {id, title, text, doc_id, start, end}, or one
    error row for a document that cannot be chunked."""
    tokenizer, docs = _tokenizer(retriever), PassageStore(store)
    cols: dict[str, list] = {c: [] for c in ("id", "title", "text", "doc_id", "start", "end", "error")}
    for start, stop in zip(batch["start"].tolist(), batch["stop"].tolist()):
        for doc in docs.passages(range(start, stop)):
            record = {"id": doc.id, "title": doc.title, "text": doc.text, "source": f"document {doc.id!r}"}
            try:
                chunks, error = chunk_document(record, tokenizer, max_tokens, overlap), ""
            except DataError as e:
                chunks, error = [{"id": "", "doc_id": doc.id, "title": "", "text": "", "start": 0, "end": 0}], str(e)
            for c in chunks:
                for k in ("id", "title", "text", "doc_id", "start", "end"):
                    cols[k].append(c[k])
                cols["error"].append(error)
    return {k: np.array(v, dtype=np.int64 if k in ("start", "end") else object) for k, v in cols.items()}


def chunk_on_ray(store: Any, retriever: Any, max_tokens: int, overlap: int, tasks: int) -> Iterator[dict[str, Any]]:
    """The chunk records of every document in a documents `PassageStore`, in store order, chunked by up to `tasks`
    Ray Data tasks at a time; a document that cannot be chunked raises its DataError in the driver.

    Tasks, not an actor pool: the tokenizer loads in well under a second and is cached per worker process, while
    actors would each start a fresh process (torch + transformers imports, seconds apiece)."""
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    n = len(store)
    ranges = [{"start": s, "stop": min(n, s + DOCS_PER_CALL)} for s in range(0, n, DOCS_PER_CALL)]
    with _ordered():
        ds = ray.data.from_items(ranges, override_num_blocks=max(1, len(ranges)))
        ds = ds.map_batches(
            chunk_batch,
            fn_kwargs=dict(retriever=retriever, store=str(store.path), max_tokens=max_tokens, overlap=overlap),
            batch_size=1,
            batch_format="numpy",
            num_cpus=PREP_CPUS,
            concurrency=max(1, tasks),
        )
        for row in _rows(ds):
            if row["error"]:
                raise DataError(row["error"])
            yield {k: row[k] for k in ("id", "title", "text", "doc_id", "start", "end")}
