"""A documents folder as one streaming Ray Data pipeline: read -> clean -> chunk -> encode -> write.

Used when the corpus is prepared on Ray (data.prepare=ray, or auto from `RAY_MIN_BYTES` of files) and the run's
first index is encoded with the initial weights (the zero-shot index): files are read and cleaned by Ray Data
tasks, chunked by tasks with the retriever's tokenizer, and embedded by the encode actor pool
(`corpus.encode.encode_stage`, the same `EncodeBatch` as every corpus encode), while later files are still being read.
The driver is the single writer at the end of the stream: rows arrive in corpus order, each passage with its
vector; it keeps ids and content digests only, drops exact duplicate documents, appends the passages to the run's
passage store and the vectors to parquet shards (`<output_dir>/vectors/zeroshot/`), which `Retrieval.build` then
indexes without encoding again (the shards carry the key of the weights and corpus they hold).

The store and the vectors are the same as the two-step path's (prepare into the store, then encode it): same
passages in the same order, same fingerprint (tests/corpus/test_stream.py). What changes is when errors surface:
the checks that need the whole corpus (a bad file under data.on_error=fail, a duplicate id in the last file, qrels
naming unknown documents, more IVF lists than passages, fewer training examples than one batch) run first, on a
pass of read -> clean -> chunk that sends the driver ids and digests only, before anything is encoded; whatever a
failing stream wrote is removed.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ragtrain.config.data import DataConfig
from ragtrain.config.index import IndexConfig
from ragtrain.config.resources import PoolResources
from ragtrain.config.retriever import RetrieverConfig
from ragtrain.data.beir import load_beir
from ragtrain.data.clean import content_hash
from ragtrain.data.store import StoreWriter, _full_text
from ragtrain.data.types import DataError, Passage, RetrievalData

from .chunk import chunk_document
from .dataset import check_corpus_ids, locate
from .encode import build_threads, encode_stage, write_vectors
from .prepare import FILES_PER_TASK, PREP_CPUS, _ordered, _tokenizer, read_clean_batch

__all__ = ["StreamEncode", "passages_batch", "stream_documents"]

# vectors per shard file the driver writes: it buffers one file's worth (6 MB at 384 dims), so fewer than
# encode_to_vectors' VECTOR_FILE_ROWS, whose files Ray Data's write tasks write
SHARD_ROWS = 4096
# Ray Data merges what a task yields into blocks of up to DataContext.target_max_block_size (128 MiB), and an encode
# actor takes whole blocks: a 20,000-document corpus made five blocks, and one of two actors encoded all of them
# (benchmarks/README.md, "One stream against two"). Blocks of about 1 MiB (~500 encoded rows of 384 dims) keep every
# actor fed and the driver's share of the stream small.
STREAM_BLOCK_BYTES = 1 << 20
PASSAGE_COLUMNS = (
    "id",
    "title",
    "text",
    "doc_id",
    "start",
    "end",
    "doc",
    "first",
    "digest",
    "embed",
    "source",
    "error",
    "file_error",
)


@dataclass
class StreamEncode:
    """The run's first encode, done inside the corpus stream: the initial weights (built only if the stream runs),
    the index and pool settings, the shard folder, and the fault injection of the tests."""

    weights: Callable[[], dict]
    index: IndexConfig
    pool: PoolResources
    folder: Path
    fault: Any = None  # EncodeFault
    key: Callable[[dict, str], str] | None = None  # (weights, corpus fingerprint) -> the shards' key
    # the run's whole-corpus checks (qrels, the training batch, IVF lists against the passage count): called with the
    # dataset (ids only) and the passage count by the first pass, before anything is encoded
    precheck: Callable[[RetrievalData, int], None] | None = None
    stats_dir: str | None = None  # benchmarks: per-actor rows, seconds and RSS (EncodeBatch)


def passages_batch(
    batch: dict[str, np.ndarray],
    retriever: RetrieverConfig,
    chunk: tuple[int, int] | None,
    columns: Sequence[str] = PASSAGE_COLUMNS,
) -> dict[str, np.ndarray]:
    """Ray Data (a task per block of cleaned documents): the passage rows of each document, chunked with the
    retriever's tokenizer when `chunk` = (max_tokens, overlap), else the document itself; error rows pass through.
    `columns`: the ones returned (the checks' first pass sends the driver no text)."""
    cols: dict[str, list] = {c: [] for c in PASSAGE_COLUMNS}

    def emit(
        p: dict[str, Any], doc: str, first: bool, digest: bytes, source: str, error: str = "", file_error: bool = False
    ) -> None:
        for k in ("id", "title", "text", "doc_id"):
            cols[k].append(p.get(k, ""))
        cols["start"].append(int(p.get("start", 0)))
        cols["end"].append(int(p.get("end", 0)))
        cols["embed"].append(_full_text(p.get("title", ""), p.get("text", "")) if not error else "")
        for k, v in (
            ("doc", doc),
            ("first", first),
            ("digest", digest),
            ("source", source),
            ("error", error),
            ("file_error", file_error),
        ):
            cols[k].append(v)

    tokenizer = _tokenizer(retriever) if chunk else None
    for i in range(len(batch["id"])):
        source = str(batch["source"][i])
        if batch["error"][i]:
            emit({}, "", False, b"", source, str(batch["error"][i]), bool(batch["file_error"][i]))
            continue
        doc = {k: str(batch[k][i]) for k in ("id", "title", "text", "source")}
        digest = content_hash(doc)
        if chunk is None:
            parts = [{"id": doc["id"], "title": doc["title"], "text": doc["text"]}]
        else:
            try:
                parts = chunk_document(doc, tokenizer, *chunk)
            except DataError as e:
                emit({}, doc["id"], True, digest, source, str(e))
                continue
        for k, p in enumerate(parts):
            emit(p, doc["id"], k == 0, digest, source)
    types = {"start": np.int64, "end": np.int64, "first": bool, "file_error": bool}
    return {k: np.array(cols[k], dtype=types.get(k, object)) for k in columns}


@contextmanager
def _block_bytes(size: int):
    """Ray Data's target block size is `size` while this is open."""
    from ray.data import DataContext  # lazy: ray is heavy (~0.5 s); this module imports without it

    ctx = DataContext.get_current()
    saved, ctx.target_max_block_size = ctx.target_max_block_size, size
    try:
        yield
    finally:
        ctx.target_max_block_size = saved


def _passages(
    files: Sequence[Path],
    root: str,
    retriever: RetrieverConfig,
    chunk: tuple[int, int] | None,
    columns: Sequence[str] = PASSAGE_COLUMNS,
) -> Any:
    """read (tasks) -> clean (tasks) -> chunk (tasks): passage rows, error rows included."""
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    items = [{"path": str(p)} for p in files]
    ds = ray.data.from_items(items, override_num_blocks=max(1, -(-len(items) // FILES_PER_TASK)))
    ds = ds.map_batches(
        read_clean_batch, fn_kwargs={"root": root}, batch_size=FILES_PER_TASK, batch_format="numpy", num_cpus=PREP_CPUS
    )
    return ds.map_batches(
        passages_batch,
        fn_kwargs={"retriever": retriever, "chunk": chunk, "columns": columns},
        batch_size=None,
        batch_format="numpy",
        num_cpus=PREP_CPUS,
    )


def _dataset(
    files: Sequence[Path],
    root: str,
    retriever: RetrieverConfig,
    chunk: tuple[int, int] | None,
    weights_ref: Any,
    enc: StreamEncode,
    per_call: int,
) -> Any:
    """read (tasks) -> clean (tasks) -> chunk (tasks) -> encode (the actor pool): rows with their vectors."""
    ds = _passages(files, root, retriever, chunk)
    return encode_stage(
        ds,
        weights_ref,
        retriever,
        enc.index,
        enc.pool,
        per_call,
        vector_dtype=enc.index.vector_dtype,
        fault=enc.fault,
        stats_dir=enc.stats_dir,
        num_gpus_per_actor=enc.pool.gpus_per_actor,
        text_column="embed",
        keep_columns=True,
        num_threads=build_threads(enc.pool),  # reading and chunking are light next to encoding
    )


class _Gate:
    """The driver's decisions on the stream's rows, in corpus order, keeping ids and content digests only: the first
    error fails (a file's, unless data.on_error=skip), a repeated document id fails naming both places, and every
    passage of a document whose content came before is dropped."""

    def __init__(self, files: Sequence[Path], root: str | Path, on_error: str):
        self.files, self.root, self.on_error = files, root, on_error
        self.seen: set[str] = set()
        self.first_with: dict[bytes, str] = {}
        self.dropped: dict[str, str] = {}  # dropped document id -> the kept one (their qrels move to it)
        self.skipped: list[str] = []
        self.documents = 0
        self._keep = False  # the current document's verdict, which its later passages share
        self.doc = ""  # the current document's id: one string object for all of its passages' doc_of entries

    def keep(self, row: dict[str, Any]) -> bool:
        """Whether this passage row goes into the store and the shards."""
        if row["error"]:
            if not row["file_error"]:
                raise DataError(row["error"])
            if self.on_error == "fail":
                raise DataError(f"{row['error']} (data.on_error=fail; data.on_error=skip skips such files)")
            self.skipped.append(row["error"])
            return False
        if not row["first"]:
            return self._keep
        doc = self.doc = row["doc"]
        self.documents += 1
        if doc in self.seen:
            raise DataError(
                f"duplicate document id {doc!r}: in {locate(self.files, self.root, doc)} and in {row['source']}"
            )
        self.seen.add(doc)
        kept = self.first_with.setdefault(row["digest"], doc)
        self._keep = kept == doc
        if not self._keep:  # exact duplicate content: indexed once; its qrels point at the kept copy
            self.dropped[doc] = kept
        return self._keep


CHECK_COLUMNS = ("doc", "first", "digest", "source", "error", "file_error")


def check_before_encoding(
    files: Sequence[Path],
    root: str | Path,
    cfg: DataConfig,
    retriever: RetrieverConfig,
    chunk: tuple[int, int] | None,
    precheck: Callable[[RetrievalData, int], None],
) -> None:
    """The checks that need the whole corpus, before any encoding: a first pass of read -> clean -> chunk sends the
    driver each passage's document id, digest and error only (no text), through the same gate as the stream (bad
    files, repeated ids, duplicate content), then qrels and `precheck` (the passage count against the index, the
    training batch) run on the ids. It costs a second read of the files, a fraction of the encode it can save."""
    gate = _Gate(files, root, cfg.on_error.value)
    passages = 0
    for batch in _blocks(lambda: _passages(files, str(root), retriever, chunk, CHECK_COLUMNS)):
        cols = {name: batch.column(name).to_pylist() for name in CHECK_COLUMNS}
        for i in range(batch.num_rows):
            passages += gate.keep({name: values[i] for name, values in cols.items()})
    if not passages:
        raise DataError(
            f"data.root={str(root)!r}: no readable document among {len(files)} file(s) "
            f"({len(gate.skipped)} skipped with data.on_error=skip)"
        )
    # every document id read will do for the qrels: those of a dropped duplicate move to its kept copy first
    # load_beir types `corpus` as the passages; a set of ids serves its membership checks alike (as below)
    seen: Any = gate.seen
    data = load_beir(root, split=cfg.split, dev_size=cfg.dev_size, seed=cfg.seed, corpus=seen, doc_alias=gate.dropped)
    check_corpus_ids(data, str(root))
    precheck(data, passages)


def _blocks(dataset: Callable[[], Any]) -> Iterator[Any]:
    """The non-empty blocks (pyarrow tables) of the stream `dataset()` builds, in corpus order: the store, the shards
    and the first error do not depend on timing. The dataset is built inside the ordering settings (a Ray Data
    dataset takes the settings current when it is made)."""
    with _ordered(), _block_bytes(STREAM_BLOCK_BYTES):
        for batch in dataset().iter_batches(batch_size=None, batch_format="pyarrow"):
            if batch.num_rows:
                yield batch


def _keep(batch: Any, gate: _Gate, writer: Any, doc_of: dict[str, str] | None) -> tuple[list[str], np.ndarray]:
    """One streamed block: the rows the gate keeps go to the store (their chunk's document into `doc_of`);
    returns their ids and vectors."""
    vec = batch.column("vector").combine_chunks()
    mat = vec.flatten().to_numpy(zero_copy_only=False).reshape(len(vec), -1)
    cols = {name: batch.column(name).to_pylist() for name in PASSAGE_COLUMNS if name != "embed"}
    ids, kept = [], []
    for i in range(batch.num_rows):
        row = {name: values[i] for name, values in cols.items()}
        if not gate.keep(row):
            continue
        p = Passage(
            id=row["id"], title=row["title"], text=row["text"], doc_id=row["doc_id"], start=row["start"],
            end=row["end"],
        )  # fmt: skip
        writer.add(p)
        if doc_of is not None:
            doc_of[p.id] = gate.doc
        ids.append(p.id)
        kept.append(i)
    return ids, mat[kept]


def seal(shards: Any, seconds: float, key: str, fingerprint: str, driver_s: float) -> None:
    """The streamed vector files' metadata, written again last (`shards.json`): the cache key and the corpus they
    hold, so the run's first index reads them instead of encoding again."""
    shards.seconds = seconds
    shards.stats = {"streamed": True, "key": key, "corpus": fingerprint, "driver_rows_s": round(driver_s, 3)}
    shards.save_meta()


def _shards_of(
    dataset: Callable[[], Any], gate: _Gate, writer: Any, doc_of: dict[str, str] | None, busy: list[float]
) -> Iterator[tuple[list[str], np.ndarray]]:
    """(ids, vectors) of the kept passages of the stream `dataset()` builds, SHARD_ROWS at a time, while their
    texts go to the store; `busy[0]` adds the seconds the driver spent on the rows (not waiting for them): the
    stream's serial part."""
    ids: list[str] = []
    vecs: list[np.ndarray] = []
    for batch in _blocks(dataset):
        t0 = time.perf_counter()
        block_ids, block_vecs = _keep(batch, gate, writer, doc_of)
        ids.extend(block_ids)
        if block_ids:
            vecs.append(block_vecs)
        busy[0] += time.perf_counter() - t0
        if len(ids) >= SHARD_ROWS:
            t0 = time.perf_counter()
            yield ids, np.concatenate(vecs)  # written by write_vectors before the next block is asked for
            ids, vecs = [], []
            busy[0] += time.perf_counter() - t0
    if ids:
        yield ids, np.concatenate(vecs)


def _undo(writer: Any, folder: Path, store_path: Path) -> None:
    """A failed stream leaves nothing: no half-written store (`writer`: still open), no shard folder."""
    if writer is not None:
        writer.abort()
    shutil.rmtree(folder, ignore_errors=True)
    store_path.unlink(missing_ok=True)
    Path(str(store_path) + ".json").unlink(missing_ok=True)


def stream_documents(
    files: Sequence[Path],
    root: str | Path,
    cfg: DataConfig,
    retriever: RetrieverConfig,
    enc: StreamEncode,
    store_path: Path,
    log: Callable[[str], None] = print,
) -> RetrievalData:
    """Read, clean, chunk and encode a documents folder in one Ray Data stream into the passage store at
    `store_path` and vector files in `enc.folder`; returns the dataset (queries and qrels read after the corpus).
    On any error nothing of the stream is left: no store, no shard folder."""
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    chunk = (cfg.chunk.max_tokens, cfg.chunk.overlap) if cfg.chunk.enabled else None
    start = time.perf_counter()
    if enc.precheck is not None:
        check_before_encoding(files, root, cfg, retriever, chunk, enc.precheck)
        took = time.perf_counter() - start
        log(f"[data] {root}: the whole-corpus checks passed in {took:.1f}s on ids, before any vector is computed")
    weights = enc.weights()
    per_call = max(1, enc.index.shard_size)
    gate = _Gate(files, root, cfg.on_error.value)
    doc_of: dict[str, str] = {}
    busy = [0.0]  # seconds the driver spent on the rows (not waiting for them): the stream's serial part
    writer = StoreWriter(store_path, check_ids=False)  # ids unique: document ids are checked, chunk ids derive

    def rows() -> Iterator[tuple[list[str], np.ndarray]]:
        def dataset() -> Any:
            return _dataset(files, str(root), retriever, chunk, ray.put(weights), enc, per_call)

        yield from _shards_of(dataset, gate, writer, doc_of if chunk is not None else None, busy)
        if not writer.count:
            raise DataError(
                f"data.root={str(root)!r}: no readable document among {len(files)} file(s) "
                f"({len(gate.skipped)} skipped with data.on_error=skip)"
            )

    folder = Path(enc.folder).resolve()
    store = None
    try:
        shards = write_vectors(folder, rows(), enc.index.vector_dtype)
        store = writer.close()
        for msg in gate.skipped[:5]:
            log(f"[data] skipped {msg}")
        # chunked: qrels name documents, not the store's chunks; every id read will do, as the qrels of a dropped
        # duplicate are moved to its kept copy (doc_alias) before they are checked
        docs: Any = store if chunk is None else gate.seen
        data = load_beir(
            root, split=cfg.split, dev_size=cfg.dev_size, seed=cfg.seed, corpus=docs, doc_alias=gate.dropped
        )
        check_corpus_ids(data, str(root))
        data.corpus = store
    except BaseException:
        _undo(writer if store is None else None, folder, Path(store_path))
        raise
    data.doc_of = doc_of
    seconds = time.perf_counter() - start
    fingerprint = data.fingerprint()
    seal(shards, seconds, enc.key(weights, fingerprint) if enc.key else "", fingerprint, busy[0])
    summary = f"{len(files)} files, {gate.documents} documents, {len(gate.dropped)} exact duplicates dropped, "
    log(f"[data] {root}: {summary}{len(gate.skipped)} files skipped")
    if chunk is not None:
        c = cfg.chunk
        log(f"[data] {len(set(doc_of.values()))} documents -> {len(store)} chunks of <= {c.max_tokens} tokens "
            f"(overlap {c.overlap})")  # fmt: skip
    log(
        f"[data] read, cleaned, {'chunked, ' if chunk else ''}encoded {len(store)} passages in one Ray Data stream "
        f"in {seconds:.1f}s ({enc.pool.num_actors} encode actors; the driver's share {busy[0]:.1f}s): vectors in "
        f"{folder}"
    )
    return data
