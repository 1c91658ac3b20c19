"""FAISS from vector files: equal to the all-at-once build, bad factories refused up front, atomic saves."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ragtrain.corpus.encode import VECTORS_META, VectorSet
from ragtrain.index.faiss_index import DenseIndex, build_index, check_index_config, load_index
from ragtrain.index.vector_files import build_from_vectors, save_atomic

DIM = 16


def _vectors(n: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _write_vectors(folder: Path, ids: list[str], x: np.ndarray, per_file: int, dtype: str = "float32") -> VectorSet:
    """Shards in the layout encode_to_vectors writes (parquet id + fixed_size_list vector, shards.json)."""
    folder.mkdir(parents=True)
    files = []
    for k, s in enumerate(range(0, len(ids), per_file)):
        v = x[s : s + per_file].astype(dtype)
        flat = pa.array(v.reshape(-1), type=pa.from_numpy_dtype(np.dtype(dtype)))
        t = pa.table({"id": ids[s : s + per_file], "vector": pa.FixedSizeListArray.from_arrays(flat, x.shape[1])})
        files.append(f"part-{k:04d}.parquet")
        pq.write_table(t, folder / files[-1])
    meta = {"files": files, "rows": len(ids), "dim": x.shape[1], "dtype": dtype}
    (folder / VECTORS_META).write_text(json.dumps(meta))
    return VectorSet.load(folder)


def test_flat_from_shards_equals_flat_from_all_vectors(tmp_path) -> None:
    x, ids = _vectors(500), [f"d{i}" for i in range(500)]
    shards = _write_vectors(tmp_path / "s", ids, x, per_file=64)  # 8 files, the last one short
    a = build_from_vectors(shards, "Flat", "fp", "enc")
    b = build_index(x, ids, "Flat", "fp", "enc")
    assert a.doc_ids == b.doc_ids and a.index.ntotal == 500
    q = _vectors(20, seed=1)
    sa, ra = a.search(q, 10)
    sb, rb = b.search(q, 10)
    np.testing.assert_array_equal(ra, rb)  # identical ids ...
    np.testing.assert_array_equal(sa, sb)  # ... and scores, bit for bit


def test_ivf_trained_on_the_whole_corpus_equals_the_all_at_once_build(tmp_path) -> None:
    x, ids = _vectors(600, seed=2), [f"d{i}" for i in range(600)]
    shards = _write_vectors(tmp_path / "s", ids, x, per_file=100)
    a = build_from_vectors(shards, "IVF8,Flat", "fp", "enc", seed=3, train_size=600)
    b = build_index(x, ids, "IVF8,Flat", "fp", "enc", seed=3)
    for idx in (a, b):
        idx.set_search_params(nprobe=2)
    q = _vectors(20, seed=4)
    np.testing.assert_array_equal(a.search(q, 5)[1], b.search(q, 5)[1])
    assert a.meta.extra["train_rows"] == 600


def test_ivf_sampled_training_is_seeded_and_finds_the_nearest(tmp_path) -> None:
    x, ids = _vectors(600, seed=5), [f"d{i}" for i in range(600)]
    shards = _write_vectors(tmp_path / "s", ids, x, per_file=128, dtype="float16")
    one = build_from_vectors(shards, "IVF8,Flat", "fp", "enc", seed=7, train_size=200)
    two = build_from_vectors(shards, "IVF8,Flat", "fp", "enc", seed=7, train_size=200)
    one.set_search_params(nprobe=8), two.set_search_params(nprobe=8)  # all lists: exact search
    q = x[:10]
    r1, r2 = one.search(q, 1)[1], two.search(q, 1)[1]
    np.testing.assert_array_equal(r1, r2)
    assert [one.doc_ids[r] for r in r1[:, 0]] == ids[:10]  # each stored vector is its own nearest neighbour
    assert one.meta.extra["train_rows"] == 200 and one.meta.extra["vector_dtype"] == "float16"


@pytest.mark.parametrize(
    ("factory", "rows", "match"),
    [
        ("IVF64,Flat,Nonsense", 1000, "not a valid faiss"),
        ("IVF256,Flat", 100, "256 IVF lists"),
        ("PQ4", 100, "needs >= 256 training vectors"),
        ("PQ5", 1000, "not a valid faiss"),
    ],  # PQ5: 5 does not divide 16
)
def test_bad_factories_are_refused_before_any_work(factory, rows, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_index_config(factory, DIM, rows)


def test_duplicate_ids_in_the_shards_are_refused(tmp_path) -> None:
    x = _vectors(20)
    shards = _write_vectors(tmp_path / "s", [f"d{i % 10}" for i in range(20)], x, per_file=10)
    with pytest.raises(ValueError, match="10 duplicate passage ids"):
        build_from_vectors(shards, "Flat", "fp", "enc")


def test_save_goes_through_a_temporary_folder(tmp_path, monkeypatch) -> None:
    x, ids = _vectors(50), [f"d{i}" for i in range(50)]
    first = build_index(x, ids, "Flat", "one", "enc")
    save_atomic(first, tmp_path / "index")
    assert load_index(tmp_path / "index").meta.corpus_fingerprint == "one"
    second = build_index(x, ids, "Flat", "two", "enc")
    save_atomic(second, tmp_path / "index")  # replaces the old index
    assert load_index(tmp_path / "index").meta.corpus_fingerprint == "two"

    def broken_save(self, folder):
        Path(folder).mkdir(parents=True)
        (Path(folder) / "index.faiss").write_text("half written")
        raise OSError("disk full")

    monkeypatch.setattr(DenseIndex, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_atomic(build_index(x, ids, "Flat", "three", "enc"), tmp_path / "index")
    assert load_index(tmp_path / "index").meta.corpus_fingerprint == "two"  # the old index is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]  # no temporary folder left behind


def test_vectors_of_reads_only_the_wanted_rows_in_the_asked_order(tmp_path) -> None:
    x, ids = _vectors(50), [f"d{i}" for i in range(50)]
    shards = _write_vectors(tmp_path / "s", ids, x, per_file=16)
    np.testing.assert_array_equal(shards.vectors_of(["d40", "d3", "d17"]), x[[40, 3, 17]])
    with pytest.raises(ValueError, match="1 of 2 wanted ids are not in the files"):
        shards.vectors_of(["d1", "nope"])
