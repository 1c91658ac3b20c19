"""`data=beir`: a BEIR folder (corpus.jsonl[.gz], queries.jsonl, qrels/<split>.tsv), its corpus read in the driver
or on Ray Data (data.prepare)."""

from __future__ import annotations

from ragtrain.corpus.dataset import beir_corpus_files, check_corpus_ids
from ragtrain.corpus.sources.base import Load, chunked, file_size, prepare_on_ray
from ragtrain.data import RetrievalData, load_beir


class Beir:
    def load(self, ld: Load) -> RetrievalData:
        cfg = ld.cfg
        assert cfg.root is not None  # checked by DataConfig
        on_ray = prepare_on_ray(ld, sum(file_size(f) for f in beir_corpus_files(cfg.root)))
        data = load_beir(cfg.root, split=cfg.split, dev_size=cfg.dev_size, seed=cfg.seed, store_path=ld.documents)
        check_corpus_ids(data, cfg.root)
        return chunked(ld, data, on_ray)
