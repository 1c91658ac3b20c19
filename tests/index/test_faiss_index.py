"""Tests for the FAISS index wrapper: factories, recall vs exact search, save/load checks, errors, determinism."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import faiss
import numpy as np
import pytest

from ragtrain.index.faiss_index import (
    IDS_FILE,
    INDEX_FILE,
    META_FILE,
    METRIC,
    DenseIndex,
    IndexMismatchError,
    build_index,
    load_index,
)

N, DIM, NQ, K = 2000, 32, 200, 10
# PQ factories are tested with the "np" suffix (same IndexPQ / IndexIVFPQ, same codes, no polysemous code reordering):
# faiss's index_factory turns on polysemous training for "PQ8", which costs ~13 CPU-seconds per build whatever the
# corpus size. The literal "PQ8" / "IVF16,PQ8" strings are covered by the `slow` test at the end.
PQ, IVFPQ = "PQ8np", "IVF16,PQ8np"
BUILD_KW = dict(encoder="tiny@step7", encoder_step=7, precision="bf16", seed=3)
FINGERPRINT = "corpusfp-aaaaaaaaaaaaaaaaaaaa"
OTHER_FINGERPRINT = "othercorpus-bbbbbbbbbbbbbbbb"


@pytest.fixture(scope="module", autouse=True)
def _single_thread_faiss():
    """One OpenMP thread: faiss's k-means spins badly when the 2 cores are shared with Ray workers."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


def _unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def corpus() -> tuple[np.ndarray, list[str], np.ndarray]:
    rng = np.random.default_rng(1234)
    return _unit(rng, N), [f"doc-{i:05d}" for i in range(N)], _unit(rng, NQ)


@pytest.fixture(scope="module")
def exact(corpus) -> np.ndarray:
    """Exact top-K row positions by brute-force inner product (numpy)."""
    x, _, q = corpus
    return np.argsort(-(q @ x.T), axis=1, kind="stable")[:, :K]


def _build(corpus, factory: str, **kw) -> DenseIndex:
    x, ids, _ = corpus
    return build_index(x, ids, factory, FINGERPRINT, **{**BUILD_KW, **kw})


@pytest.fixture(scope="module")
def built(corpus):
    """Indexes built once per module (BUILD_KW), by factory; callers set search params before searching."""
    cache: dict[str, DenseIndex] = {}

    def get(factory: str) -> DenseIndex:
        if factory not in cache:
            cache[factory] = _build(corpus, factory)
        return cache[factory]

    return get


def _recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth)]))


# ---------------------------------------------------------------------------------------------------- building


def test_flat_search_equals_numpy_inner_product(corpus, exact) -> None:
    x, ids, q = corpus
    idx = _build(corpus, "Flat")
    scores, pos = idx.search(q, K)
    assert pos.shape == scores.shape == (NQ, K)
    np.testing.assert_array_equal(pos, exact)
    np.testing.assert_allclose(scores, np.take_along_axis(q @ x.T, exact, axis=1), rtol=0, atol=1e-5)
    # Scores come back best first.
    assert np.all(np.diff(scores, axis=1) <= 1e-6)
    # Row positions map to the doc ids given at build time.
    assert [idx.doc_ids[p] for p in pos[0]] == [ids[p] for p in exact[0]]


@pytest.mark.parametrize(
    "factory, trained_type",
    [
        ("Flat", faiss.IndexFlat),
        pytest.param("IVF16,Flat", faiss.IndexIVFFlat),
        ("HNSW16", faiss.IndexHNSWFlat),
        pytest.param(IVFPQ, faiss.IndexIVFPQ),
        pytest.param(PQ, faiss.IndexPQ),
    ],
)
def test_build_metadata_and_training(corpus, built, factory: str, trained_type: type) -> None:
    _, ids, _ = corpus
    idx = built(factory)
    assert isinstance(idx.index, trained_type)
    assert idx.index.is_trained
    assert idx.index.ntotal == N
    assert idx.index.metric_type == faiss.METRIC_INNER_PRODUCT
    assert idx.doc_ids == ids and idx.doc_ids is not ids  # a copy: later edits of the caller's list don't leak in
    m = idx.meta
    assert (m.factory, m.dim, m.metric, m.ntotal) == (factory, DIM, METRIC, N)
    assert (m.corpus_fingerprint, m.encoder, m.encoder_step, m.precision) == (FINGERPRINT, "tiny@step7", 7, "bf16")
    assert m.version == 0 and m.extra == {}
    assert m.build_seconds >= 0


def test_untrained_factories_really_need_training() -> None:
    """Guards the test above: IVF and PQ start untrained, so `is_trained` after build means build_index trained them."""
    for factory in ("IVF16,Flat", IVFPQ, PQ):
        assert not faiss.index_factory(DIM, factory, faiss.METRIC_INNER_PRODUCT).is_trained, factory


@pytest.mark.parametrize(
    "factory, floor",
    [
        pytest.param("IVF16,Flat", 0.9),
        ("HNSW16", 0.9),
        pytest.param(IVFPQ, 0.5),
        pytest.param(PQ, 0.5),
    ],
)
def test_approximate_recall_vs_flat(corpus, exact, built, factory: str, floor: float) -> None:
    _, _, q = corpus
    flat_pos = built("Flat").search(q, K)[1]
    np.testing.assert_array_equal(flat_pos, exact)
    idx = built(factory)
    idx.set_search_params(nprobe=16, ef_search=128)
    recall = _recall(idx.search(q, K)[1], flat_pos)
    assert recall >= floor, f"{factory}: recall@{K} {recall:.3f} < {floor}"


def test_set_search_params_sets_hnsw_ef_and_ignores_missing_knobs(built) -> None:
    hnsw = built("HNSW16")
    hnsw.set_search_params(nprobe=3, ef_search=77)  # HNSW has no nprobe: silently skipped
    assert hnsw.index.hnsw.efSearch == 77
    built("Flat").set_search_params(nprobe=16, ef_search=128)  # Flat has neither: no error


def test_set_search_params_sets_ivf_nprobe(corpus, exact, built) -> None:
    _, _, q = corpus
    idx = built("IVF16,Flat")
    idx.set_search_params(nprobe=1)
    assert faiss.extract_index_ivf(idx.index).nprobe == 1
    low = _recall(idx.search(q, K)[1], exact)
    idx.set_search_params(nprobe=16)
    assert faiss.extract_index_ivf(idx.index).nprobe == 16
    high = _recall(idx.search(q, K)[1], exact)
    assert low < high == pytest.approx(1.0)  # 16 of 16 lists probed: exhaustive


@pytest.mark.parametrize("factory", ["IVF16,Flat", IVFPQ])
def test_ivf_build_is_deterministic_for_a_seed(corpus, factory: str) -> None:
    _, _, q = corpus

    def build(seed: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        idx = _build(corpus, factory, seed=seed)
        idx.set_search_params(nprobe=1)  # one list probed: results depend on the k-means centroids
        ivf = faiss.extract_index_ivf(idx.index)
        return ivf.quantizer.reconstruct_n(0, ivf.nlist), idx.search(q, K)

    cent_a, (sa, pa) = build(11)
    cent_b, (sb, pb) = build(11)
    cent_c, _ = build(12)
    np.testing.assert_array_equal(cent_a, cent_b)
    np.testing.assert_array_equal(pa, pb)
    np.testing.assert_array_equal(sa, sb)
    assert not np.array_equal(cent_a, cent_c), "the seed does not reach the IVF k-means"


@pytest.mark.parametrize("factory", ["Flat", "HNSW8", "IVF16,Flat", IVFPQ, "IVF16,SQ8", "OPQ8,IVF16,PQ8np"])
def test_stored_vectors_come_back_equal_to_the_vectors_through_the_codec(corpus, built, factory: str) -> None:
    """What the generator's encoder check compares: every index type gives its first rows back (IVF through a row
    map made for the call), equal to the same vectors passed through the index's codec, lossy codes included."""
    x = corpus[0][:8]
    index = built(factory)
    stored = index.reconstruct_first(8)
    np.testing.assert_allclose(stored, index.as_stored(x), atol=1e-5)
    ivf = faiss.try_extract_index_ivf(index.index)
    assert ivf is None or ivf.direct_map.type == faiss.DirectMap.NoMap  # the map was for the call only
    cos = (stored * x).sum(1) / np.linalg.norm(stored, axis=1)
    # PQ codes: far from the raw vectors, so a raw comparison would fail a matching encoder
    assert (cos.min() < 0.99) == ("PQ" in factory), cos.min()


def test_search_clamps_k_to_ntotal(corpus) -> None:
    x, ids, q = corpus
    small = build_index(x[:5], ids[:5], "Flat", FINGERPRINT, "enc")
    scores, pos = small.search(q[:3], 50)
    assert pos.shape == (3, 5)
    assert sorted(pos[0].tolist()) == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------------------------------------- errors


def test_invalid_factory_names_the_config_key(corpus) -> None:
    with pytest.raises(ValueError, match=r"index\.factory") as e:
        _build(corpus, "Foo12")
    assert "Foo12" in str(e.value)


def test_pq_m_not_dividing_dim_is_a_clear_value_error(corpus) -> None:
    with pytest.raises(ValueError, match=r"index\.factory='PQ7'"):
        _build(corpus, "PQ7")


def test_too_many_ivf_lists_names_the_list_count(corpus) -> None:
    with pytest.raises(ValueError, match=r"index\.factory") as e:
        _build(corpus, "IVF4096,Flat")
    assert "4096" in str(e.value) and str(N) in str(e.value)


def test_vectors_and_ids_must_agree(corpus) -> None:
    x, ids, _ = corpus
    with pytest.raises(ValueError, match="doc ids"):
        build_index(x, ids[:-1], "Flat", FINGERPRINT, "enc")


@pytest.mark.parametrize("shape", [(3, DIM + 1), (3, DIM - 1), (DIM,)])
def test_query_with_wrong_dim_raises_mismatch(corpus, shape) -> None:
    idx = _build(corpus, "Flat")
    with pytest.raises(IndexMismatchError, match=f"index dim is {DIM}"):
        idx.search(np.ones(shape, dtype=np.float32), K)


# ---------------------------------------------------------------------------------------------------- save / load


@pytest.fixture
def saved(corpus, tmp_path: Path) -> tuple[DenseIndex, Path]:
    idx = _build(corpus, "Flat")
    idx.meta.version = 4
    folder = idx.save(tmp_path / "idx")
    return idx, folder


def test_save_writes_the_three_files(saved) -> None:
    idx, folder = saved
    assert {p.name for p in folder.iterdir()} == {INDEX_FILE, META_FILE, IDS_FILE}
    meta = json.loads((folder / META_FILE).read_text())
    assert meta["dim"] == DIM and meta["ntotal"] == N and meta["metric"] == METRIC and meta["version"] == 4
    assert (folder / IDS_FILE).read_text(encoding="utf-8").splitlines() == idx.doc_ids


@pytest.mark.parametrize("factory", ["Flat", "HNSW16", pytest.param(IVFPQ)])
def test_round_trip_gives_identical_results(corpus, built, tmp_path: Path, factory: str) -> None:
    _, _, q = corpus
    idx = built(factory)
    idx.set_search_params(nprobe=4, ef_search=64)
    before = idx.search(q, K)
    loaded = load_index(idx.save(tmp_path / "idx"), expect_dim=DIM, expect_corpus=FINGERPRINT)
    loaded.set_search_params(nprobe=4, ef_search=64)
    after = loaded.search(q, K)
    np.testing.assert_array_equal(before[1], after[1])
    np.testing.assert_array_equal(before[0], after[0])
    assert loaded.doc_ids == idx.doc_ids
    assert loaded.meta == idx.meta


def test_load_wrong_dim(saved) -> None:
    _, folder = saved
    with pytest.raises(IndexMismatchError) as e:
        load_index(folder, expect_dim=384)
    msg = str(e.value)
    assert str(folder / META_FILE) in msg and str(DIM) in msg and "384" in msg


def test_load_wrong_corpus(saved) -> None:
    _, folder = saved
    with pytest.raises(IndexMismatchError) as e:
        load_index(folder, expect_corpus=OTHER_FINGERPRINT)
    msg = str(e.value)
    # The message abbreviates fingerprints to their first 12 characters.
    assert str(folder / META_FILE) in msg and FINGERPRINT[:12] in msg and OTHER_FINGERPRINT[:12] in msg


def test_load_wrong_metric(saved) -> None:
    _, folder = saved
    with pytest.raises(IndexMismatchError) as e:
        load_index(folder, expect_metric="l2")
    msg = str(e.value)
    assert str(folder / META_FILE) in msg and repr(METRIC) in msg and "'l2'" in msg


def test_load_matching_expectations_succeeds(saved) -> None:
    idx, folder = saved
    loaded = load_index(folder, expect_dim=DIM, expect_corpus=FINGERPRINT, expect_metric=METRIC)
    assert loaded.meta.version == 4 and loaded.index.ntotal == N


@pytest.mark.parametrize("missing", [INDEX_FILE, META_FILE, IDS_FILE])
def test_missing_file_raises_file_not_found(saved, missing: str) -> None:
    _, folder = saved
    (folder / missing).unlink()
    with pytest.raises(FileNotFoundError) as e:
        load_index(folder)
    assert str(folder / missing) in str(e.value)


def test_missing_folder_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_index(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "content",
    [
        '{"factory": "HNSW16", "dim": 32',  # truncated JSON
        "",  # empty file
        "[1, 2, 3]",  # valid JSON, not an object
        '{"factory": "HNSW16"}',  # missing fields
    ],
)
def test_corrupted_meta_raises_clearly(saved, content: str) -> None:
    _, folder = saved
    (folder / META_FILE).write_text(content)
    with pytest.raises(IndexMismatchError, match="unreadable index metadata") as e:
        load_index(folder)
    assert str(folder / META_FILE) in str(e.value)


def test_meta_with_unknown_field_raises_clearly(saved) -> None:
    _, folder = saved
    meta = json.loads((folder / META_FILE).read_text())
    meta["surprise"] = 1
    (folder / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(IndexMismatchError, match="unreadable index metadata"):
        load_index(folder)


def test_doc_ids_with_a_line_removed_is_corrupt(saved) -> None:
    _, folder = saved
    lines = (folder / IDS_FILE).read_text(encoding="utf-8").splitlines()
    del lines[17]
    (folder / IDS_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(IndexMismatchError, match="corrupt") as e:
        load_index(folder)
    assert f"{N - 1} ids" in str(e.value) and f"ntotal={N}" in str(e.value)


def test_meta_ntotal_disagreeing_with_index_is_corrupt(saved) -> None:
    _, folder = saved
    meta = json.loads((folder / META_FILE).read_text())
    meta["ntotal"] = N + 1
    (folder / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(IndexMismatchError, match="corrupt"):
        load_index(folder)


def test_index_file_swapped_for_other_dim_is_corrupt(saved, corpus) -> None:
    _, folder = saved
    x, ids, _ = corpus
    other = build_index(np.ascontiguousarray(x[:, :16]), ids, "Flat", FINGERPRINT, "enc")
    faiss.write_index(other.index, str(folder / INDEX_FILE))
    with pytest.raises(IndexMismatchError, match="corrupt"):
        load_index(folder)


# ---------------------------------------------------------------------------------------------------- slow


@pytest.mark.slow(reason="PQ training with polysemous codes; the other factories build and search by default above")
@pytest.mark.parametrize("factory", ["IVF16,PQ8", "PQ8"])
def test_literal_pq_factories_with_polysemous_training(corpus, exact, factory: str) -> None:
    """The exact factory strings users write (polysemous training on): trained, full, recall above the floor."""
    _, _, q = corpus
    idx = _build(corpus, factory)
    assert idx.index.is_trained and idx.index.ntotal == N and idx.meta.factory == factory
    idx.set_search_params(nprobe=16)
    assert _recall(idx.search(q, K)[1], exact) >= 0.5


class _FaissBuild:
    """What check_index_device reads of a FAISS build: its GPU API, how many GPUs it sees, and how it copies an
    index to one (the CPU box's faiss has none of it; these stand for the GPU builds on machines without them)."""

    __version__ = "1.12.0"

    class StandardGpuResources:
        temp_memory = True

        def noTempMemory(self) -> None:  # noqa: N802 (FAISS's name)
            self.temp_memory = False

    def __init__(self, gpus: int, convert_error: str | None = None) -> None:
        self.gpus, self.convert_error, self.used = gpus, convert_error, []

    def get_num_gpus(self) -> int:
        return self.gpus

    def index_cpu_to_gpu(self, res, device: int, index):
        self.used.append(res)
        if self.convert_error:
            raise RuntimeError(self.convert_error)
        return index


def test_index_device_cpu_needs_nothing_of_faiss() -> None:
    from ragtrain.index.faiss_index import check_index_device

    check_index_device("cpu", "HNSW32", DIM, lib=object())  # nothing is asked of FAISS


def _probe(*lines: str, stderr: str = "", end: str = "") -> list[str]:
    """A stand-in GPU probe child: prints `lines`, writes `stderr`, then runs `end` (os.abort(), SystemExit(3))."""
    code = f"import os, sys\nfor line in {list(lines)!r}: print(line, flush=True)\n"
    code += f"sys.stderr.write({stderr!r}); sys.stderr.flush()\n{end}"
    return [sys.executable, "-c", code]


H100 = "NVIDIA H100 80GB HBM3, compute capability 9.0"
NO_KERNEL = (
    "Faiss assertion 'err__ == cudaSuccess' failed in void faiss::gpu::runL2Norm(...) at "
    "/project/faiss/faiss/gpu/impl/L2Norm.cu:257; details: CUDA error 209 no kernel image is available for "
    "execution on the device\n"
)


@pytest.mark.parametrize(
    ("lib", "visible", "probe", "match"),
    [
        (SimpleNamespace(__version__="1.15.1"), 1, None,
         r"^index.device=cuda needs FAISS with GPU support, and the installed faiss 1.15.1 is a CPU build: "
         r"install the gpu extra "
         r"\(pip install -e .\[gpu\] && pip uninstall -y faiss-cpu && pip install --force-reinstall --no-deps "
         r"faiss-gpu\) or set index.device=cpu$"),
        (_FaissBuild(gpus=0), 0, None, r"^index.device=cuda, but no CUDA GPU is visible on this machine.*: set "
         r"index.device=cpu$"),
        (_FaissBuild(gpus=0), 2, None, r"^index.device=cuda: faiss 1.12.0 sees no GPU while torch sees 2: faiss-gpu "
         r"needs the CUDA 12 runtime libraries"),
        # a FAISS build without code for the GPU: it sees the GPU, then aborts at its first kernel
        (_FaissBuild(gpus=1), 1, _probe(H100, stderr=NO_KERNEL, end="os.abort()"),
         rf"^index.device=cuda: faiss 1.12.0 cannot search on {H100}: CUDA error 209 no kernel image is available "
         r"for execution on the device; the gpu extra's faiss-gpu>=1.15.1 carries code for compute capability 7.0 "
         r"and later \(pip install .*\), or set index.device=cpu$"),
        (_FaissBuild(gpus=1), 1, _probe(H100, end="os.abort()"),
         rf"^index.device=cuda: faiss 1.12.0 cannot search on {H100}: the probe was killed by SIGABRT; "),
        (_FaissBuild(gpus=1), 1, _probe(H100, "index.factory='HNSW32' cannot run on a GPU (index.device=cuda): x",
                                        end="raise SystemExit(3)"),
         r"^index.factory='HNSW32' cannot run on a GPU \(index.device=cuda\): x$"),
    ],
)  # fmt: skip
def test_index_device_cuda_names_what_is_missing(lib, visible: int, probe, match: str) -> None:
    from ragtrain.index.faiss_index import check_index_device, gpu_resources
    from ragtrain.runtime.errors import ConfigError

    gpu_resources.cache_clear()
    with pytest.raises(ConfigError, match=match) as e:
        check_index_device("cuda", "HNSW32", DIM, lib=lib, visible_gpus=lambda: visible, probe=probe)
    assert "\n" not in str(e.value)
    build = _FaissBuild(gpus=1)
    check_index_device("cuda", "Flat", DIM, lib=build, visible_gpus=lambda: 1, probe=_probe(H100))  # all there
    # the GPU is tried in the child only: this process copies nothing and reserves no FAISS resources
    assert build.used == [] and gpu_resources.cache_info().currsize == 0


def test_the_gpu_probe_child_runs_the_real_module_and_its_failure_is_one_line() -> None:
    """The real probe (ragtrain.index.gpu_probe) in its own process: on a machine without a CUDA GPU it fails at
    its first CUDA call, and the run gets that reason in one line."""
    import torch

    from ragtrain.index.faiss_index import _run_gpu_probe, gpu_probe_command
    from ragtrain.runtime.errors import ConfigError

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: tests/gpu/test_faiss_gpu.py runs the probe for real")
    with pytest.raises(ConfigError, match=r"^index.device=cuda: faiss 1.15.1 cannot search on this GPU: .+") as e:
        _run_gpu_probe(gpu_probe_command("Flat", DIM), "1.15.1")
    assert "\n" not in str(e.value) and ("CUDA" in str(e.value) or "cuda" in str(e.value)), str(e.value)


def test_a_factory_without_a_gpu_version_is_named() -> None:
    """index_to_gpu, which the probe child and the shard actors use: FAISS's refusal becomes index.factory's line."""
    from ragtrain.index.faiss_index import index_to_gpu, make_index
    from ragtrain.runtime.errors import ConfigError

    lib = _FaissBuild(gpus=1, convert_error="Error: 'Could not find a GPU equivalent'\nGPU: HNSW unsupported")
    with pytest.raises(ConfigError, match=r"^index.factory='HNSW32' cannot run on a GPU \(index.device=cuda\): "
                                          r"GPU: HNSW unsupported; use Flat"):  # fmt: skip
        index_to_gpu(make_index("HNSW32", DIM), "HNSW32", lib, res=lib.StandardGpuResources())
