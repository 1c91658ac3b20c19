"""`data=documents`: a folder of raw documents (txt, md, html, jsonl, parquet; + queries.jsonl, qrels/<split>.tsv),
or ragtrain's generated article folder (data.generate); read and cleaned in the driver or on Ray Data, where the
run's first encode joins the same stream (corpus/stream.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ragtrain.corpus.dataset import load_documents
from ragtrain.corpus.docs_synthetic import write_docs_synthetic
from ragtrain.corpus.read import list_documents
from ragtrain.corpus.sources.base import Load, chunked, file_size, log, prepare_on_ray
from ragtrain.corpus.stream import stream_documents
from ragtrain.data import RetrievalData


def data_folder(ld: Load) -> str:
    """data.root, or ragtrain's own article folder written deterministically into <out_dir>/docs (data.generate)."""
    cfg = ld.cfg
    if cfg.generate:
        root = str(Path(ld.out_dir or tempfile.mkdtemp(prefix="ragtrain-docs-")) / "docs")
        write_docs_synthetic(root, num_entities=cfg.num_entities, seed=cfg.seed)
        return root
    assert cfg.root is not None  # checked by DataConfig
    return cfg.root


class Documents:
    def load(self, ld: Load) -> RetrievalData:
        cfg, root = ld.cfg, data_folder(ld)
        files = list_documents(root, cfg.glob)
        on_ray = prepare_on_ray(ld, sum(file_size(f) for f in files))
        if on_ray and ld.stream is not None:
            assert ld.passages is not None and ld.retriever is not None  # on_ray needs a store; the encoder its config
            return stream_documents(files, root, cfg, ld.retriever, ld.stream, ld.passages, log=log.info)
        data, _ = load_documents(
            root,
            cfg.glob,
            cfg.on_error.value,
            cfg.split,
            cfg.dev_size,
            cfg.seed,
            store_path=ld.documents,
            on_ray=on_ray,
            files=files,
        )
        return chunked(ld, data, on_ray)
