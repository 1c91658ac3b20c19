"""Core data types shared by every retrieval dataset loader.

These are deliberately plain dataclasses (no torch / ray / numpy) so that every
other part of ragtrain -- retriever training, index building, evaluation -- can
depend on them without pulling in heavy imports.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["DataError", "Passage", "RetrievalData"]


class DataError(ValueError):
    """Bad dataset input; message names the file (and line) and the reason."""


@dataclass(frozen=True)
class Passage:
    """One retrievable passage (a BEIR corpus entry)."""

    id: str
    title: str
    text: str
    # A chunk of a longer document (data.chunk.enabled): the document's id and the chunk's character span in the
    # document's cleaned text (ragtrain/corpus/chunk.py). Empty/0 when the passage is a whole document.
    doc_id: str = ""
    start: int = 0
    end: int = 0

    def full_text(self) -> str:
        """Return the text to embed: ``title + " " + text``, stripped (BEIR/MTEB convention)."""
        # Stripping makes an empty title yield exactly the text, not a leading space,
        # which would otherwise change tokenisation for title-less corpora.
        return (self.title + " " + self.text).strip()


@dataclass
class RetrievalData:
    """A loaded retrieval dataset: corpus, queries, training pairs and the evaluated split."""

    name: str
    # doc id -> passage, in file order: a dict (small corpora, tests) or a PassageStore (ragtrain/data/store.py), the
    # file-backed mapping every run uses so the driver never holds all texts
    corpus: Mapping[str, Passage]
    queries: dict[str, str]  # query id -> text (all queries in the file)
    train_qrels: dict[str, dict[str, int]]  # qid -> {docid: grade}; train minus dev queries
    eval_qrels: dict[str, dict[str, int]]  # qrels of the evaluated split (``split``)
    split: str  # name of the evaluated split
    # qid -> every gold short answer (the synthetic KB has one, a SQuAD question one to three): a prediction is scored
    # against the best of them (EM / F1, ragtrain/eval/qa_metrics.py), a generator trains on the first
    answers: dict[str, list[str]] = field(default_factory=dict)
    # passage id -> document id when the corpus holds chunks (qrels stay on documents; evaluation is MaxP over
    # a document's chunks); empty when every passage is a whole document
    doc_of: dict[str, str] = field(default_factory=dict)

    def fingerprint(self) -> str:
        """Return a sha256 hex digest over the corpus (ids, titles, texts, in corpus order)."""
        # Each field is length-prefixed, so no choice of text can make two different
        # corpora serialise to the same byte stream (plain separators could be forged
        # by a passage containing the separator). Corpus order is part of the hash on
        # purpose: index row numbers depend on it, so a reordered corpus is a new index.
        stored = getattr(self.corpus, "fingerprint", None)
        if stored is not None:  # a PassageStore hashed the same stream when it was written
            return stored()
        return corpus_fingerprint(len(self.corpus), ((p.id, p.title, p.text) for p in self.corpus.values()))


def corpus_fingerprint(count: int, rows: Iterable[tuple[str, str, str]]) -> str:
    """sha256 over the passage count, then each passage's (id, title, text), every field length-prefixed: the
    one definition behind `RetrievalData.fingerprint` and a PassageStore's (a saved index carries it)."""
    h = hashlib.sha256()
    h.update(count.to_bytes(8, "big"))
    for row in rows:
        for value in row:
            raw = value.encode("utf-8")
            h.update(len(raw).to_bytes(8, "big"))
            h.update(raw)
    return h.hexdigest()
