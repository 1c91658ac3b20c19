"""Retrieval for the generator: the question encoder in each worker, the run's index shards behind it.

The generator searches the same shard group as evaluation and mining: an `IndexPayload` carries the `Index` handle
(the shard actors), so every worker encodes its own questions (`QueryEncoder`) and scatters them to the shards;
no copy of the index is made for the generator. The index is frozen while the generator trains, so a client
caches results per question: later epochs never ask again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from ragtrain.config.retriever import Precision, RetrieverConfig
from ragtrain.embed.encoders import QueryEncoder
from ragtrain.embed.model import build_encoder
from ragtrain.embed.weights import load_weights
from ragtrain.index.base import ReadOnlyIndex
from ragtrain.index.faiss_index import IndexMismatchError
from ragtrain.runtime.console import get_logger

log = get_logger(__name__)


@dataclass
class IndexPayload:
    """Everything a searcher needs, picklable: the index's handle (its shard actors) and the encoder snapshot(s)."""

    index: ReadOnlyIndex  # searched only: the run's ShardedIndex, or a saved one loaded into index shards
    retriever: RetrieverConfig
    weights: list[dict[str, torch.Tensor]]  # encoder snapshot(s); several = vector_avg (mean of query vectors)
    precision: Precision = Precision.auto  # query-encoding precision (auto: resolved where the encoder runs)

    @classmethod
    def from_index(
        cls,
        index: ReadOnlyIndex,
        retriever: RetrieverConfig,
        weights: list[dict[str, torch.Tensor]],
        precision: Precision,
    ) -> IndexPayload:
        """Package an index with the encoder snapshot(s) that built it (queries encoded at `precision`)."""
        return cls(index, retriever, weights, precision)


class Searcher:
    """The one query encoder (`QueryEncoder`) in this process, the one index search (the shards) behind it."""

    def __init__(self, payload: IndexPayload, num_threads: int = 0):
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.p = payload
        self.index = payload.index
        self.encoder = QueryEncoder(payload.retriever, payload.weights, precision=Precision(payload.precision).value)

    def encode(self, texts: Sequence[str], max_length: int, role: str = "query") -> np.ndarray:
        """Vectors like the index's (mean of the snapshots' unit vectors, re-normalised, when several)."""
        return self.encoder.encode(texts, max_length, role)

    def search(self, questions: Sequence[str], k: int) -> list[list[str]]:
        """Top-k doc ids for each question."""
        return self.search_scored(questions, k)[0]

    def search_scored(self, questions: Sequence[str], k: int) -> tuple[list[list[str]], list[list[float]]]:
        """Top-k doc ids for each question, and the retriever's score of each (query vector . stored passage
        vector), best first."""
        if not questions:
            return [], []
        scores, rows = self.index.search(self.encode(questions, self.p.retriever.query_max_length), k)
        ids = [[self.index.doc_ids[r] for r in row if r >= 0] for row in rows]
        return ids, [[float(x) for x, r in zip(srow, row) if r >= 0] for srow, row in zip(scores, rows)]


class RetrievalClient:
    """Picklable worker-side handle: a Searcher made where it is first used (from the payload in the object store);
    caches answers."""

    def __init__(self, payload_ref: Any):
        self.payload_ref = payload_ref
        self._local: Searcher | None = None
        self._cache: dict[tuple[str, int], tuple[list[str], list[float]]] = {}  # ids and their scores
        self.seconds = 0.0  # time spent waiting for retrieval (throughput accounting)
        self.calls = 0

    def __getstate__(self) -> dict:  # ship the payload's handle only, never a loaded searcher or a cache
        return {"payload_ref": self.payload_ref}

    def __setstate__(self, state: dict) -> None:
        RetrievalClient.__init__(self, state["payload_ref"])

    def _searcher(self) -> Searcher:
        if self._local is None:
            payload = self.payload_ref if isinstance(self.payload_ref, IndexPayload) else ray.get(self.payload_ref)
            self._local = Searcher(payload)
        return self._local

    def search(self, questions: Sequence[str], k: int) -> list[list[str]]:
        """Top-k doc ids per question (cached: the index does not change while the generator trains)."""
        return self.search_scored(questions, k)[0]

    def search_scored(self, questions: Sequence[str], k: int) -> tuple[list[list[str]], list[list[float]]]:
        """Top-k doc ids per question and the retriever's scores of them (cached as `search`)."""
        todo = list(dict.fromkeys(q for q in questions if (q, k) not in self._cache))
        if todo:
            start = time.perf_counter()
            ids, scores = self._searcher().search_scored(todo, k)
            self._cache.update({(q, k): found for q, found in zip(todo, zip(ids, scores))})
            self.seconds += time.perf_counter() - start
            self.calls += 1
        hits = [self._cache[(q, k)] for q in questions]
        return [list(h[0]) for h in hits], [list(h[1]) for h in hits]


def load_snapshots(retriever: RetrieverConfig, seed: int, encoder: str) -> list[dict[str, torch.Tensor]]:
    """The encoder weights an index's metadata names: `<model>@init`, `<model>@<file>.safetensors`, or
    `vector_avg of N replicas in <dir>` (replica_*.safetensors)."""
    if encoder.startswith("vector_avg of ") and " in " in encoder:
        folder = Path(encoder.rsplit(" in ", 1)[1])
        files = sorted(folder.glob("replica_*.safetensors"))
        if not files:
            raise FileNotFoundError(f"the index was built from encoder replicas in {folder}, which holds none")
        return [load_weights(folder, f.stem) for f in files]
    model, _, where = encoder.partition("@")
    if model != retriever.model:
        raise IndexMismatchError(
            f"the index was built by encoder {encoder!r} but retriever.model is "
            f"{retriever.model!r}: use the same retriever config as the index build"
        )
    if where == "init":
        torch.manual_seed(seed)  # the pipeline seeds the same way before building the untrained encoder
        return [{k: v.detach().clone() for k, v in build_encoder(retriever).state_dict().items()}]
    path = Path(where)
    if not path.exists():
        raise FileNotFoundError(f"the index was built by encoder weights {path}, which no longer exist")
    return [load_weights(path.parent, path.stem)]


def check_encoder(
    retriever: RetrieverConfig,
    weights: list[dict[str, torch.Tensor]],
    precision: str,
    passages: Sequence[str],
    index: ReadOnlyIndex,
    n: int,
    min_cosine: float = 0.99,
) -> float:
    """Re-encode the first `n` indexed passages and compare with the stored vectors (IndexMismatchError if off).

    Only the query encoder and the index's first `n` rows are needed, never the whole index.
    Returns the smallest cosine, or NaN (with a warning) when the index type cannot give its vectors back (an HNSW
    graph over PQ codes)."""
    encoder = QueryEncoder(retriever, weights, precision=Precision(precision).value)
    if encoder.dim != index.meta.dim:
        raise IndexMismatchError(
            f"the retriever encoder gives {encoder.dim}-dim vectors but the index "
            f"holds {index.meta.dim}-dim ones (built by {index.meta.encoder!r})"
        )
    n = min(n, len(passages))
    if n == 0:
        return float("nan")
    stored = index.reconstruct_first(n)
    if stored is None:
        log.warning(
            f"[generator] the index ({index.meta.factory}) cannot give its vectors back: the encoder is "
            "checked by dimension only"
        )
        return float("nan")
    # Compared as stored: PQ / SQ codes round a matching encoder's vectors too, so both sides pass through the codec
    fresh = index.as_stored(encoder.encode(passages[:n], retriever.passage_max_length, role="passage"))
    cos = (fresh * stored).sum(1) / (np.linalg.norm(fresh, axis=1) * np.linalg.norm(stored, axis=1)).clip(min=1e-12)
    worst = float(cos.min())
    if worst < min_cosine:
        raise IndexMismatchError(
            f"the question encoder does not match the index (built by {index.meta.encoder!r}): re-encoded "
            f"passages have cosine {worst:.3f} < {min_cosine} with the stored vectors; rebuild the index with "
            "this encoder or point generator.retrieval.index_dir at the matching index"
        )
    return worst
