"""The encoded-corpus cache (index.cache_dir): what its key covers, and a second build that encodes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ragtrain.config.index import IndexConfig
from ragtrain.config.retriever import RetrieverConfig
from ragtrain.corpus.encode import VECTORS_META, VectorSet
from ragtrain.index import vector_cache


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 3, generator=g), "a.bias": torch.zeros(4), "pos": torch.arange(5)}


def test_key_covers_weights_settings_and_corpus():
    r, i = RetrieverConfig(model="tiny"), IndexConfig(precision="fp32")
    base = vector_cache.cache_key(_weights(), r, i, "corpus-a", 128)
    assert base == vector_cache.cache_key(_weights(), r, i, "corpus-a", 128)  # deterministic
    changed = {
        "weights": vector_cache.cache_key(_weights(1), r, i, "corpus-a", 128),
        "one element": vector_cache.cache_key(
            {**_weights(), "a.bias": torch.tensor([0, 0, 0, 1e-7])}, r, i, "corpus-a", 128
        ),
        "corpus": vector_cache.cache_key(_weights(), r, i, "corpus-b", 128),
        "max_length": vector_cache.cache_key(_weights(), r, i, "corpus-a", 256),
        "precision": vector_cache.cache_key(_weights(), r, IndexConfig(precision="bf16"), "corpus-a", 128),
        "vector dtype": vector_cache.cache_key(
            _weights(), r, IndexConfig(precision="fp32", vector_dtype="float16"), "corpus-a", 128
        ),
        "pooling": vector_cache.cache_key(_weights(), RetrieverConfig(model="tiny", pooling="cls"), i, "corpus-a", 128),
        "prefix": vector_cache.cache_key(
            _weights(), RetrieverConfig(model="tiny", passage_prefix="passage: "), i, "corpus-a", 128
        ),
    }
    for what, key in changed.items():
        assert key != base, what
    # training-only settings never reach the vectors: the zero-shot encode of every sweep trial shares one entry
    trained = RetrieverConfig(model="tiny", temperature=0.02)
    trained.train.lr = 1e-3
    trained.train.hard_negatives = 3
    assert vector_cache.cache_key(_weights(), trained, i, "corpus-a", 128) == base


def test_key_holds_the_resolved_precision_not_auto():
    """index.precision=auto is keyed as what it runs in on this CPU: an auto run and an explicit run of the same
    precision share the entry; a machine where auto means the other precision misses it (other vectors)."""
    from ragtrain.embed.precision import cpu_bf16_native

    r = RetrieverConfig(model="tiny")
    here, other = ("bf16", "fp32") if cpu_bf16_native() else ("fp32", "bf16")
    auto = vector_cache.cache_key(_weights(), r, IndexConfig(precision="auto"), "corpus-a", 128)
    assert auto == vector_cache.cache_key(_weights(), r, IndexConfig(precision=here), "corpus-a", 128)
    assert auto != vector_cache.cache_key(_weights(), r, IndexConfig(precision=other), "corpus-a", 128)


def _shards(folder, rows: int = 3) -> VectorSet:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    vec = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    table = pa.table(
        {"id": [f"d{i}" for i in range(rows)], "vector": pa.FixedSizeListArray.from_arrays(pa.array(vec.ravel()), 2)}
    )
    pq.write_table(table, folder / "part-0.parquet")
    s = VectorSet(str(folder), ["part-0.parquet"], rows, 2, "float32", 1.5)
    meta = {k: v for k, v in s.__dict__.items() if k != "folder"}
    (folder / VECTORS_META).write_text(json.dumps(meta))
    return s


def test_store_then_lookup_copies_into_the_run_folder(tmp_path):
    cache, key = tmp_path / "cache", "k" * 32
    assert vector_cache.lookup(cache, key, tmp_path / "run1") is None  # a miss on an empty cache
    src = _shards(tmp_path / "encoded")
    vector_cache.store(cache, key, src)
    got = vector_cache.lookup(cache, key, tmp_path / "run2" / "vectors")
    assert got is not None and got.stats["cache_hit"] == 1.0 and got.seconds == 0.0
    assert got.folder == str((tmp_path / "run2" / "vectors").resolve())
    ids, vecs = got.read_all()
    assert ids == ["d0", "d1", "d2"] and np.array_equal(vecs, np.arange(6, dtype=np.float32).reshape(3, 2))
    # the run's copy is its own: removing it leaves the cache entry whole
    import shutil

    shutil.rmtree(got.folder)
    assert vector_cache.lookup(cache, key, tmp_path / "run3") is not None


def test_a_store_that_cannot_rename_says_so_and_leaves_no_temporary(tmp_path, monkeypatch, capsys):
    """The cache is an optimisation: a failed rename (not a concurrent writer's) warns, and the run goes on."""
    cache, key = tmp_path / "cache", "w" * 32
    src = _shards(tmp_path / "encoded")

    def cross_device(self, target):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(Path, "rename", cross_device)
    vector_cache.store(cache, key, src)
    monkeypatch.undo()
    assert f"could not store the encoded corpus as {cache / key}" in capsys.readouterr().out
    assert list(cache.iterdir()) == []  # neither an entry nor the temporary copy


def test_unfinished_entry_is_a_miss(tmp_path):
    cache, key = tmp_path / "cache", "u" * 32
    (cache / key).mkdir(parents=True)  # a folder without shards.json: a writer died before the rename
    assert vector_cache.lookup(cache, key, tmp_path / "run") is None


def test_cache_dir_is_resolved_on_the_driver(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert IndexConfig(cache_dir="cache/vectors").cache_dir == str(tmp_path / "cache" / "vectors")
    assert IndexConfig().cache_dir is None


def test_build_reads_a_cached_corpus_instead_of_encoding(ray_session, tmp_path):
    """Retrieval.build with the entry of these weights in index.cache_dir: nothing is encoded, the index is the same."""
    from ragtrain.config import to_typed
    from ragtrain.corpus.load import load_data
    from ragtrain.embed.encoders import QueryEncoder
    from ragtrain.embed.model import build_encoder
    from ragtrain.pipeline.retrieval import Retrieval
    from tests.conftest import compose, tiny_overrides
    from tests.index.test_vector_files import _write_vectors

    cache = tmp_path / "cache"
    cfg = to_typed(compose(tiny_overrides(tmp_path) + [f"index.cache_dir={cache}"]))
    data = load_data(cfg.data)
    torch.manual_seed(cfg.seed)
    weights = {k: v.detach().clone() for k, v in build_encoder(cfg.retriever).state_dict().items()}
    retrieval = Retrieval(cfg, data)
    try:
        vecs = QueryEncoder(cfg.retriever, [weights]).encode(list(retrieval.passages()), role="passage")
        key = vector_cache.cache_key(
            weights, cfg.retriever, cfg.index, retrieval.fingerprint, cfg.retriever.passage_max_length
        )
        vector_cache.store(cache, key, _write_vectors(tmp_path / "encoded", retrieval.doc_ids, vecs, per_file=64))
        built = retrieval.build("zeroshot", [weights], "tiny@init", 0)
        assert built.stats["encode_cache_hit"] == 1.0 and "docs_per_s" not in built.stats
        assert Path(built.shards.folder) == Path(cfg.output_dir).resolve() / "vectors" / "zeroshot"
        q = vecs[:5]
        np.testing.assert_array_equal(built.index.search(q, 3)[1], np.argsort(-(q @ vecs.T), axis=1)[:, :3])
        metrics = retrieval.evaluate(built)
        assert 0.0 <= metrics["ndcg@10"] <= 1.0
        # Evaluation reads the index in the shard actor: the driver's build holds ids and snapshots, no vector
        # matrix and no FAISS index, and once the shard forgets the build the same evaluation cannot run
        from ragtrain.index.sharded import ShardedIndex

        assert isinstance(built.index, ShardedIndex)
        held = [v for obj in (built, built.index, retrieval) for v in vars(obj).values()]
        assert not any(isinstance(v, np.ndarray) and v.size >= vecs.size for v in held)
        assert not any(type(v).__module__.startswith("faiss") for v in held)
        built.index.drop()
        with pytest.raises(Exception, match="zeroshot"):
            retrieval.evaluate(built)
    finally:
        retrieval.close()
