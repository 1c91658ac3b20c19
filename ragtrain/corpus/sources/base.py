"""The Protocol every data source implements, and what its `load` receives (`Load`): the run's settings for reading,
chunking and storing the corpus. `ragtrain.corpus.load.load_data` builds a `Load` and calls the configured source."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ragtrain.config.data import DataConfig
from ragtrain.config.retriever import RetrieverConfig
from ragtrain.corpus.dataset import chunk_data
from ragtrain.corpus.prepare import use_ray
from ragtrain.data import RetrievalData
from ragtrain.runtime.console import get_logger

if TYPE_CHECKING:
    from ragtrain.corpus.stream import StreamEncode

log = get_logger(__name__)


@dataclass
class Load:
    """One `load_data` call: the data config and where its corpus goes."""

    cfg: DataConfig
    retriever: RetrieverConfig | None  # its tokenizer chunks (data.chunk.enabled)
    tokenizer: Any  # the retriever's tokenizer when data.chunk.enabled (checked against the encoder), else None
    out_dir: Path | None  # receives the generated documents (data.generate; a temporary folder when None)
    corpus_dir: Path | None  # <out_dir>/corpus: the passage store's folder; None keeps the corpus a dict
    start_ray: Callable[[], None] | None  # starts Ray when data.prepare puts the reading on Ray Data
    ray_tasks: int  # chunking tasks on Ray
    stream: StreamEncode | None  # the run's first encode, fused with reading on Ray (documents)

    @property
    def passages(self) -> Path | None:
        """The store every later stage reads texts from."""
        return self.corpus_dir / "passages.arrow" if self.corpus_dir else None

    @property
    def documents(self) -> Path | None:
        """Where the read documents go: their own store when they are chunked next, else the passage store."""
        if self.corpus_dir is None:
            return None
        return self.corpus_dir / "documents.arrow" if self.cfg.chunk.enabled else self.passages


class DataSource(Protocol):
    """Built as `cls()`; its registry entry carries the facts the config checks read (what data.root names, the
    optional data keys it reads)."""

    def load(self, ld: Load) -> RetrievalData:
        """The source's corpus, queries, qrels (and answers), chunked when data.chunk.enabled."""
        ...


def prepare_on_ray(ld: Load, total_bytes: int) -> bool:
    """Whether Ray Data tasks and actors read, clean and chunk the corpus (data.prepare, by its size); Ray is
    started for it here (bad files then fail after Ray has started), and a driver without Ray prepares itself."""
    if ld.documents is None or not use_ray(ld.cfg.prepare.value, total_bytes):
        return False
    if ld.start_ray is not None:
        ld.start_ray()
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    if not ray.is_initialized():
        log.info(f"[data] data.prepare={ld.cfg.prepare.value}: Ray is not running here, preparing in the driver")
        return False
    return True


def file_size(path: Path) -> int:
    """Bytes of a listed document file; 0 for one that cannot be stat'ed (a link cycle or a link to nothing): it is
    reported, under data.on_error, when it is read."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def chunked(ld: Load, data: RetrievalData, on_ray: bool) -> RetrievalData:
    """`data` split into passages of data.chunk.max_tokens (on Ray tasks when it was read there), or as it is."""
    if not ld.cfg.chunk.enabled:
        return data
    n_docs, c = len(data.corpus), ld.cfg.chunk
    data = chunk_data(
        data, ld.tokenizer, c.max_tokens, c.overlap, ld.passages, ld.ray_tasks if on_ray else 0, ld.retriever
    )
    log.info(
        f"[data] {n_docs} documents -> {len(data.corpus)} chunks of <= {c.max_tokens} tokens (overlap {c.overlap})"
    )
    return data
