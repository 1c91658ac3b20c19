"""Stage 0, corpus preparation: the configured dataset (synthetic KB, BEIR folder, documents folder or SQuAD file),
read, cleaned, deduplicated and chunked (in the driver or as Ray Data tasks), streamed into the run's passage store."""

from __future__ import annotations

import functools
import random
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ragtrain.config import DataConfig, DataSource, RetrieverConfig
from ragtrain.console import get_logger
from ragtrain.corpus.chunk import chunk_passage
from ragtrain.corpus.dataset import (
    beir_corpus_files,
    check_chunk_budget,
    check_corpus_ids,
    chunk_data,
    load_documents,
)
from ragtrain.corpus.docs_synthetic import write_docs_synthetic
from ragtrain.corpus.prepare import use_ray
from ragtrain.corpus.read import list_documents
from ragtrain.corpus.stream import stream_documents
from ragtrain.data import RetrievalData, load_beir, make_synthetic
from ragtrain.data.squad import load_squad
from ragtrain.data.store import write_store

if TYPE_CHECKING:
    from ragtrain.corpus.stream import StreamEncode

log = get_logger(__name__)


def data_folder(cfg: DataConfig, out_dir: Path | None) -> str:
    """data.root, or ragtrain's own article folder written deterministically into <out_dir>/docs (data.generate)."""
    if cfg.source == DataSource.documents and cfg.generate:
        root = str(Path(out_dir or tempfile.mkdtemp(prefix="ragtrain-docs-")) / "docs")
        write_docs_synthetic(root, num_entities=cfg.num_entities, seed=cfg.seed)
        return root
    assert cfg.root is not None  # checked by DataConfig
    return cfg.root


def prepare_on_ray(cfg: DataConfig, total_bytes: int, start_ray: Callable[[], None] | None) -> bool:
    """Whether Ray Data tasks and actors read, clean and chunk the corpus (data.prepare, by its size); Ray is
    started for it here (bad files then fail after Ray has started), and a driver without Ray prepares itself."""
    if not use_ray(cfg.prepare.value, total_bytes):
        return False
    if start_ray is not None:
        start_ray()
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    if not ray.is_initialized():
        log.info(f"[data] data.prepare={cfg.prepare.value}: Ray is not running here, preparing in the driver")
        return False
    return True


def load_data(
    cfg: DataConfig,
    retriever: RetrieverConfig | None = None,
    out_dir: Path | None = None,
    store: bool = True,
    start_ray: Callable[[], None] | None = None,
    ray_tasks: int = 2,
    stream: StreamEncode | None = None,
) -> RetrievalData:
    """The configured dataset: the synthetic KB, a BEIR folder, a documents folder or a SQuAD file, chunked when
    configured (SQuAD: qrels on the chunk of each answer, `ragtrain/data/squad.py`).

    `retriever` (its tokenizer) is needed for data.chunk.enabled; `out_dir` receives the generated documents
    (data.generate=true; a temporary folder when None) and, with `store`, the corpus as a `PassageStore`
    (`<out_dir>/corpus/passages.arrow`): corpus files and chunks stream into it, and every later stage reads texts
    from it, so the driver keeps ids and metadata only. Without `out_dir` (or `store=False`) the corpus is a dict.
    With `stream` (the run's first encode), a documents folder prepared on Ray is read, cleaned, chunked and encoded
    as one Ray Data stream (`corpus/stream.py`).
    """
    corpus_dir = Path(out_dir) / "corpus" if (out_dir is not None and store) else None
    # Chunked corpora keep the documents in their own store; the passages store is what the run reads
    docs_store = (corpus_dir / ("documents.arrow" if cfg.chunk.enabled else "passages.arrow")) if corpus_dir else None
    if cfg.source == DataSource.synthetic:
        data = make_synthetic(num_entities=cfg.num_entities, seed=cfg.seed, split=cfg.split)
        if corpus_dir is not None:
            data.corpus = write_store(corpus_dir / "passages.arrow", data.corpus.values())
        return data
    if cfg.chunk.enabled:  # a chunk the encoder would truncate is a config error: check before reading anything
        if retriever is None:
            raise ValueError("load_data: data.chunk.enabled needs the retriever config (its tokenizer)")
        # lazy: ragtrain.embed.model imports torch; this module imports without it
        from ragtrain.embed.model import load_tokenizer

        tokenizer = load_tokenizer(retriever)
        check_chunk_budget(cfg.chunk.max_tokens, tokenizer.model_max_length, retriever.passage_max_length)
    if cfg.source == DataSource.squad:  # one JSON file, read and chunked here (2,067 paragraphs: no Ray needed)
        c = cfg.chunk
        chunk = (
            functools.partial(chunk_passage, tokenizer=tokenizer, max_tokens=c.max_tokens, overlap=c.overlap)
            if c.enabled
            else None
        )
        assert cfg.root is not None  # checked by DataConfig
        return load_squad(
            cfg.root,
            cfg.split,
            cfg.dev_titles,
            cfg.test_titles,
            cfg.dev_articles,
            cfg.test_articles,
            cfg.seed,
            cfg.on_error.value,
            store_path=corpus_dir / "passages.arrow" if corpus_dir else None,
            chunk=chunk,
            log=log.info,
        )
    root = data_folder(cfg, out_dir)
    files = list_documents(root, cfg.glob) if cfg.source == DataSource.documents else beir_corpus_files(root)
    on_ray = docs_store is not None and prepare_on_ray(cfg, sum(file_size(f) for f in files), start_ray)
    if on_ray and stream is not None and cfg.source == DataSource.documents:
        assert corpus_dir is not None and retriever is not None  # on_ray needs a store; the encoder its config
        return stream_documents(files, root, cfg, retriever, stream, corpus_dir / "passages.arrow", log=log.info)
    if cfg.source == DataSource.beir:
        data = load_beir(root, split=cfg.split, dev_size=cfg.dev_size, seed=cfg.seed, store_path=docs_store)
        check_corpus_ids(data, root)
    else:
        data, _ = load_documents(
            root,
            cfg.glob,
            cfg.on_error.value,
            cfg.split,
            cfg.dev_size,
            cfg.seed,
            store_path=docs_store,
            on_ray=on_ray,
            files=files,
        )
    if not cfg.chunk.enabled:
        return data
    n_docs = len(data.corpus)
    passages_store = corpus_dir / "passages.arrow" if corpus_dir else None
    c = cfg.chunk
    data = chunk_data(data, tokenizer, c.max_tokens, c.overlap, passages_store, ray_tasks if on_ray else 0, retriever)
    log.info(
        f"[data] {n_docs} documents -> {len(data.corpus)} chunks of <= {c.max_tokens} tokens (overlap {c.overlap})"
    )
    return data


def file_size(path: Path) -> int:
    """Bytes of a listed document file; 0 for one that cannot be stat'ed (a link cycle or a link to nothing): it is
    reported, under data.on_error, when it is read."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


TRUNCATION_SAMPLE = 20_000  # passages tokenised to report truncation (all of a smaller corpus; else a seeded sample)


def truncation_report(corpus: Mapping[str, Any], retriever: RetrieverConfig, seed: int = 0) -> str | None:
    """One warning line when passages are longer than retriever.passage_max_length tokens (the encoder cuts them
    silently), or None: how many, the longest, and how to chunk them. Counted on every passage of a corpus of up to
    TRUNCATION_SAMPLE passages, else on a seeded sample of that many (the line says so)."""
    # lazy: ragtrain.embed.model imports torch; this module imports without it
    from ragtrain.embed.model import load_tokenizer

    n, limit = len(corpus), retriever.passage_max_length
    rows = range(n) if n <= TRUNCATION_SAMPLE else sorted(random.Random(seed).sample(range(n), TRUNCATION_SAMPLE))
    if hasattr(corpus, "full_texts"):  # a PassageStore: read by position, never the whole corpus
        texts = [t for i in range(0, len(rows), 1024) for t in corpus.full_texts(rows[i : i + 1024])]
    else:
        values = list(corpus.values())
        texts = [values[i].full_text() for i in rows]
    tokenizer = load_tokenizer(retriever)
    lengths = [
        len(ids)
        for i in range(0, len(texts), 1024)
        # verbose=False: counting lengths past the model's limit is the point, not a mistake to warn of
        for ids in tokenizer(texts[i : i + 1024], add_special_tokens=True, verbose=False)["input_ids"]
    ]
    over = [x for x in lengths if x > limit]
    if not over:
        return None
    of = (
        f"{len(over):,} of {n:,} passages"
        if n <= TRUNCATION_SAMPLE
        else f"{len(over):,} of a sample of {len(rows):,} passages ({len(over) / len(rows):.1%} of {n:,})"
    )
    return (
        f"{of} exceed retriever.passage_max_length={limit} tokens (longest {max(over):,}, median of those "
        f"{sorted(over)[len(over) // 2]:,}): the encoder sees only their first {limit} tokens; set "
        "data.chunk.enabled=true to split them into passages"
    )
