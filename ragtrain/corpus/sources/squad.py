"""`data=squad`: a SQuAD v1.1 JSON file, read and chunked in the driver (2,067 paragraphs: no Ray needed); qrels on
the chunk of each answer (ragtrain/data/squad.py)."""

from __future__ import annotations

import functools

from ragtrain.corpus.chunk import chunk_passage
from ragtrain.corpus.sources.base import Load, log
from ragtrain.data import RetrievalData
from ragtrain.data.squad import load_squad


class Squad:
    def load(self, ld: Load) -> RetrievalData:
        cfg, c = ld.cfg, ld.cfg.chunk
        chunk = (
            functools.partial(chunk_passage, tokenizer=ld.tokenizer, max_tokens=c.max_tokens, overlap=c.overlap)
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
            store_path=ld.passages,
            chunk=chunk,
            log=log.info,
        )
