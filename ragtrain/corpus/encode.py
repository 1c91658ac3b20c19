"""Corpus encoding as a Ray Data stage: rows {id, text} -> `map_batches(EncodeBatch)` -> parquet vector files.

Ray Data runs `EncodeBatch` (ragtrain/embed/encoders.py, the one way texts become vectors) in an actor pool. Each
actor builds the encoder from the RetrieverConfig and loads the weights snapshot from the object store once, in
`__init__`; then it embeds one batch of rows per call (`ragtrain.embed.model.encode_texts`: length-sorted inner
batches) and returns (id, vector) rows that Ray Data writes as parquet vector files under `<output_dir>/vectors/<tag>/`
while the next batches encode. The driver never holds the vectors: it gets back a `VectorSet` (folder, files, row
count, dim), and FAISS is built from the files (`ragtrain/index/vector_files.py`).

Fault tolerance is Ray Data's: the actors are started with `max_restarts` / `max_task_retries`, so a batch whose
actor died is retried on the restarted actor, and its output is written once (tested with an injected death:
`fault.kill_encode_actor_at_batch`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ragtrain.config.index import IndexConfig
from ragtrain.config.resources import PoolResources
from ragtrain.config.retriever import Precision, RetrieverConfig
from ragtrain.data.store import PassageStore
from ragtrain.embed.encoders import VECTOR_DTYPES, EncodeBatch, EncodeFault

VECTORS_META = "shards.json"  # written last: a folder without it is an unfinished encode
VECTOR_FILE_ROWS = 16384  # at most this many rows per parquet vector file (64 MB of MiniLM fp32 vectors)
MAX_ACTOR_RESTARTS = 3  # a dead encode actor is restarted this many times; its batch is retried on it
# Leave this much of the cluster's CPU to Ray Data's own read / write tasks: an actor pool that claims every
# logical CPU starves them and the stream stalls.
IO_CPU_RESERVE = 0.5
# The encode actors' environment: OpenMP threads wait passively (shared cores; see cluster/resources.WORKER_ENV).
ACTOR_ENV = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


@dataclass
class VectorSet:
    """Vector files on disk: parquet files of (id, vector) rows, and their summary (`shards.json`)."""

    folder: str
    files: list[str]
    rows: int
    dim: int
    dtype: str
    seconds: float = 0.0
    stats: dict = field(default_factory=dict)

    @property
    def docs_per_s(self) -> float:
        return self.rows / max(self.seconds, 1e-9)

    def iter_parts(self, columns: Sequence[str] = ("id", "vector")) -> Iterator[tuple[list[str], np.ndarray]]:
        """(ids, [n, dim] vectors in the stored dtype) per vector file, in file order; one file in memory at a time."""
        import pyarrow.parquet as pq  # lazy: pyarrow loads a native library; this module imports without it

        for f in self.files:
            t = pq.read_table(Path(self.folder, f), columns=list(columns))
            ids = t.column("id").to_pylist()
            vec = t.column("vector").combine_chunks()
            arr = (
                vec.flatten().to_numpy(zero_copy_only=False).reshape(len(vec), self.dim)
                if len(vec)
                else np.empty((0, self.dim), dtype=self.dtype)
            )
            yield ids, arr

    def ids(self) -> list[str]:
        """Every row's id in file order (ids only: the vectors are not read)."""
        import pyarrow.parquet as pq  # lazy: pyarrow loads a native library; this module imports without it

        out: list[str] = []
        for f in self.files:
            out.extend(pq.read_table(Path(self.folder, f), columns=["id"]).column("id").to_pylist())
        return out

    def in_order(self, doc_ids: Sequence[str]) -> VectorSet:
        """These files made to hold `doc_ids` in that order (the corpus's), `shards.json` rewritten.

        Ray Data names the files of a write by the write task's index, which follows when a block was ready, not its
        place in the dataset, and one write task may take two blocks that are not neighbours (seen on SQuAD: a first
        file with rows 512-1023, a last one with rows 2048-2066 then 512-1023). The index shards and the live refresh
        number rows in corpus order, so a row out of place pairs one passage's id with another's refreshed vector. A
        file holding several runs of rows is split at the breaks (one file in memory at a time), and the pieces are
        ordered; a set whose rows are not exactly the corpus is refused.
        """
        import pyarrow.parquet as pq  # lazy: pyarrow loads a native library; this module imports without it

        where = {d: i for i, d in enumerate(doc_ids)}
        folder, pieces, split = Path(self.folder), [], False
        for f in self.files:
            ids = pq.read_table(folder / f, columns=["id"]).column("id").to_pylist()  # the vectors only to split
            missing = [d for d in ids if d not in where]
            if missing:
                raise ValueError(
                    f"{folder / f}: {len(missing)} ids are not passages of the corpus (first: {missing[0]!r})"
                )
            pos = [where[d] for d in ids]
            cuts = [0] + [k for k in range(1, len(pos)) if pos[k] != pos[k - 1] + 1] + [len(pos)]
            if len(cuts) == 2:
                pieces.append((pos[0], len(pos), f))
                continue
            split, table = True, pq.read_table(folder / f)
            for j, (a, b) in enumerate(zip(cuts, cuts[1:])):
                name = f"{Path(f).stem}-{j:03d}.parquet"
                pq.write_table(table.slice(a, b - a), folder / name)
                pieces.append((pos[a], b - a, name))
            (folder / f).unlink()
        pieces.sort()
        start = 0
        for first, rows, _ in pieces:
            if first != start:
                raise ValueError(
                    f"{folder}: the vector files hold {self.rows} rows that are not the corpus's {len(doc_ids)} "
                    f"passages once each (row {start} is missing or repeated)"
                )
            start += rows
        if start != len(doc_ids):
            raise ValueError(f"{folder}: the vector files hold {start} rows, the corpus {len(doc_ids)} passages")
        files = [name for _, _, name in pieces]
        if split or files != self.files:
            self.files = files
            self.save_meta()
        return self

    def vectors_of(self, wanted: Sequence[str]) -> np.ndarray:
        """fp32 vectors of the ids in `wanted`, in that order, read file by file (only those rows are kept)."""
        where = {d: i for i, d in enumerate(wanted)}
        out = np.empty((len(where), self.dim), dtype=np.float32)
        found = 0
        for ids, vecs in self.iter_parts():
            hits = [(i, where[d]) for i, d in enumerate(ids) if d in where]
            if hits:
                rows, slots = zip(*hits)
                out[list(slots)] = vecs[list(rows)]
                found += len(hits)
        if found != len(where):
            raise ValueError(f"{self.folder}: {len(where) - found} of {len(where)} wanted ids are not in the files")
        return out

    def read_all(self, order: Sequence[str] | None = None) -> tuple[list[str], np.ndarray]:
        """All (ids, fp32 vectors); with `order`, rows are returned in that id order. For small corpora only
        (tests, the live-refresh service's version 0): this is the whole matrix."""
        ids: list[str] = []
        out = np.empty((self.rows, self.dim), dtype=np.float32)
        for shard_ids, vecs in self.iter_parts():
            out[len(ids) : len(ids) + len(shard_ids)] = vecs
            ids.extend(shard_ids)
        if order is not None:
            pos = {d: i for i, d in enumerate(ids)}
            missing = [d for d in order if d not in pos]
            if missing or len(order) != len(ids):
                raise ValueError(
                    f"{self.folder}: the files hold {len(ids)} ids, asked for {len(order)} "
                    f"({len(missing)} missing, e.g. {missing[:3]})"
                )
            out = out[[pos[d] for d in order]]
            ids = list(order)
        return ids, out

    def save_meta(self) -> VectorSet:
        """Write `shards.json` (every field but the folder): written last, so a folder without it is unfinished."""
        meta = asdict(self)
        meta.pop("folder")
        Path(self.folder, VECTORS_META).write_text(json.dumps(meta, indent=2))
        return self

    @classmethod
    def load(cls, folder: str | Path) -> VectorSet:
        meta = Path(folder, VECTORS_META)
        if not meta.exists():
            raise FileNotFoundError(f"{meta} is missing: {folder} is not a finished vector folder")
        d = json.loads(meta.read_text())
        d["folder"] = str(Path(folder).resolve())
        return cls(**d)


def write_vectors(
    folder: str | Path, chunks: Iterable[tuple[list[str], np.ndarray]], dtype: str = "float32"
) -> VectorSet:
    """Write (ids, vectors) chunks as a vector folder in encode_to_vectors' layout (replaced if it exists)."""
    # lazy: pyarrow loads a native library; this module imports without it
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(folder)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    files, rows, dim = [], 0, 0
    for k, (ids, vecs) in enumerate(chunks):
        v = np.ascontiguousarray(vecs, dtype=dtype)
        dim = v.shape[1]
        flat = pa.array(v.reshape(-1), type=pa.from_numpy_dtype(np.dtype(dtype)))
        files.append(f"part-{k:05d}.parquet")
        pq.write_table(
            pa.table({"id": list(ids), "vector": pa.FixedSizeListArray.from_arrays(flat, dim)}), out / files[-1]
        )
        rows += len(ids)
    if rows == 0:
        raise ValueError(f"write_vectors: no rows to write into {out}")
    return VectorSet(str(out.resolve()), files, rows, dim, dtype).save_meta()


def actor_cpus(pool: PoolResources) -> float:
    """CPUs each encode actor reserves: resources.pool.cpus_per_actor, shrunk when the pool would claim every CPU
    of the cluster (Ray Data's read/write tasks need a little); torch still runs int(cpus_per_actor) threads."""
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    total = float(ray.cluster_resources().get("CPU", 0.0))
    want = pool.cpus_per_actor * pool.num_actors
    if total and want > total - IO_CPU_RESERVE:
        return max(0.05, (total - IO_CPU_RESERVE) / pool.num_actors)
    return float(pool.cpus_per_actor)


def build_threads(pool: PoolResources) -> int:
    """Torch threads per encode actor for a build that nothing runs beside (the zero-shot and trained indexes; a
    live refresh keeps to its pool): on one node, the CPUs free now shared by the pool's actors, so a laptop's
    1-actor pool uses every core; on a cluster, resources.pool.cpus_per_actor (other nodes' CPUs are not the
    actors' to take)."""
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    cpus = max(1, int(pool.cpus_per_actor))
    if pool.gpus_per_actor or len([n for n in ray.nodes() if n.get("Alive")]) != 1:
        return cpus
    # Ray's CPUs are logical (ray.init(num_cpus=8) on 2 cores): threads beyond the cores would only contend
    free = min(ray.available_resources().get("CPU", 0.0), len(os.sched_getaffinity(0)))
    return max(cpus, int(free // pool.num_actors))


def rows_dataset(ids: Sequence[str], texts: Sequence[str], rows_per_block: int = 4096):
    """A Ray Data dataset of rows {id, text} from in-memory lists (the corpus loaders' output), in blocks."""
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    if len(ids) != len(texts):
        raise ValueError(f"{len(ids)} ids but {len(texts)} texts")
    blocks = max(1, -(-len(ids) // rows_per_block))
    return ray.data.from_items([{"id": str(i), "text": t} for i, t in zip(ids, texts)], override_num_blocks=blocks)


def _read_range(batch: dict[str, np.ndarray], path: str) -> dict[str, np.ndarray]:
    """Ray Data: rows [start, stop) of a PassageStore as {id, text} (the full text that is embedded)."""
    store = PassageStore(path)
    ids: list[str] = []
    texts: list[str] = []
    for start, stop in zip(batch["start"].tolist(), batch["stop"].tolist()):
        i, t = store.slice_texts(start, stop)
        ids += i
        texts += t
    return {"id": np.array(ids, dtype=object), "text": np.array(texts, dtype=object)}


def store_dataset(store: Any, rows_per_block: int = 4096):
    """A Ray Data dataset of rows {id, text} read from a `PassageStore` by the read tasks, `rows_per_block` rows a
    block: the driver sends row ranges, never texts (the store file must be readable where the tasks run)."""
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    n = len(store)
    ranges = [{"start": s, "stop": min(n, s + rows_per_block)} for s in range(0, n, rows_per_block)]
    # The read tasks take a fraction of a CPU, like the write tasks: an encode pool may hold the rest of the cluster
    return ray.data.from_items(ranges, override_num_blocks=len(ranges)).map_batches(
        _read_range,
        fn_kwargs={"path": str(store.path)},
        batch_size=1,
        batch_format="numpy",
        num_cpus=IO_CPU_RESERVE / 2,
    )


def encode_stage(
    rows: Any,
    weights_ref: Any,
    retriever: RetrieverConfig,
    index: IndexConfig,
    pool: PoolResources,
    per_call: int,
    *,
    max_length: int | None = None,
    vector_dtype: str = "float32",
    fault: EncodeFault | None = None,
    stats_dir: str | None = None,
    num_gpus_per_actor: float = 0.0,
    text_column: str = "text",
    keep_columns: bool = False,
    num_threads: int | None = None,
) -> Any:
    """`rows.map_batches(EncodeBatch)` on the encode actor pool: `pool.num_actors` actors x `actor_cpus(pool)` CPUs
    (+ `num_gpus_per_actor`, + custom resources such as index_node), `per_call` rows per call; a dataset of
    (id, vector) rows, or of every input column but `text_column` plus vector (`keep_columns`)."""
    from ray.data import ActorPoolStrategy  # lazy: ray is heavy (~0.5 s); this module imports without it

    # Bounded retries (Ray Data's default is unlimited: a batch that kills every actor would loop forever). Ray
    # 2.60 has no named parameter for these yet, so they go through ray_remote_args (its deprecation warning is muted).
    remote_args: dict[str, Any] = {"max_restarts": MAX_ACTOR_RESTARTS, "max_task_retries": MAX_ACTOR_RESTARTS}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return rows.map_batches(
            EncodeBatch,
            fn_constructor_kwargs=dict(
                retriever=retriever,
                weights=[weights_ref],
                max_length=max_length or retriever.passage_max_length,
                batch_size=index.batch_size,
                precision=Precision(index.precision).value,
                vector_dtype=vector_dtype,
                num_threads=num_threads or max(1, int(pool.cpus_per_actor)),
                fault=fault,
                stats_dir=stats_dir,
                text_column=text_column,
                keep_columns=keep_columns,
            ),
            batch_size=per_call,
            batch_format="numpy",
            compute=ActorPoolStrategy(size=pool.num_actors),
            num_cpus=actor_cpus(pool),
            num_gpus=num_gpus_per_actor or None,
            resources={k: float(v) for k, v in pool.resources.items()} or None,  # e.g. index_node
            runtime_env={"env_vars": ACTOR_ENV},
            **remote_args,
        )


def encode_to_vectors(
    rows: Any,
    weights_ref: Any,
    retriever: RetrieverConfig,
    index: IndexConfig,
    pool: PoolResources,
    out_dir: str | Path,
    *,
    max_length: int | None = None,
    vector_dtype: str = "float32",
    fault: EncodeFault | None = None,
    stats_dir: str | None = None,
    progress: bool = False,
    num_gpus_per_actor: float = 0.0,
    preserve_order: bool = True,
    num_threads: int | None = None,
) -> VectorSet:
    """Encode a dataset of rows {id, text} into parquet vector files under `out_dir` (replaced if it exists).

    rows: a `ray.data.Dataset` with columns id and text (streamed: read -> clean -> chunk -> encode -> write), a
    `PassageStore` (read by Ray Data tasks a range at a time), or an (ids, texts) pair of lists. weights_ref: an
    ObjectRef of the encoder's state dict (`ray.put` once). The actor pool: `pool.num_actors` actors x
    `actor_cpus(pool)` CPUs (+ `num_gpus_per_actor`, + custom resources such as index_node), `index.shard_size` rows
    per call, `index.batch_size` texts per forward pass, `index.precision`.
    """
    from ray.data import DataContext  # lazy: ray is heavy (~0.5 s); this module imports without it

    if vector_dtype not in VECTOR_DTYPES:
        raise ValueError(f"vector_dtype={vector_dtype!r} must be one of {list(VECTOR_DTYPES)}")

    per_call = index.shard_size
    if isinstance(rows, PassageStore):  # a small corpus still feeds every actor
        per_call = max(1, min(per_call, -(-len(rows) // pool.num_actors)))
        rows = store_dataset(rows, rows_per_block=per_call)
    elif isinstance(rows, tuple):  # in-memory lists: one block per call, and a small corpus still feeds every actor
        ids, texts = rows
        per_call = max(1, min(per_call, -(-len(ids) // pool.num_actors)))
        rows = rows_dataset(ids, texts, rows_per_block=per_call)
    out = Path(out_dir).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ctx = DataContext.get_current()
    saved = ctx.enable_progress_bars, ctx.execution_options.preserve_order
    ctx.enable_progress_bars, ctx.execution_options.preserve_order = progress, preserve_order
    start = time.perf_counter()
    try:
        ds = encode_stage(
            rows,
            weights_ref,
            retriever,
            index,
            pool,
            per_call,
            max_length=max_length,
            vector_dtype=vector_dtype,
            fault=fault,
            stats_dir=stats_dir,
            num_gpus_per_actor=num_gpus_per_actor,
            num_threads=num_threads,
        )
        # The write tasks ask for a quarter of the reserve: with 1 CPU each they could never start beside an actor
        # pool that holds all but IO_CPU_RESERVE of a small cluster (the stream would stall)
        # max_rows_per_file: without it Ray Data may gather every block into one file (seen: 20k rows, 1 file),
        # and then one write task holds all vectors and the index is built from a single "shard"
        ds.write_parquet(str(out), max_rows_per_file=VECTOR_FILE_ROWS, ray_remote_args={"num_cpus": IO_CPU_RESERVE / 2})
    finally:
        ctx.enable_progress_bars, ctx.execution_options.preserve_order = saved
    return seal_vectors(out, vector_dtype, time.perf_counter() - start)


def seal_vectors(out: Path, vector_dtype: str, seconds: float) -> VectorSet:
    """The parquet files Ray Data wrote in `out` as a VectorSet: counted from their metadata (not read), and
    `shards.json` written last, so a folder without it is an unfinished encode."""
    import pyarrow.parquet as pq  # lazy: pyarrow loads a native library; this module imports without it

    files = sorted(p.name for p in out.glob("*.parquet"))
    n, dim = 0, 0
    for f in files:
        md = pq.read_metadata(out / f)
        n += md.num_rows
        if not dim and md.num_rows:
            dim = int(pq.read_schema(out / f).field("vector").type.list_size)
    if n == 0:
        raise ValueError("encode_to_vectors: the dataset had no rows to encode")
    return VectorSet(str(out), files, n, dim, vector_dtype, seconds).save_meta()
