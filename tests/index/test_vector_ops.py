"""Shard-by-shard transforms equal their whole-matrix versions (consensus, alignment map, drift)."""

from __future__ import annotations

import numpy as np
import pytest

from ragtrain.embed.align import embedding_drift, fit_alignment
from ragtrain.embed.encoders import consensus_vectors
from ragtrain.index import vector_ops
from tests.index.test_vector_files import _vectors, _write_vectors


def test_write_then_read_round_trips(tmp_path):
    x, ids = _vectors(130), [f"d{i}" for i in range(130)]
    s = vector_ops.write_vectors(tmp_path / "w", [(ids[:100], x[:100]), (ids[100:], x[100:])], "float16")
    assert s.rows == 130 and s.dim == x.shape[1] and len(s.files) == 2 and s.dtype == "float16"
    got_ids, got = s.read_all()
    assert got_ids == ids and np.allclose(got, x, atol=1e-3)
    with pytest.raises(ValueError, match="no rows"):
        vector_ops.write_vectors(tmp_path / "empty", [])


@pytest.mark.parametrize("other_files", [64, 50])  # the same file layout, and another one (looked up by id)
def test_mean_shards_is_the_consensus_of_the_whole_matrices(tmp_path, other_files):
    ids = [f"d{i}" for i in range(200)]
    a, b, c = _vectors(200, seed=1), _vectors(200, seed=2), _vectors(200, seed=3)
    sets = [
        _write_vectors(tmp_path / "a", ids, a, per_file=64),
        _write_vectors(tmp_path / "b", ids, b, per_file=64),
        _write_vectors(tmp_path / "c", ids, c, per_file=other_files),
    ]
    got = vector_ops.mean_vectors(sets, tmp_path / "mean")
    got_ids, vec = got.read_all()
    assert got_ids == ids and len(got.files) == 4  # replica 0's layout
    np.testing.assert_allclose(vec, consensus_vectors([a, b, c]), atol=1e-6)


def test_mean_shards_refuses_replicas_of_different_corpora(tmp_path):
    a = _write_vectors(tmp_path / "a", ["x", "y"], _vectors(2), per_file=2)
    b = _write_vectors(tmp_path / "b", ["x"], _vectors(1), per_file=1)
    with pytest.raises(ValueError, match="must match"):
        vector_ops.mean_vectors([a, b], tmp_path / "m")


def test_map_shards_applies_the_alignment_row_for_row(tmp_path):
    ids = [f"d{i}" for i in range(150)]
    old, new = _vectors(150, seed=4), _vectors(150, seed=5)
    align = fit_alignment(old[:40], new[:40], "orthogonal")
    mapped = vector_ops.map_vectors(
        _write_vectors(tmp_path / "old", ids, old, per_file=32), align.apply, tmp_path / "m"
    )
    got_ids, vec = mapped.read_all()
    assert got_ids == ids and mapped.files and len(mapped.files) == 5
    np.testing.assert_allclose(vec, align.apply(old), atol=1e-6)


def test_drift_on_a_sample_and_on_every_row(tmp_path):
    ids = [f"d{i}" for i in range(300)]
    a, b = _vectors(300, seed=6), _vectors(300, seed=7)
    sa, sb = _write_vectors(tmp_path / "a", ids, a, per_file=70), _write_vectors(tmp_path / "b", ids, b, per_file=90)
    every = vector_ops.sample_ids(ids, 10_000, seed=0)  # more than there are: all of them, each once
    assert sorted(every) == sorted(ids)
    assert vector_ops.drift(sa, sb, every) == pytest.approx(embedding_drift(a, b), abs=1e-6)
    some = vector_ops.sample_ids(ids, 50, seed=0)
    assert len(set(some)) == 50 and some == vector_ops.sample_ids(ids, 50, seed=0)  # seeded
    rows = [ids.index(d) for d in some]
    assert vector_ops.drift(sa, sb, some) == pytest.approx(embedding_drift(a[rows], b[rows]), abs=1e-6)
