"""FAISS index from any `index_factory` string (inner product), saved with JSON metadata and checked on load."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import faiss
import numpy as np

from ragtrain.runtime.errors import ConfigError

if TYPE_CHECKING:
    pass

INDEX_FILE = "index.faiss"
META_FILE = "index_meta.json"
IDS_FILE = "doc_ids.txt"
METRIC = "inner_product"  # unit-norm vectors: inner product == cosine


class IndexMismatchError(ValueError):
    """A saved index does not match what the caller expects (dim, metric or corpus)."""


@dataclass
class IndexMeta:
    factory: str
    dim: int
    metric: str
    ntotal: int
    corpus_fingerprint: str
    encoder: str  # which encoder produced the vectors: model name + checkpoint / step
    encoder_step: int
    precision: str
    version: int = 0  # bumped by each rebuild during training
    build_seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def set_search_params(index: faiss.Index, nprobe: int, ef_search: int) -> None:
    """Set IVF nprobe and HNSW efSearch on a raw faiss index, where its type has them."""
    ps = faiss.ParameterSpace()
    for name, value in (("nprobe", nprobe), ("efSearch", ef_search)):
        try:
            ps.set_index_parameter(index, name, value)
        except RuntimeError:
            pass  # this index type has no such parameter (e.g. Flat has neither): nothing to set


class DenseIndex:
    """A FAISS index plus the doc ids of its rows and its metadata."""

    def __init__(self, index: faiss.Index, doc_ids: list[str], meta: IndexMeta):
        self.index, self.doc_ids, self.meta = index, doc_ids, meta

    def set_search_params(self, nprobe: int = 16, ef_search: int = 128) -> None:
        """Apply search-time knobs where the index type has them (IVF nprobe, HNSW efSearch)."""
        set_search_params(self.index, nprobe, ef_search)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, row positions) for each query row; positions are -1 where fewer than k exist."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if q.ndim != 2 or q.shape[1] != self.meta.dim:
            raise IndexMismatchError(f"query vectors have shape {q.shape}, index dim is {self.meta.dim}")
        if k < 1 or self.index.ntotal == 0:
            raise ValueError(f"search needs k >= 1 and a non-empty index (k={k}, ntotal={self.index.ntotal})")
        return self.index.search(q, min(k, self.index.ntotal))

    def search_ids(self, queries: np.ndarray, k: int) -> list[list[str]]:
        """Top-k doc ids per query row (FAISS's -1 padding dropped): `search` with the rows named."""
        _, rows = self.search(queries, k)
        return [[self.doc_ids[r] for r in row if r >= 0] for row in rows]

    @property
    def ntotal(self) -> int:
        """Rows in the index."""
        return int(self.index.ntotal)

    def reconstruct_first(self, n: int) -> np.ndarray | None:
        """The stored vectors of the first `n` rows, decoded (PQ / SQ codes give their approximation), or None for an
        index type that cannot give them back. An IVF index gets a row -> list map for the call (8 bytes a row)."""
        # faiss's stubs lack the DirectMap class its module has
        no_map = faiss.DirectMap.NoMap  # type: ignore[attr-defined]
        ivf = faiss.try_extract_index_ivf(self.index)
        mapped = ivf if ivf is not None and ivf.direct_map.type == no_map else None  # the map to drop afterwards
        if mapped is not None:
            mapped.make_direct_map()
        try:
            return np.stack([self.index.reconstruct(i) for i in range(min(n, self.index.ntotal))])
        except RuntimeError:  # e.g. an HNSW graph over PQ codes: no reconstruction
            return None
        finally:
            if mapped is not None:
                mapped.make_direct_map(False)

    def as_stored(self, x: np.ndarray) -> np.ndarray:
        """`x` as this index stores vectors: encoded and decoded by its codec (PQ / SQ rounding, a pre-transform and
        back), to compare with `reconstruct_first`; `x` itself where the index has no standalone codec (HNSW)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        try:
            return self.index.sa_decode(self.index.sa_encode(x))
        except RuntimeError:  # faiss: "standalone codec not implemented for this type of index"
            return x

    def serialize(self) -> np.ndarray:
        """faiss's serialised bytes of the index (for searchers that load their own copy)."""
        return faiss.serialize_index(self.index)

    def drop(self) -> None:
        """Nothing to free elsewhere: an in-process index goes with its last reference (`RemoteIndex.drop`)."""

    def save(self, folder: str | Path) -> Path:
        """Write index.faiss, doc_ids.txt and index_meta.json into `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        faiss.write_index(self.index, str(folder / INDEX_FILE))
        (folder / IDS_FILE).write_text("\n".join(self.doc_ids) + "\n", encoding="utf-8")
        (folder / META_FILE).write_text(json.dumps(asdict(self.meta), indent=2, sort_keys=True))
        return folder


def make_index(factory: str, dim: int, rows: int | None = None) -> faiss.Index:
    """An empty inner-product index from a factory string; one FAISS rejects is a ConfigError naming it. With
    `rows`, also one the corpus is too small to train (more IVF lists or PQ centroids than vectors)."""
    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as e:
        raise ConfigError(
            f"index.factory={factory!r} is not a valid faiss index_factory string for dim {dim} "
            f"(e.g. Flat, IVF64,Flat, HNSW32, IVF64,PQ16 — PQ's M must divide the dim): "
            f"{str(e).strip().splitlines()[-1]}"
        ) from None
    if rows is None or index.is_trained:
        return index
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None and ivf.nlist > rows:
        raise ConfigError(
            f"index.factory={factory!r} asks for {ivf.nlist} IVF lists but the corpus has only {rows} "
            "vectors: use fewer lists (faiss recommends >= 39 training vectors per list)"
        )
    pq = product_quantizer(index)
    if pq is not None and pq.ksub > rows:
        raise ConfigError(
            f"index.factory={factory!r}: its product quantiser needs >= {pq.ksub} training vectors ({pq.nbits}-bit "
            f"codes) but the corpus has only {rows}: use fewer bits (e.g. PQ16x4) or a Flat index"
        )
    return index


def product_quantizer(index: faiss.Index):
    """The product quantiser of an index (IVF-PQ or PQ), or None."""
    ivf = faiss.try_extract_index_ivf(index)
    inner = faiss.downcast_index(ivf if ivf is not None else index)
    return getattr(inner, "pq", None)


def check_index_config(factory: str, dim: int, rows: int | None = None) -> None:
    """Refuse, before any encoding or training, a factory FAISS rejects or (given the corpus size `rows`) one the
    corpus is too small to train."""
    make_index(factory, dim, rows)


# faiss-cpu (a dependency) and faiss-gpu both install the `faiss` module: the CPU one goes, then the GPU one is
# reinstalled over the files they shared (`make setup EXTRAS=dev,gpu` runs the same steps)
GPU_EXTRA = "pip install -e .[gpu] && pip uninstall -y faiss-cpu && pip install --force-reinstall --no-deps faiss-gpu"
GPU_PROBE_TIMEOUT_S = 300.0  # a first CUDA start can JIT-compile PTX for a newer GPU: minutes, not hours
GPU_PROBE_FACTORY_EXIT = 3  # the probe's exit code for a factory with no GPU version (its last line says why)


def faiss_gpu_support(lib: Any = faiss) -> bool:
    """Whether this FAISS build has GPU support at all (faiss-gpu; faiss-cpu has no StandardGpuResources)."""
    return hasattr(lib, "StandardGpuResources") and hasattr(lib, "get_num_gpus")


def gpu_probe_command(factory: str, dim: int) -> list[str]:
    """The child process that copies `factory` to GPU 0 and runs FAISS's kernels there (ragtrain/index/gpu_probe.py)."""
    return [sys.executable, "-m", "ragtrain.index.gpu_probe", factory, str(dim)]


def check_index_device(
    device: str,
    factory: str,
    dim: int,
    lib: Any = faiss,
    visible_gpus: Callable[[], int] | None = None,
    probe: Sequence[str] | None = None,
) -> None:
    """index.device=cuda needs a FAISS with GPU support that sees a GPU, can run its kernels on that GPU, and a
    factory FAISS can put on one: a ConfigError names what is missing, before any work. `visible_gpus`: how many
    CUDA GPUs this machine shows (default: torch's count); `probe`: the child process that tries the GPU (default
    `gpu_probe_command`)."""
    if device != "cuda":
        return
    version = getattr(lib, "__version__", "?")
    if not faiss_gpu_support(lib):
        raise ConfigError(
            f"index.device=cuda needs FAISS with GPU support, and the installed faiss {version} is a CPU build: "
            f"install the gpu extra ({GPU_EXTRA}) or set index.device=cpu"
        )
    if lib.get_num_gpus() == 0:
        if visible_gpus is None:
            import torch  # lazy: only a cuda index asks

            visible_gpus = torch.cuda.device_count
        seen = visible_gpus()
        if seen == 0:
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ConfigError(
                "index.device=cuda, but no CUDA GPU is visible on this machine"
                + (f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else "")
                + ": set index.device=cpu"
            )
        raise ConfigError(
            f"index.device=cuda: faiss {version} sees no GPU while torch sees {seen}: faiss-gpu needs the "
            "CUDA 12 runtime libraries (libcudart.so.12, libcublas.so.12) beside the driver; install them or set "
            "index.device=cpu"
        )
    # A FAISS build without code for this GPU (faiss-gpu-cu12 on an H100) sees it, copies an empty index to it, and
    # aborts the process at its first search; HNSW and other CPU-only types fail the copy. Both are asked of a
    # child process, which also leaves the CUDA context and FAISS's scratch memory out of this one.
    _run_gpu_probe(list(probe) if probe is not None else gpu_probe_command(factory, dim), version)


def _run_gpu_probe(cmd: list[str], version: str) -> None:
    """Run the GPU probe; a ConfigError with its reason when it fails."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=GPU_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"index.device=cuda: a FAISS search on the GPU did not finish within {GPU_PROBE_TIMEOUT_S:g} s "
            "(is the GPU busy or hung? nvidia-smi shows it); set index.device=cpu to search on CPUs"
        ) from None
    if proc.returncode == 0:
        return
    said = proc.stdout.strip().splitlines()
    if proc.returncode == GPU_PROBE_FACTORY_EXIT and said:
        raise ConfigError(said[-1])
    gpu = said[0] if said else "this GPU"
    raise ConfigError(
        f"index.device=cuda: faiss {version} cannot search on {gpu}: {_probe_failure(proc)}; the gpu extra's "
        f"faiss-gpu>=1.15.1 carries code for compute capability 7.0 and later ({GPU_EXTRA}), or set index.device=cpu"
    )


def _probe_failure(proc: subprocess.CompletedProcess) -> str:
    """The probe's reason: FAISS's CUDA error ("CUDA error 209 no kernel image is available for execution on the
    device"), else its last line of output, else how it ended."""
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        found = re.search(r"(CUDA error .*)$", line)
        if found:
            return found[1][:200]
    said = proc.stdout.strip().splitlines()
    if proc.returncode not in (0, 1) and len(said) > 1:  # the probe's own verdict (wrong neighbours)
        return said[-1][:200]
    if lines:
        return lines[-1][:200]
    if proc.returncode < 0:
        return f"the probe was killed by {signal.Signals(-proc.returncode).name}"
    return f"the probe exited with code {proc.returncode}"


@functools.cache
def gpu_resources(lib: Any = faiss) -> Any:
    """One StandardGpuResources per process (its scratch memory and streams serve every index of the process)."""
    return lib.StandardGpuResources()


def index_to_gpu(index: faiss.Index, factory: str, lib: Any = faiss, res: Any = None) -> faiss.Index:
    """A copy of `index` on this process's first visible GPU (a Ray actor sees the GPU it was given as device 0),
    with `res` (default: the process's cached resources); a factory FAISS cannot put on a GPU is a ConfigError
    naming index.factory."""
    try:
        return lib.index_cpu_to_gpu(gpu_resources(lib) if res is None else res, 0, index)
    except (RuntimeError, AttributeError) as e:
        raise ConfigError(
            f"index.factory={factory!r} cannot run on a GPU (index.device=cuda): "
            f"{str(e).strip().splitlines()[-1][:200]}; use Flat, IVF<n>,Flat or IVF<n>,PQ<m>, or index.device=cpu"
        ) from None


def set_gpu_search_params(index: faiss.Index, nprobe: int) -> None:
    """IVF nprobe on a GPU index (GPU indexes have no HNSW; Flat has no parameter)."""
    try:
        faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", nprobe)
    except RuntimeError:
        pass  # a GPU Flat index has no nprobe


POINTS_PER_CENTROID = 256  # faiss k-means subsamples to this many points per centroid anyway


def training_points(factory: str, dim: int) -> int:
    """How many training vectors the factory's quantisers can use (0: the type needs no training)."""
    index = make_index(factory, dim)
    if index.is_trained:
        return 0
    need = 1
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        need = max(need, POINTS_PER_CENTROID * ivf.nlist)
    pq = product_quantizer(index)
    if pq is not None:
        need = max(need, POINTS_PER_CENTROID * pq.ksub)
    return need


def trained_empty(
    factory: str,
    dim: int,
    rows: int,
    sample: Callable[[int, int], np.ndarray],
    seed: int = 0,
    train_size: int | None = None,
) -> tuple[faiss.Index, int]:
    """An empty index of `factory` for `rows` vectors of `dim`, its quantisers (IVF, PQ) trained on
    `sample(size, seed)`: `train_size` seeded rows (default: what they use, 256 per centroid, capped at the set).
    Returns (index, rows sampled). Every shard of a sharded index copies one such index, so all score alike."""
    index = make_index(factory, dim, rows)  # a bad factory fails before any vector is read
    sampled = 0
    if not index.is_trained:
        seed_training(index, seed)
        sampled = min(rows, train_size or training_points(factory, dim))
        try:
            index.train(np.ascontiguousarray(sample(sampled, seed), dtype=np.float32))
        except RuntimeError as e:
            raise ConfigError(
                f"index.factory={factory!r} could not be trained on {sampled} vectors: "
                f"{str(e).strip().splitlines()[-1]} (use a smaller index type for a small corpus, e.g. Flat)"
            ) from None
    return index, sampled


def build_from_chunks(
    chunks: Iterable[tuple[Sequence[str], np.ndarray]],
    index: faiss.Index,
    meta: IndexMeta,
) -> DenseIndex:
    """The one way a FAISS index is filled: every chunk of (ids, vectors) added in order to `index` (empty, trained
    where its type needs it: `trained_empty`); `meta` gets the row count and the build time. Vector files on disk
    (`ragtrain/index/vector_files.py`), a row range of them (an index shard) and an in-memory matrix (`build_index`: one
    chunk) all come through here."""
    start = time.perf_counter()
    doc_ids: list[str] = []
    for ids, vecs in chunks:
        index.add(np.ascontiguousarray(vecs, dtype=np.float32))
        doc_ids.extend(ids)
    if len(set(doc_ids)) != len(doc_ids):  # a retried batch written twice would show up here
        raise ValueError(f"{len(doc_ids) - len(set(doc_ids))} duplicate passage ids among the vectors to index")
    meta.ntotal, meta.build_seconds = int(index.ntotal), meta.build_seconds + time.perf_counter() - start
    return DenseIndex(index, doc_ids, meta)


def build_index(
    vectors: np.ndarray,
    doc_ids: Sequence[str],
    factory: str,
    corpus_fingerprint: str,
    encoder: str,
    encoder_step: int = 0,
    precision: str = "fp32",
    seed: int = 0,
) -> DenseIndex:
    """An inner-product index of an in-memory matrix (one chunk of `build_from_chunks`), training it first on a
    seeded sample when the type needs it."""
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] != len(doc_ids):
        raise ValueError(f"vectors shape {x.shape} does not match {len(doc_ids)} doc ids")
    start = time.perf_counter()

    def sample(size: int, seed: int) -> np.ndarray:  # seeded rows in corpus order, as from shards
        return x[np.sort(np.random.default_rng(seed).choice(len(x), size=size, replace=False))]

    index, _ = trained_empty(factory, x.shape[1], x.shape[0], sample, seed)
    meta = IndexMeta(
        factory=factory,
        dim=int(x.shape[1]),
        metric=METRIC,
        ntotal=0,
        corpus_fingerprint=corpus_fingerprint,
        encoder=encoder,
        encoder_step=encoder_step,
        precision=precision,
        build_seconds=time.perf_counter() - start,
    )
    return build_from_chunks([(list(doc_ids), x)], index, meta)


def exact_search(queries: np.ndarray, passages: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k (scores, rows) of queries against a small in-memory passage sample (training probes, validation):
    a Flat index searched through `DenseIndex.search`, so probes rank the way every index does."""
    p = np.ascontiguousarray(passages, dtype=np.float32)
    index = build_index(p, [str(i) for i in range(len(p))], "Flat", corpus_fingerprint="probe", encoder="probe")
    return index.search(queries, k)


def seed_training(index, seed: int) -> None:
    """Make an untrained index's training reproducible: seeded k-means (IVF) and PQ; no polysemous training."""
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        ivf.cp.seed = seed  # k-means initialisation is random: make it reproducible
    inner = faiss.downcast_index(ivf if ivf is not None else index)
    if hasattr(inner, "do_polysemous_training"):
        inner.do_polysemous_training = False  # ~13 CPU-s per build for a search mode we never use
    if hasattr(inner, "pq"):
        inner.pq.cp.seed = seed


def load_index(
    folder: str | Path,
    expect_dim: int | None = None,
    expect_corpus: str | None = None,
    expect_metric: str = METRIC,
    mmap: bool = False,
) -> DenseIndex:
    """Load an index saved by `DenseIndex.save`, failing clearly if it does not match what the caller needs.

    mmap=True maps the vectors read-only instead of reading them (faiss IO_FLAG_MMAP_IFC): a driver that only
    checks an index (metadata, its first rows) keeps its RSS flat whatever the index's size."""
    folder = Path(folder)
    meta_path = folder / META_FILE
    for p in (folder / INDEX_FILE, meta_path, folder / IDS_FILE):
        if not p.exists():
            raise FileNotFoundError(f"{p} is missing: {folder} is not a saved ragtrain index")
    try:
        meta = IndexMeta(**json.loads(meta_path.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise IndexMismatchError(f"{meta_path}: unreadable index metadata ({e})") from None
    if meta.metric != expect_metric:
        raise IndexMismatchError(f"{meta_path}: index metric is {meta.metric!r}, expected {expect_metric!r}")
    if expect_dim is not None and meta.dim != expect_dim:
        raise IndexMismatchError(
            f"{meta_path}: index dim is {meta.dim} but the encoder produces {expect_dim}-dim vectors "
            f"(index built by {meta.encoder!r})"
        )
    if expect_corpus is not None and meta.corpus_fingerprint != expect_corpus:
        raise IndexMismatchError(
            f"{meta_path}: index was built from a different corpus (fingerprint {meta.corpus_fingerprint}, "
            f"this corpus is {expect_corpus}): rebuild the index"
        )
    try:
        index = faiss.read_index(
            str(folder / INDEX_FILE), faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY if mmap else 0
        )
    except RuntimeError as e:  # FAISS's own reader: a truncated or overwritten file
        raise IndexMismatchError(
            f"{folder / INDEX_FILE}: not a readable FAISS index, the file is corrupt or "
            f"truncated ({str(e).strip().splitlines()[-1][:160]}): rebuild the index"
        ) from None
    doc_ids = (folder / IDS_FILE).read_text(encoding="utf-8").split("\n")[:-1]  # not splitlines: ids may hold \x85 etc.
    if index.ntotal != meta.ntotal or len(doc_ids) != meta.ntotal or index.d != meta.dim:
        raise IndexMismatchError(
            f"{folder}: files disagree (index ntotal={index.ntotal} d={index.d}, {len(doc_ids)} ids, "
            f"metadata ntotal={meta.ntotal} dim={meta.dim}): the index folder is corrupt"
        )
    return DenseIndex(index, doc_ids, meta)
