"""index.device=cuda: index shards that search on their GPU return what the CPU shards return. Skipped cleanly
without a CUDA GPU or without a FAISS built with GPU support (faiss-cpu; the `gpu` extra installs faiss-gpu);
run by benchmarks/gpu_smoke.sh."""

from __future__ import annotations

import faiss
import numpy as np
import pytest
import torch

from ragtrain.config.index import IndexConfig
from ragtrain.config.resources import PoolResources
from ragtrain.index.faiss_index import check_index_device, faiss_gpu_support
from ragtrain.index.sharded import ShardGroup, read_sharded
from ragtrain.runtime.errors import ConfigError
from tests.index.test_vector_files import _vectors, _write_vectors

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        not faiss_gpu_support() or faiss.get_num_gpus() == 0,
        reason="needs FAISS with GPU support that sees a GPU (pip install -e .[gpu])",
    ),
]

ROWS = 400


def test_the_installed_faiss_searches_on_this_gpu() -> None:
    """The run's own check, for real: FAISS's kernels run on this GPU (a build without code for it, such as
    faiss-gpu-cu12 on an H100, aborts at its first search: the check says so in one line instead)."""
    check_index_device("cuda", "Flat", 64)


@pytest.fixture(scope="module")
def setup(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faiss_gpu")
    x = _vectors(ROWS)
    vecs = _write_vectors(tmp / "vec", [f"d{i}" for i in range(ROWS)], x, per_file=64)
    pool = PoolResources(num_actors=1)
    cpu = ShardGroup(2, tmp / "cpu", pool, timeout_s=60.0)
    gpu = ShardGroup(2, tmp / "gpu", pool, timeout_s=60.0, gpu=0.5)  # two shards share one GPU
    yield x, vecs, cpu, gpu, tmp
    cpu.close()
    gpu.close()


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat"])
def test_two_gpu_shards_return_what_the_cpu_shards_return(setup, factory) -> None:
    x, vecs, cpu, gpu, tmp = setup
    idx = IndexConfig(factory=factory, nprobe=3)
    want = cpu.build("t", vecs, idx, "fp", "enc", 2, seed=0)
    got = gpu.build("t", vecs, idx, "fp", "enc", 2, seed=0)
    q = _vectors(30, seed=5)
    want_scores, want_rows = want.search(q, 10)
    scores, rows = got.search(q, 10)
    np.testing.assert_array_equal(rows, want_rows, err_msg=factory)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5, err_msg=factory)
    assert got.search_ids(q[:2], 3) == want.search_ids(q[:2], 3)
    # the searches ran on the GPU copies; the saved folder is the CPU build (FAISS writes only CPU indexes)
    assert all("t" in i["on_gpu"] for i in gpu.info()) and not any(i["on_gpu"] for i in cpu.info())
    saved = got.save(tmp / f"saved-{factory.replace(',', '_')}")
    assert len(read_sharded(saved)) == 2
    reloaded = gpu.load("reloaded", saved)  # loaded back onto the GPU
    np.testing.assert_array_equal(reloaded.search(q, 10)[1], want_rows)


def test_a_factory_faiss_cannot_put_on_a_gpu_names_index_factory(setup) -> None:
    _, vecs, _, gpu, tmp = setup
    with pytest.raises(ConfigError, match=r"index.factory='HNSW8' cannot run on a GPU \(index.device=cuda\)"):
        gpu.build("hnsw", vecs, IndexConfig(factory="HNSW8"), "fp", "enc", 2, seed=0)
    assert not list((tmp / "gpu").glob("hnsw/shard-*/manifest.json"))  # refused before it was persisted
