"""Cross-encoder scores of many (query, passage) pairs on Ray Data, and the teacher's cached training targets.

Rows are position pairs {q, p}; each `ScoreBatch` actor loads the teacher once and reads the texts itself (the
queries it was given, the passages from the run's passage store), so the driver sends integers and gets one
float per pair back. The actors are the encode pool's (`resources.pool`: count, CPUs, GPUs, custom resources).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ragtrain.config.resources import PoolResources
from ragtrain.config.retriever import RetrieverConfig
from ragtrain.corpus.encode import ACTOR_ENV, actor_cpus
from ragtrain.runtime.console import get_logger, worker_setup

log = get_logger(__name__)
SCORES_FILE = "scores.json"


class ScoreBatch:
    """Ray Data callable class: the teacher's logit for each {q, p} row."""

    def __init__(
        self,
        retriever: RetrieverConfig,
        teacher: str,
        queries: Sequence[str],
        passages: Any,
        max_length: int,
        batch_size: int,
        threads: int,
    ):
        import torch  # lazy: torch is heavy (seconds); this module imports without it

        # lazy: ragtrain.embed.model imports torch; this module imports without it
        from ragtrain.embed.model import load_tokenizer

        # lazy: ragtrain.reranker.model imports torch; this module imports without it
        from ragtrain.reranker.model import build_cross_encoder

        worker_setup()
        torch.set_num_threads(max(1, threads))
        self.model = build_cross_encoder(retriever, teacher).eval()
        import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

        if torch.cuda.is_available() and ray.is_initialized() and ray.get_gpu_ids():  # an actor Ray gave a GPU
            self.model.to("cuda")  # score_pairs follows the model's device
        self.tokenizer = load_tokenizer(retriever)
        self.queries, self.passages = queries, passages
        self.max_length, self.batch_size = max_length, batch_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # lazy: ragtrain.reranker.model imports torch; this module imports without it
        from ragtrain.reranker.model import score_pairs

        qs = [self.queries[int(i)] for i in batch["q"]]
        rows = [int(i) for i in batch["p"]]
        # a store view reads several rows in one go; an in-memory corpus is a list
        ps = [self.passages[i] for i in rows] if isinstance(self.passages, list) else self.passages[rows]
        scores = score_pairs(self.model, self.tokenizer, qs, ps, self.max_length, self.batch_size)
        return {"q": batch["q"], "p": batch["p"], "score": scores}


def score_on_ray(
    retriever: RetrieverConfig,
    teacher: str | Path,
    queries: Sequence[str],
    passages: Any,
    pairs: Sequence[tuple[int, int]],
    max_length: int,
    pool: PoolResources,
    batch_size: int = 32,
) -> np.ndarray:
    """The teacher's score of each (query position, passage position) pair, in `pairs` order.

    `passages` is a PassageStore text view (pickled as the store's path) or a list."""
    # lazy: ray is heavy (~0.5 s); this module imports without it
    import ray
    from ray.data import ActorPoolStrategy

    if not pairs:
        return np.empty(0, dtype=np.float32)
    q = np.array([a for a, _ in pairs], dtype=np.int64)
    p = np.array([b for _, b in pairs], dtype=np.int64)
    blocks = max(1, min(64, len(pairs) // (batch_size * 4)))
    ds = ray.data.from_numpy(np.array_split(np.stack([q, p], axis=1), blocks)).map_batches(  # one block a part
        lambda b: {"q": b["data"][:, 0], "p": b["data"][:, 1]}, batch_format="numpy", num_cpus=0.1
    )
    cpus = actor_cpus(pool)
    scored = ds.map_batches(
        ScoreBatch,
        fn_constructor_kwargs={
            "retriever": retriever,
            "teacher": str(teacher),
            "queries": list(queries),
            "passages": passages,
            "max_length": max_length,
            "batch_size": batch_size,
            "threads": int(pool.cpus_per_actor),
        },
        batch_size=batch_size * 4,
        batch_format="numpy",
        compute=ActorPoolStrategy(size=pool.num_actors),
        num_cpus=cpus,
        num_gpus=pool.gpus_per_actor or None,
        resources={k: float(v) for k, v in pool.resources.items()} or None,
        runtime_env={"env_vars": ACTOR_ENV},
    )  # the encode actors' environment (passive OpenMP waits, offline HF)
    where = {(int(a), int(b)): i for i, (a, b) in enumerate(zip(q.tolist(), p.tolist()))}
    out = np.full(len(pairs), np.nan, dtype=np.float32)
    for b in scored.iter_batches(batch_size=4096, batch_format="numpy"):
        for a, c, s in zip(b["q"].tolist(), b["p"].tolist(), b["score"].tolist()):
            out[where[(a, c)]] = s
    if np.isnan(out).any():
        raise RuntimeError(f"{int(np.isnan(out).sum())} of {len(pairs)} pairs came back unscored")
    return out


def teacher_targets(
    retriever: RetrieverConfig,
    teacher: str | Path,
    queries: Sequence[str],
    passages: Any,
    candidates: Sequence[Sequence[int]],
    max_length: int,
    pool: PoolResources,
    cache_dir: str | Path,
    corpus_fingerprint: str,
) -> dict[int, dict[int, float]]:
    """The teacher's score of every candidate of every query (`candidates[i]`: passage positions for
    `queries[i]`), as {query position: {passage position: score}}; cached in `cache_dir/scores.json` under a key
    of the teacher's weights, the corpus and the candidate lists, so a resumed run does not score again."""
    pairs = sorted({(qi, int(p)) for qi, cand in enumerate(candidates) for p in cand})
    key = _key(teacher, pairs, corpus_fingerprint)
    cache = Path(cache_dir) / SCORES_FILE
    if cache.exists():
        saved = json.loads(cache.read_text())
        if saved.get("key") == key:
            log.info(f"[teacher] {len(pairs)} candidate scores from {cache}")
            return _table(saved["pairs"], saved["scores"])
    log.info(f"[teacher] scoring {len(pairs)} (query, candidate) pairs on Ray Data ({pool.num_actors} actors)")
    scores = score_on_ray(retriever, teacher, queries, passages, pairs, max_length, pool).tolist()
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "pairs": pairs, "scores": scores}))
    tmp.replace(cache)  # a crash mid-write never leaves a cache that looks complete
    return _table(pairs, scores)


def _table(pairs: Sequence[Sequence[int]], scores: Sequence[float]) -> dict[int, dict[int, float]]:
    out: dict[int, dict[int, float]] = {}
    for (q, p), s in zip(pairs, scores):
        out.setdefault(int(q), {})[int(p)] = float(s)
    return out


def _key(teacher: str | Path, pairs: Sequence[tuple[int, int]], corpus_fingerprint: str) -> str:
    """Hash of the teacher's weight files, the corpus and the pairs."""
    h = hashlib.sha256(corpus_fingerprint.encode())
    for f in sorted(Path(teacher).glob("*.safetensors")) + sorted(Path(teacher).glob("*.bin")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(json.dumps(pairs).encode())
    return h.hexdigest()
