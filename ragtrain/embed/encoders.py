"""Texts -> vectors, the one way: every embedding in ragtrain comes from `encode_texts` (ragtrain/embed/model.py)
through the classes here.

`EncodeBatch` holds one encoder replica (built from the RetrieverConfig, weights loaded once, bf16 weights where the
precision says so) and embeds texts with the configured prefix, truncation, pooling and normalisation: Ray Data runs
it in an actor pool for the corpus (`ragtrain/corpus/encode.py`), index shards run it for their rows
(`ragtrain/index/sharded.py`), and `LocalEncoder` runs it in-process for a few texts (the index shards' live
refresh rounds too). `QueryEncoder` is the search side: one snapshot's vectors, or the consensus of several
replicas' (sync=vector_avg). Validation and the drift and staleness probes of training call `encode_texts` on the
model they hold.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ragtrain.config.retriever import Precision, RetrieverConfig
from ragtrain.runtime.console import worker_setup
from ragtrain.runtime.rss import peak_rss_mb, rss_breakdown_mb

VECTOR_DTYPES = ("float32", "float16")


def consensus_vectors(per_replica: list[np.ndarray]) -> np.ndarray:
    """The re-normalised mean of the replicas' vectors (one replica: its vectors unchanged).

    sync=vector_avg (conf/sync/vector_avg.yaml: no reducer, no mixer): the replicas train apart and their VECTORS
    are synchronised instead of their weights. At index time every replica encodes the same passages (and queries)
    and the index holds this consensus per passage; the pipeline also evaluates the parameter-averaged model
    (`param_avg`) on the same split, so the two kinds of consensus compare."""
    if len(per_replica) == 1:
        return per_replica[0]
    total = np.sum(per_replica, axis=0)
    return total / np.linalg.norm(total, axis=1, keepdims=True).clip(min=1e-12)


def encoder_dim(cfg: RetrieverConfig) -> int:
    """The vector dimension the configured encoder produces, without building it (checks before encoding)."""
    if cfg.model == "tiny":
        return int(cfg.tiny.hidden_size)
    from transformers import AutoConfig  # lazy: transformers is heavy (~1 s); this module imports without it

    # lazy: ragtrain.embed.model imports torch; this module imports without it
    from ragtrain.embed.model import resolve_model_path

    return int(AutoConfig.from_pretrained(resolve_model_path(cfg.model)).hidden_size)


@dataclass
class EncodeFault:
    """Fault injection (tests): the first actor to reach its batch number `at_batch` (0-based) exits with
    os._exit(1), once per `marker` file (the marker is created atomically just before the exit)."""

    at_batch: int
    marker: str


class EncodeBatch:
    """A `map_batches` callable class: one encoder replica per actor, loaded once; embeds one batch per call.

    batch in: {"id": [...], "text": [...]} (numpy); out: a pyarrow table {id: string, vector: fixed_size_list<dtype>}.
    """

    def __init__(
        self,
        retriever: RetrieverConfig,
        weights: Any,
        max_length: int,
        batch_size: int = 64,
        precision: str = "fp32",
        vector_dtype: str = "float32",
        num_threads: int | None = None,
        fault: EncodeFault | None = None,
        stats_dir: str | None = None,
        text_column: str = "text",
        keep_columns: bool = False,
    ):
        import ray  # lazy: ray is heavy (~0.5 s); this module imports without it
        import torch  # lazy: torch is heavy (seconds); this module imports without it

        # lazy: ragtrain.embed.model imports torch; this module imports without it
        from ragtrain.embed.model import build_encoder, inference_weights, load_tokenizer

        worker_setup()
        if vector_dtype not in VECTOR_DTYPES:
            raise ValueError(f"vector_dtype={vector_dtype!r} must be one of {list(VECTOR_DTYPES)}")
        if num_threads:  # Ray sets OMP_NUM_THREADS from num_cpus, but torch may have read it already
            torch.set_num_threads(max(1, int(num_threads)))
        if isinstance(weights, list) and len(weights) == 1:
            weights = weights[0]  # [ObjectRef]: wrapped so nothing on the way resolves it early
        if isinstance(weights, ray.ObjectRef):
            weights = ray.get(weights)  # each actor fetches the snapshot once from the object store
        # A GPU only where Ray assigned one (an actor with num_gpus); in-process use (the search CLI) stays on CPU
        gpu = torch.cuda.is_available() and ray.is_initialized() and ray.get_gpu_ids()
        self.device = torch.device("cuda" if gpu else "cpu")
        self.precision, self.vector_dtype = Precision(precision), np.dtype(vector_dtype)
        self.model = build_encoder(retriever)
        self.model.load_state_dict(weights, strict=True)
        self.model = inference_weights(self.model.to(self.device).eval(), self.precision)
        self.tokenizer = load_tokenizer(retriever)
        self.max_length, self.batch_size = int(max_length), int(batch_size)
        self.fault, self.stats_dir = fault, stats_dir
        # The corpus stream (corpus/stream.py) embeds its "embed" column and passes every other column through, so
        # the driver gets each passage with its vector; rows with an `error` are passed through unencoded
        self.text_column, self.keep_columns = text_column, keep_columns
        self.role = "passage"  # the corpus; LocalEncoder switches it to "query" (retriever.query_prefix)
        self.batches = self.rows = 0
        self.seconds = 0.0
        self.rss_peaks: dict[str, float] = {}  # per kind, sampled after each batch (benchmarks: where RSS goes)
        self.anon_series: list[tuple[int, float]] = []

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), dim] fp32 unit vectors in input order (the shared encode function)."""
        # lazy: ragtrain.embed.model imports torch; this module imports without it
        from ragtrain.embed.model import encode_texts

        vecs = encode_texts(
            self.model,
            self.tokenizer,
            list(texts),
            self.max_length,
            self.batch_size,
            self.precision,
            device=self.device,
            role=self.role,
        )
        return vecs.numpy()

    def __call__(self, batch: dict[str, np.ndarray]):
        import pyarrow as pa  # lazy: pyarrow loads a native library; this module imports without it

        f = self.fault
        if f is not None and self.batches == f.at_batch:
            try:  # the first actor to get here dies, as in a crash (no cleanup, no exception)
                os.close(os.open(f.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                os._exit(1)
            except FileExistsError:
                pass  # it already fired once
        start = time.perf_counter()
        texts = batch[self.text_column]
        ok = np.array([not e for e in batch["error"]], dtype=bool) if "error" in batch else np.ones(len(texts), bool)
        dim = int(self.model.dim)
        vecs = np.zeros((len(texts), dim), dtype=self.vector_dtype)
        if ok.any():
            vecs[ok] = self.encode([str(t) for t in texts[ok]])
        self.seconds += time.perf_counter() - start
        self.batches += 1
        self.rows += int(ok.sum())
        if self.stats_dir:  # per-actor figures for benchmarks: rows, encode seconds, peak RSS (and by kind)
            rss = rss_breakdown_mb()
            for kind, mb in rss.items():
                self.rss_peaks[kind] = max(mb, self.rss_peaks.get(kind, 0.0))
            if self.batches % 25 == 1:  # the heap's course over the run: growth with rows, or a plateau
                self.anon_series.append((self.rows, round(rss.get("anon", 0.0), 1)))
            Path(self.stats_dir, f"{os.getpid()}.json").write_text(
                json.dumps(
                    {
                        "pid": os.getpid(),
                        "batches": self.batches,
                        "rows": self.rows,
                        "seconds": self.seconds,
                        "peak_rss_mb": peak_rss_mb(),
                        "rss_peaks_mb": self.rss_peaks,
                        "anon_series": self.anon_series,
                    }
                )
            )
        flat = pa.array(vecs.reshape(-1), type=pa.from_numpy_dtype(self.vector_dtype))
        vector = pa.FixedSizeListArray.from_arrays(flat, dim)
        if self.keep_columns:
            cols = {k: pa.array(v.tolist()) for k, v in batch.items() if k != self.text_column}
            return pa.table({**cols, "vector": vector})
        return pa.table({"id": pa.array([str(i) for i in batch["id"]], type=pa.string()), "vector": vector})


class LocalEncoder:
    """`EncodeBatch` in this process, for a few texts: the same encode function as the corpus actors."""

    # weights: as EncodeBatch takes them (a state dict, its ObjectRef, or [ObjectRef])
    def __init__(self, retriever: RetrieverConfig, weights: Any, batch_size: int = 64, precision: str = "fp32"):
        self._enc = EncodeBatch(
            retriever, weights, retriever.passage_max_length, batch_size, Precision(precision).value
        )

    @property
    def dim(self) -> int:
        return int(self._enc.model.dim)

    def encode(self, texts: Sequence[str], max_length: int, role: str = "query") -> np.ndarray:
        self._enc.max_length, self._enc.role = int(max_length), role
        return self._enc.encode(texts)


class QueryEncoder:
    """The encoder side of a search: texts -> vectors the way an index's passages were encoded.

    One snapshot: its vectors. Several (sync=vector_avg: one per replica): the re-normalised mean of the
    replicas' unit vectors, as the consensus index holds. Every search in ragtrain encodes through this class
    (pipeline evaluation and mining, the generator's retrieval, `python -m ragtrain search`).
    """

    def __init__(
        self, retriever: RetrieverConfig, snapshots: Sequence[dict], batch_size: int = 64, precision: str = "fp32"
    ):
        if not snapshots:
            raise ValueError("QueryEncoder needs at least one encoder snapshot")
        self.retriever = retriever
        self.encoders = [LocalEncoder(retriever, w, batch_size, precision) for w in snapshots]

    @property
    def dim(self) -> int:
        return self.encoders[0].dim

    def encode(self, texts: Sequence[str], max_length: int | None = None, role: str = "query") -> np.ndarray:
        """[len(texts), dim] float32 unit vectors; max_length defaults to the role's configured length."""
        if max_length is None:
            r = self.retriever
            max_length = r.query_max_length if role == "query" else r.passage_max_length
        vecs = [e.encode(texts, max_length, role) for e in self.encoders]
        return consensus_vectors(vecs)
