"""The index host: a RemoteIndex answers exactly as the same index in-process, saves, serialises and frees."""

from __future__ import annotations

import numpy as np
import pytest

from ragtrain.config import IndexConfig
from ragtrain.index.faiss_index import DenseIndex, load_index
from ragtrain.index.shards import build_configured_from_shards
from tests.index.test_shards import _vectors, _write_shards


@pytest.fixture(scope="module")
def host(ray_session):
    import ray

    from ragtrain.index.host import IndexHost

    actor = IndexHost.remote()
    yield actor
    ray.kill(actor)


def test_remote_index_equals_the_in_process_one(host, tmp_path) -> None:
    import faiss
    import ray

    from ragtrain.index.host import RemoteIndex

    x, ids = _vectors(300), [f"d{i}" for i in range(300)]
    shards = _write_shards(tmp_path / "s", ids, x, per_file=64)
    idx = IndexConfig(factory="IVF4,Flat", nprobe=2)
    local = build_configured_from_shards(shards, idx, "fp", "enc", 3, seed=0)
    remote = RemoteIndex.build(host, "t", shards.folder, idx, "fp", "enc", 3, seed=0)
    assert remote.doc_ids == local.doc_ids and remote.ntotal == 300 and remote.meta.encoder_step == 3
    q = _vectors(12, seed=1)
    for a, b in zip(remote.search(q, 7), local.search(q, 7)):  # nprobe=2 reached the host: same approximate rows
        np.testing.assert_array_equal(a, b)
    assert remote.search_ids(q, 3) == local.search_ids(q, 3)
    remote.set_search_params(nprobe=4, ef_search=16)  # every list probed: exact results
    exact = np.argsort(-(q @ x.T), axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(remote.search(q, 5)[1], exact)
    np.testing.assert_allclose(remote.reconstruct_first(4), x[:4], atol=1e-6)  # through a row map made for the call
    # the serialised index comes as a reference, fetched where it is used
    ref = remote.serialize()
    assert isinstance(ref, ray.ObjectRef) and faiss.deserialize_index(ray.get(ref)).ntotal == 300
    saved = load_index(remote.save(tmp_path / "saved"))  # written by the host, loaded back here
    assert saved.doc_ids == ids and saved.meta.factory == "IVF4,Flat"
    remote.drop()
    with pytest.raises(KeyError):
        remote.search(q, 1)


def test_stored_vectors_come_back_where_the_index_type_keeps_them(tmp_path) -> None:
    from ragtrain.index.host import _Host  # the actor's body, in-process

    x, ids = _vectors(300), [f"d{i}" for i in range(300)]
    shards = _write_shards(tmp_path / "s", ids, x, per_file=100)
    h = _Host()
    h.build("ivfpq", shards.folder, IndexConfig(factory="IVF2,PQ4x4"), "fp", "enc", 0, 0)
    np.testing.assert_allclose(h.reconstruct_first("ivfpq", 3), h.as_stored("ivfpq", x[:3]), atol=1e-5)  # PQ codes
    h.build("flat", shards.folder, IndexConfig(factory="Flat"), "fp", "enc", 0, 0)
    assert isinstance(h.indexes["flat"], DenseIndex)
    np.testing.assert_allclose(h.reconstruct_first("flat", 3), x[:3], atol=1e-6)
    h.build("flat", shards.folder, IndexConfig(factory="HNSW8"), "fp", "enc", 0, 0)  # a rebuild replaces the tag
    assert h.indexes["flat"].meta.factory == "HNSW8" and sorted(h.indexes) == ["flat", "ivfpq"]


@pytest.mark.parametrize("factory", ["Flat", "HNSW8", "IVF4,Flat"])
def test_a_saved_index_loads_into_a_host_and_memory_mapped_with_the_same_answers(host, tmp_path, factory) -> None:
    """The generator stage's path for a saved index: checked memory-mapped in the driver, searched from a host."""
    from ragtrain.index.host import RemoteIndex

    x, ids = _vectors(300), [f"d{i}" for i in range(300)]
    shards = _write_shards(tmp_path / "s", ids, x, per_file=100)
    local = build_configured_from_shards(shards, IndexConfig(factory=factory), "fp", "enc", 0, seed=0)
    folder = local.save(tmp_path / "saved")
    q = _vectors(9, seed=2)
    mapped = load_index(folder, expect_corpus="fp", mmap=True)
    remote = RemoteIndex.load(host, "loaded", folder)
    assert mapped.doc_ids == remote.doc_ids == ids and remote.meta == local.meta == mapped.meta
    for other in (mapped, remote):
        for a, b in zip(other.search(q, 5), local.search(q, 5)):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(mapped.reconstruct_first(3), local.reconstruct_first(3))  # IVF: memory-mapped lists
    np.testing.assert_array_equal(remote.reconstruct_first(3), local.reconstruct_first(3))
    remote.drop()


def test_the_host_goes_to_a_node_with_the_pools_resources() -> None:
    """Not the driver's node (on KubeRay the head, for the driver alone): beside the pool, softly."""
    from ragtrain.config import PoolResources
    from ragtrain.index.host import host_options

    head, gpu, idx = "aa" * 28, "bb" * 28, "cc" * 28  # Ray's node ids are hex
    nodes = [
        {"NodeID": head, "Alive": True, "Resources": {"CPU": 0.0}},
        {"NodeID": gpu, "Alive": True, "Resources": {"CPU": 4.0, "GPU": 1.0}},
        {"NodeID": idx, "Alive": True, "Resources": {"CPU": 4.0, "index_node": 1.0}},
    ]
    opts = host_options(PoolResources(resources={"index_node": 0.5}), nodes)
    assert opts["scheduling_strategy"].node_id == idx and opts["scheduling_strategy"].soft
    assert host_options(PoolResources(), nodes) == {}  # no label: Ray places it
    assert host_options(PoolResources(resources={"index_node": 0.5}), nodes[:2]) == {}  # none alive: anywhere
