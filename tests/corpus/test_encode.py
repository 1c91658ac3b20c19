"""Corpus encoding on real Ray Data: shards hold every passage once, equal to in-process encoding; a killed encode
actor is retried by Ray Data and every passage still lands exactly once in the shards and in the index."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ragtrain.config.index import IndexConfig
from ragtrain.config.resources import PoolResources
from ragtrain.config.retriever import RetrieverConfig
from ragtrain.corpus.encode import VectorSet, encode_to_vectors
from ragtrain.embed.encoders import EncodeFault, QueryEncoder

MAX_LENGTH = 32
CFG = RetrieverConfig(model="tiny")
POOL = PoolResources(num_actors=2, cpus_per_actor=1)  # 2 of the session's 4 logical CPUs: reads/writes keep 2
WORDS = "alpha beta gamma delta river mountain archive protein lattice quantum harbor violet ledger orbit".split()


def _corpus(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = np.random.default_rng(seed)
    ids = [f"p{i:04d}" for i in range(n)]
    texts = [f"doc {i} " + " ".join(rng.choice(WORDS, size=int(rng.integers(1, 40))).tolist()) for i in range(n)]
    return ids, texts


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    from ragtrain.embed.model import build_encoder

    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in build_encoder(CFG).state_dict().items()}


def _local(weights, texts: list[str], index: IndexConfig) -> np.ndarray:
    return QueryEncoder(CFG, [weights], index.batch_size, index.precision.value).encode(texts, MAX_LENGTH, "passage")


@pytest.mark.slow(reason="~24 s; by default an actor dies in the corpus stream instead (tests/corpus/test_stream.py")
def test_killed_encode_actor_every_passage_exactly_once_equal_to_in_process(ray_session, tmp_path, weights) -> None:
    """An encode actor dies (os._exit) on its second batch; Ray Data restarts it and retries the batch. The input is
    a PassageStore read by Ray Data's tasks (what every run encodes); the shards equal in-process encoding."""
    from ragtrain.data import Passage
    from ragtrain.data.store import write_store
    from ragtrain.index.vector_files import build_from_vectors

    ids, texts = _corpus(96, seed=2)
    store = write_store(tmp_path / "passages.arrow", (Passage(i, "", t) for i, t in zip(ids, texts)))
    index = IndexConfig(batch_size=8, shard_size=8)  # 12 batches over 2 actors: the death is mid-pipeline
    marker = tmp_path / "killed"
    shards = encode_to_vectors(
        store,
        ray_session.put(weights),
        CFG,
        index,
        POOL,
        tmp_path / "k",
        max_length=MAX_LENGTH,
        fault=EncodeFault(at_batch=1, marker=str(marker)),
    )
    assert marker.exists(), "the injected actor death never fired"
    assert shards.rows == 96 and shards.dim == CFG.tiny.hidden_size and len(shards.files) >= 1
    got = shards.ids()
    # every passage exactly once in the shards (the retried batch lands after the others: the index names its rows)
    assert len(got) == len(ids) and sorted(got) == ids
    built = build_from_vectors(shards, "Flat", "fp", "tiny")
    assert built.index.ntotal == len(ids) and sorted(built.doc_ids) == sorted(ids)  # ... and in the index
    _, vecs = shards.read_all(order=ids)
    np.testing.assert_allclose(vecs, _local(weights, texts, index), atol=1e-5)
    again = VectorSet.load(tmp_path / "k")  # shards.json describes the folder
    assert (again.rows, again.dim, again.files) == (shards.rows, shards.dim, shards.files)


def test_encode_batch_writes_float16_vectors_when_asked(weights) -> None:
    """The actor's callable in-process: rows in, an Arrow table of (id, float16 vector) out, in input order."""
    from ragtrain.embed.encoders import EncodeBatch

    ids, texts = _corpus(10, seed=3)
    table = EncodeBatch(CFG, weights, MAX_LENGTH, batch_size=4, vector_dtype="float16")(
        {"id": np.array(ids, dtype=object), "text": np.array(texts, dtype=object)}
    )
    assert table.column("id").to_pylist() == ids
    vecs = np.stack(table.column("vector").to_numpy(zero_copy_only=False))
    assert vecs.dtype == np.float16
    np.testing.assert_allclose(vecs, _local(weights, texts, IndexConfig(batch_size=4)), atol=2e-3)  # fp16 rounding


def test_empty_dataset_is_refused(ray_session, tmp_path, weights) -> None:
    with pytest.raises(ValueError, match="no rows"):
        encode_to_vectors(([], []), ray_session.put(weights), CFG, IndexConfig(), POOL, tmp_path / "e")


@pytest.mark.parametrize(("factory", "match"), [("IVF4096,Flat", "4096 IVF lists"), ("IVF8,Nope", "not a valid faiss")])
def test_pipeline_refuses_a_bad_index_before_encoding(tmp_path, factory, match) -> None:
    """Retrieval.build checks the factory against the encoder's dim and the corpus size before any encode."""
    from ragtrain.config import to_typed
    from ragtrain.corpus.load import load_data
    from ragtrain.pipeline.retrieval import Retrieval
    from tests.conftest import compose, tiny_overrides

    cfg = to_typed(compose(tiny_overrides(tmp_path) + [f"index.factory='{factory}'"]))
    data = load_data(cfg.data)
    with pytest.raises(ValueError, match=match):
        Retrieval(cfg, data).build("zeroshot", [{}], "tiny@init", 0)  # no Ray, no weights needed: it fails first
    assert not (tmp_path / "out" / "vectors").exists()


@pytest.mark.slow(reason="the retry of the killed-actor test above, through a pipeline run")
def test_pipeline_index_stage_survives_an_encode_actor_death(ray_session, tmp_path) -> None:
    """stages=[index] through pipeline.run with fault.kill_encode_actor_at_batch: the saved index holds every passage
    once, built from the shards under <output_dir>/vectors/zeroshot."""
    from ragtrain.config import to_typed
    from ragtrain.corpus.load import load_data
    from ragtrain.index.sharded import open_saved
    from ragtrain.pipeline.stages import run
    from tests.conftest import compose, tiny_overrides

    over = tiny_overrides(tmp_path) + [
        "stages=[index]",
        "logger=none",
        "index.shard_size=16",
        "fault.kill_encode_actor_at_batch=1",
    ]
    cfg = to_typed(compose(over))
    results = run(cfg)
    out = tmp_path / "out"
    assert (out / "vectors" / ".encode_actor_killed").exists(), "the injected actor death never fired"
    index = open_saved(out / "index")
    corpus = list(load_data(cfg.data).corpus)
    assert sorted(index.doc_ids) == sorted(corpus) and index.ntotal == len(corpus)
    assert (out / "vectors" / "zeroshot" / "shards.json").exists()
    assert results["zeroshot"]["ndcg@10"] >= 0.0
    assert not list(out.glob("index.tmp-*"))  # the temporary folder was renamed


def test_a_build_that_runs_alone_gives_the_pools_actors_every_free_cpu(ray_session) -> None:
    """A 1-actor pool of 1 CPU on a one-node cluster: the build's actor runs a thread per free CPU (a laptop's
    zero-shot and trained indexes use every core); with GPUs, or more actors than CPUs, it keeps its own share."""
    import os

    import ray

    from ragtrain.config.resources import PoolResources
    from ragtrain.corpus.encode import build_threads

    free = int(min(ray.available_resources()["CPU"], len(os.sched_getaffinity(0))))  # logical CPUs, up to the cores
    assert build_threads(PoolResources(num_actors=1, cpus_per_actor=1)) == max(1, free)
    assert build_threads(PoolResources(num_actors=2, cpus_per_actor=1)) == max(1, free // 2)
    assert build_threads(PoolResources(num_actors=1, cpus_per_actor=1, gpus_per_actor=1)) == 1
    assert build_threads(PoolResources(num_actors=4 * free, cpus_per_actor=1)) == 1


def test_vector_files_written_out_of_place_are_put_in_corpus_order(tmp_path) -> None:
    """Ray Data names a write's files by when its write tasks started, and a task may take two blocks that are not
    neighbours (seen on SQuAD: the first file held rows 512-1023, the last rows 2048-2066 then 512-1023): the index
    numbers rows as the corpus does, so files are split at their breaks and ordered; a set that is not the corpus
    once each is refused."""
    from ragtrain.corpus.encode import VectorSet, write_vectors

    ids = [f"d{i}" for i in range(9)]
    vecs = np.arange(18, dtype=np.float32).reshape(9, 2)
    rows = [[3, 4, 5], [6, 7, 8, 0, 1, 2]]  # 3-5 first in name order, then one file of two blocks: 6-8 and 0-2
    shards = write_vectors(tmp_path / "v", [([ids[i] for i in r], vecs[r]) for r in rows])
    assert shards.ids() == [ids[i] for r in rows for i in r]
    assert shards.in_order(ids).ids() == ids
    got_ids, got = VectorSet.load(tmp_path / "v").read_all()  # shards.json rewritten: a later load sees the order
    assert got_ids == ids
    np.testing.assert_array_equal(got, vecs)
    assert len(list((tmp_path / "v").glob("*.parquet"))) == 3  # the mixed file split in two, the original removed
    with pytest.raises(ValueError, match="9 rows, the corpus 10 passages"):
        VectorSet.load(tmp_path / "v").in_order(ids + ["d9"])
    with pytest.raises(ValueError, match="not passages of the corpus"):
        VectorSet.load(tmp_path / "v").in_order(ids[1:])
