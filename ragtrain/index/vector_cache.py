"""Encoded corpora reused across runs: the same weights on the same corpus with the same encode settings are encoded
once (`index.cache_dir`).

A sweep's trials and repeated runs of one experiment all start from the same zero-shot encoder, and on a 2-core
machine encoding SciFact's 5,183 abstracts at 256 tokens takes minutes each time. The key hashes everything that
decides the vectors: every weight tensor (names, dtypes, shapes, bytes), the retriever settings that reach the
encoder (model, pooling, lengths, prefixes, LoRA), the encode precision, batch size and stored dtype, the corpus
fingerprint, and the source of the modules that turn texts into vectors, so a change to the encoding code is a
miss, not a stale hit. An entry is written under a temporary name and renamed when complete; a hit is copied into
the run's own folder (hard links where the file system allows), so a run folder never depends on the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ragtrain.corpus.encode import VECTORS_META, VectorSet
from ragtrain.embed.precision import resolve_with_reason
from ragtrain.runtime.console import get_logger

if TYPE_CHECKING:
    from ragtrain.config.index import IndexConfig
    from ragtrain.config.retriever import RetrieverConfig
    from ragtrain.corpus.encode import VectorSet

_PACKAGE = Path(__file__).resolve().parents[1]
# The code between a text and its stored vector: tokenising, the forward pass and pooling, the Ray Data encode
CODE_FILES = ("embed/model.py", "embed/encoders.py", "corpus/encode.py")

log = get_logger(__name__)


def _hash_weights(h: hashlib._Hash, weights: dict[str, torch.Tensor]) -> None:
    for name in sorted(weights):
        t = weights[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def cache_key(
    weights: dict[str, torch.Tensor],
    retriever: RetrieverConfig,
    index: IndexConfig,
    corpus_fingerprint: str,
    max_length: int,
) -> str:
    """The hex digest naming one encoded corpus in the cache (see the module docstring for what it covers)."""
    settings = asdict(retriever)
    for unused in ("train", "teacher", "temperature", "query_max_length"):  # training-only: never reach the vectors
        settings.pop(unused, None)
    # the precision the vectors were encoded in (auto resolved: bf16 and fp32 vectors differ), never "auto"
    precision = resolve_with_reason(index.precision, "cpu")[0]  # callers pass it resolved for the encode actors
    settings.update(
        max_length=max_length,
        precision=precision,
        batch_size=index.batch_size,
        vector_dtype=index.vector_dtype,
        corpus=corpus_fingerprint,
    )
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for rel in CODE_FILES:
        h.update((_PACKAGE / rel).read_bytes())
    _hash_weights(h, weights)
    return h.hexdigest()[:32]


def _copy_tree(src: Path, dst: Path) -> None:
    """`src`'s files, subfolders included (a sharded encode's shard-<i>/), into a fresh `dst`: hard links where
    possible (same file system), else copies."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in sorted(src.rglob("*")):
        target = dst / f.relative_to(src)
        if f.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        try:
            os.link(f, target)
        except OSError:  # another file system, or links not allowed: copy
            shutil.copy2(f, target)


def lookup(cache_dir: str | Path, key: str, dest: str | Path) -> VectorSet | None:
    """The cached vector files of `key` placed in `dest` (replacing it), or None on a miss."""
    entry = Path(cache_dir) / key
    if not (entry / VECTORS_META).exists():  # absent, or an unfinished entry (never renamed into place)
        return None
    _copy_tree(entry, Path(dest))
    shards = VectorSet.load(dest)
    shards.seconds, shards.stats = 0.0, {**shards.stats, "cache_hit": 1.0}
    return shards


def store(cache_dir: str | Path, key: str, shards: VectorSet) -> Path:
    """Add a finished shard folder to the cache under `key` (a concurrent writer of the same key wins, harmlessly)."""
    root = Path(cache_dir)
    entry = root / key
    if entry.exists():
        return entry
    tmp = root / f".{key}.{uuid.uuid4().hex[:8]}.tmp"
    _copy_tree(Path(shards.folder), tmp)
    try:
        tmp.rename(entry)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not entry.exists():  # not a concurrent writer that finished first: the run goes on, uncached, and says so
            log.warning(
                f"[index] index.cache_dir: could not store the encoded corpus as {entry} ({e}); the next run "
                "encodes it again"
            )
        # else someone else finished the same entry first: theirs holds the same vectors
    return entry
