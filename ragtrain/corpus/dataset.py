"""Assemble a RetrievalData from a documents folder, chunk any corpus, and map qrels between documents and chunks."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ragtrain.data.beir import load_beir
from ragtrain.data.clean import check_id, clean, dedupe_stream
from ragtrain.data.store import PassageStore, write_store
from ragtrain.data.types import DataError, Passage, RetrievalData
from ragtrain.runtime.errors import ConfigError

from .chunk import chunk_document
from .prepare import chunk_on_ray, read_on_ray
from .read import FileError, list_documents, open_documents, read_file

__all__ = [
    "beir_corpus_files",
    "check_chunk_budget",
    "check_corpus_ids",
    "chunk_data",
    "load_documents",
    "locate",
    "passage_qrels",
]


def read_documents(
    files: Sequence[Path], root: Path, on_ray: bool, failed: Callable[[str], None], read: list[int]
) -> Iterator[dict[str, str]]:
    """Cleaned documents of `files` in file order: read here one file at a time, or by Ray Data tasks (`on_ray`)
    that stream them back; a file that cannot be used goes to `failed`, whole; `read[0]` counts the documents."""
    if on_ray:
        for doc in read_on_ray(files, root):
            if "file_error" in doc:
                failed(doc["file_error"])
                continue
            read[0] += 1
            yield doc
        return
    for path in files:
        try:  # a file that cannot be used fails here, before its first document: all of it or none of it
            docs = open_documents(path, root)
        except FileError as e:
            failed(str(e))
            continue
        for d in docs:  # streamed: a file of millions of records is never held whole
            read[0] += 1
            yield clean(d)


def load_documents(
    root: str | Path,
    glob: str = "**/*",
    on_error: str = "fail",
    split: str = "dev",
    dev_size: float = 100,
    seed: int = 0,
    log: Callable[[str], None] = print,
    store_path: str | Path | None = None,
    on_ray: bool = False,
    files: Sequence[Path] | None = None,
) -> tuple[RetrievalData, dict[str, int]]:
    """(whole-document RetrievalData, report counts) of a documents folder with queries.jsonl + qrels/<split>.tsv.

    Files are read and cleaned one at a time in this process, or (`on_ray`) in parallel by Ray Data tasks that
    stream the documents back in file order; either way they are deduplicated here; with `store_path` they stream
    into a `PassageStore` there (only ids and content hashes stay in memory), else into a dict. `files`: the
    already listed document files (`list_documents`), to list them once.
    """
    if on_error not in ("fail", "skip"):
        raise ConfigError(f"data.on_error must be one of ['fail', 'skip'], got {on_error!r}")
    root = Path(root)
    files = list(files) if files is not None else list_documents(root, glob)
    skipped: list[str] = []
    read = [0]

    def file_failed(message: str) -> None:
        if on_error == "fail":
            raise DataError(f"{message} (data.on_error=fail; data.on_error=skip skips such files)")
        skipped.append(message)

    dropped: dict[str, str] = {}
    kept = (
        Passage(id=d["id"], title=d["title"], text=d["text"])
        for d in dedupe_stream(
            read_documents(files, root, on_ray, file_failed, read), dropped, lambda doc_id: locate(files, root, doc_id)
        )
    )
    # ids are unique once deduplicated: the store need not keep a set of them to check
    corpus: Mapping[str, Passage] = (
        {p.id: p for p in kept} if store_path is None else write_store(store_path, kept, check_ids=False)
    )
    for msg in skipped[:5]:
        log(f"[data] skipped {msg}")
    if not len(corpus):
        raise DataError(
            f"data.root={str(root)!r}: no readable document among {len(files)} file(s) "
            f"({len(skipped)} skipped with data.on_error=skip)"
        )
    data = load_beir(root, split=split, dev_size=dev_size, seed=seed, corpus=corpus, doc_alias=dropped)
    check_corpus_ids(data, str(root))
    report = {
        "files": len(files),
        "skipped_files": len(skipped),
        "documents": read[0],
        "duplicates_dropped": len(dropped),
    }
    log(
        f"[data] {root}: {len(files)} files, {read[0]} documents, {len(dropped)} exact duplicates dropped, "
        f"{len(skipped)} files skipped"
    )
    return data, report


def locate(files: Sequence[Path], root: str | Path, doc_id: str) -> str:
    """Where a document id first occurs among `files` (a re-scan, paid only when a duplicate id is reported)."""
    for path in files:
        try:
            for d in read_file(path, root):
                if d["id"] == doc_id:
                    return d["source"]
        except DataError:
            continue
    return "an earlier document"


def beir_corpus_files(root: str | Path) -> list[Path]:
    """A BEIR folder's corpus file (corpus.jsonl or .gz) as a list, empty when absent (load_beir says so)."""
    return [p for p in (Path(root) / "corpus.jsonl", Path(root) / "corpus.jsonl.gz") if p.is_file()][:1]


def check_corpus_ids(data: RetrievalData, where: str) -> None:
    """Reject document and query ids with tabs or line breaks (BEIR folders included)."""
    for doc_id in data.corpus:
        check_id(doc_id, where)
    for qid in data.queries:
        check_id(qid, where, kind="query")


def check_chunk_budget(max_tokens: int, model_max: int, passage_max_length: int, special: int = 2) -> None:
    """ConfigError if a chunk of `max_tokens` (+ special tokens) would be truncated by the encoder."""
    limit = min(model_max, passage_max_length) - special
    if max_tokens > limit:
        raise ConfigError(
            f"data.chunk.max_tokens must be <= {limit} (retriever.passage_max_length="
            f"{passage_max_length}, encoder maximum {model_max}, minus {special} special tokens), "
            f"got {max_tokens}"
        )


def chunk_data(
    data: RetrievalData,
    tokenizer: Any,
    max_tokens: int,
    overlap: int,
    store_path: str | Path | None = None,
    ray_tasks: int = 0,
    retriever: Any = None,
) -> RetrievalData:
    """The same dataset with every document split into chunk passages; qrels stay on documents (doc_of).
    Documents are chunked one at a time here, or (`ray_tasks` > 0, the documents in a `PassageStore`) by up to that
    many Ray Data tasks at a time with `retriever`'s tokenizer, streamed back in order; with `store_path` the chunks
    stream into a `PassageStore`."""
    doc_of: dict[str, str] = {}

    def chunks() -> Iterator[Passage]:
        if ray_tasks > 0:
            if not isinstance(data.corpus, PassageStore):
                raise ValueError("chunk_data on Ray needs the documents in a PassageStore (the actors read it)")

            for c in chunk_on_ray(data.corpus, retriever, max_tokens, overlap, ray_tasks):
                doc_of[c["id"]] = c["doc_id"]
                yield Passage(**c)
            return
        for doc in data.corpus.values():
            record = {"id": doc.id, "title": doc.title, "text": doc.text, "source": f"document {doc.id!r}"}
            for c in chunk_document(record, tokenizer, max_tokens, overlap):
                doc_of[c["id"]] = doc.id
                yield Passage(
                    id=c["id"], title=c["title"], text=c["text"], doc_id=doc.id, start=c["start"], end=c["end"]
                )

    # chunk ids are <document id>#<k> of unique document ids: unique, so the store keeps no set of them to check
    corpus: Mapping[str, Passage] = (
        {p.id: p for p in chunks()} if store_path is None else write_store(store_path, chunks(), check_ids=False)
    )
    return RetrievalData(
        name=data.name,
        corpus=corpus,
        queries=data.queries,
        train_qrels=data.train_qrels,
        eval_qrels=data.eval_qrels,
        split=data.split,
        answers=data.answers,
        doc_of=doc_of,
    )


def passage_qrels(qrels: dict[str, dict[str, int]], doc_of: dict[str, str]) -> dict[str, dict[str, int]]:
    """Document qrels expanded to passages: every chunk of a judged document gets the document's grade.

    Training uses this: all chunks of a relevant document are positives (and masked as each other's negatives in
    the loss, `TrainExample.gold`), and hard-negative mining never picks a chunk of a gold document.
    """
    if not doc_of:
        return qrels
    chunks: dict[str, list[str]] = {}
    for pid, did in doc_of.items():
        chunks.setdefault(did, []).append(pid)
    return {q: {p: g for d, g in grades.items() for p in chunks.get(d, [])} for q, grades in qrels.items()}
