"""Stage 0, corpus preparation: the configured dataset (synthetic KB, BEIR folder, documents folder or SQuAD file),
read, cleaned, deduplicated and chunked (in the driver or as Ray Data tasks), streamed into the run's passage store."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ragtrain.config.data import DATA_SOURCES, DataConfig
from ragtrain.config.retriever import RetrieverConfig
from ragtrain.corpus.dataset import check_chunk_budget
from ragtrain.corpus.sources.base import DataSource, Load
from ragtrain.data import RetrievalData

if TYPE_CHECKING:
    from ragtrain.corpus.stream import StreamEncode


def load_data(
    cfg: DataConfig,
    retriever: RetrieverConfig | None = None,
    out_dir: Path | None = None,
    store: bool = True,
    start_ray: Callable[[], None] | None = None,
    ray_tasks: int = 2,
    stream: StreamEncode | None = None,
) -> RetrievalData:
    """The configured dataset (data.source, a class of ragtrain/corpus/sources/ named in DATA_SOURCES: the
    synthetic KB, a BEIR folder, a documents folder or a SQuAD file), chunked when configured.

    `retriever` (its tokenizer) is needed for data.chunk.enabled; `out_dir` receives the generated documents
    (data.generate=true; a temporary folder when None) and, with `store`, the corpus as a `PassageStore`
    (`<out_dir>/corpus/passages.arrow`): corpus files and chunks stream into it, and every later stage reads texts
    from it, so the driver keeps ids and metadata only. Without `out_dir` (or `store=False`) the corpus is a dict.
    With `stream` (the run's first encode), a documents folder prepared on Ray is read, cleaned, chunked and encoded
    as one Ray Data stream (`corpus/stream.py`).
    """
    tokenizer = None
    if cfg.chunk.enabled:  # a chunk the encoder would truncate is a config error: check before reading anything
        if retriever is None:
            raise ValueError("load_data: data.chunk.enabled needs the retriever config (its tokenizer)")
        # lazy: ragtrain.embed.model imports torch; this module imports without it
        from ragtrain.embed.model import load_tokenizer

        tokenizer = load_tokenizer(retriever)
        check_chunk_budget(cfg.chunk.max_tokens, tokenizer.model_max_length, retriever.passage_max_length)
    corpus_dir = Path(out_dir) / "corpus" if (out_dir is not None and store) else None
    ld = Load(cfg, retriever, tokenizer, out_dir, corpus_dir, start_ray, ray_tasks, stream)
    source: DataSource = DATA_SOURCES[cfg.source].load()()
    return source.load(ld)


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
