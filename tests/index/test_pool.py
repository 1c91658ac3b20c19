"""Tests for the Ray encoder pool: vectors equal in-process encoding (input order), bf16, lifecycle, strict weights."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from ragtrain.config import IndexConfig, PoolResources, Precision, RetrieverConfig
from ragtrain.index.pool import EncoderPool, make_shards

MAX_LENGTH = 48
SHARD = 16
CFG = RetrieverConfig(model="tiny")
WORDS = (
    "alpha beta gamma delta river mountain archive protein lattice quantum harbor violet seventeen "
    "ledger orbit cascade meadow tungsten carbon signal"
).split()


def _texts(n: int = 100, seed: int = 0) -> list[str]:
    """Distinct texts of very different lengths (1..70 words: some are truncated at MAX_LENGTH tokens)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(1, 71))).tolist()
        out.append(f"doc {i} " + " ".join(words))
    return out


def _weights(seed: int) -> dict[str, torch.Tensor]:
    from ragtrain.embed.model import build_encoder

    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in build_encoder(CFG).state_dict().items()}


def _local_encode(weights: dict[str, torch.Tensor], texts: list[str], index: IndexConfig) -> np.ndarray:
    from ragtrain.embed.model import build_encoder, encode_texts, load_tokenizer

    model = build_encoder(CFG)
    model.load_state_dict(weights, strict=True)
    return encode_texts(model, load_tokenizer(CFG), texts, MAX_LENGTH, index.batch_size, index.precision).numpy()


def _available_cpus(ray) -> float:
    return float(ray.available_resources().get("CPU", 0.0))


def _wait_for_cpus(ray, target: float, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        cpus = _available_cpus(ray)
        if abs(cpus - target) < 1e-6 or time.monotonic() > deadline:
            return cpus
        time.sleep(0.1)


def _wait_for_stable_cpus(ray, quiet: float = 0.5, timeout: float = 10.0) -> float:
    """Available CPUs once the figure has not changed for `quiet` seconds (resource reports lag a little)."""
    deadline = time.monotonic() + timeout
    last, since = _available_cpus(ray), time.monotonic()
    while time.monotonic() - since < quiet and time.monotonic() < deadline:
        time.sleep(0.1)
        now = _available_cpus(ray)
        if now != last:
            last, since = now, time.monotonic()
    return last


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return _texts()


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return _weights(seed=0)


@pytest.fixture(scope="module")
def pool(ray_session, weights):
    """2 actors x 1 CPU holding the seed-0 weights as version 1."""
    p = EncoderPool(CFG, PoolResources(num_actors=2, cpus_per_actor=1))
    p.set_weights(1, ray_session.put(weights))
    yield p
    p.shutdown()


def test_make_shards_cover_every_position_once(texts) -> None:
    shards = make_shards(texts, SHARD)
    assert len(shards) == -(-len(texts) // SHARD)
    assert sorted(i for s in shards for i in s) == list(range(len(texts)))
    assert all(len(s) == SHARD for s in shards[:-1])
    lengths = [len(texts[i]) for s in shards for i in s]
    assert lengths == sorted(lengths, reverse=True)  # longest first: similar lengths share a shard


def test_pool_matches_in_process_encoding_in_input_order(pool, texts, weights, capsys) -> None:
    index = IndexConfig(precision=Precision.fp32, shard_size=SHARD, batch_size=8)
    vecs, stats = pool.encode(texts, MAX_LENGTH, index, progress=True, desc="pool-bar")
    assert "pool-bar" in capsys.readouterr().err  # in the driver, a plain tqdm bar (in an actor: Ray's tqdm_ray)
    assert vecs.shape == (len(texts), CFG.tiny.hidden_size) and vecs.dtype == np.float32
    expected = _local_encode(weights, texts, index)
    np.testing.assert_allclose(vecs, expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    # Distinct texts get distinct vectors, so the comparison above really checks the order.
    assert np.abs(vecs[:, None] - vecs[None]).sum(-1)[np.triu_indices(len(texts), 1)].min() > 1e-4
    assert stats["docs"] == len(texts) and stats["seconds"] > 0 and stats["docs_per_s"] > 0


def test_pool_uses_the_weights_it_was_given(pool, texts, weights, ray_session) -> None:
    """A new snapshot changes the vectors; the pool follows versions and returns to the first snapshot."""
    index = IndexConfig(precision=Precision.fp32, shard_size=SHARD)
    other = _weights(seed=1)
    try:
        pool.set_weights(2, ray_session.put(other))
        vecs2, _ = pool.encode(texts[:40], MAX_LENGTH, index, progress=False)
        np.testing.assert_allclose(vecs2, _local_encode(other, texts[:40], index), rtol=0, atol=1e-5)
        assert not np.allclose(vecs2, _local_encode(weights, texts[:40], index), atol=1e-3)
    finally:
        pool.set_weights(1, ray_session.put(weights))


def test_bf16_close_to_fp32(pool, texts) -> None:
    fp32, _ = pool.encode(texts, MAX_LENGTH, IndexConfig(precision=Precision.fp32, shard_size=SHARD), progress=False)
    bf16, _ = pool.encode(texts, MAX_LENGTH, IndexConfig(shard_size=SHARD, precision=Precision.bf16), progress=False)
    assert bf16.dtype == np.float32
    assert not np.array_equal(bf16, fp32)  # autocast really ran
    np.testing.assert_allclose(np.linalg.norm(bf16, axis=1), 1.0, atol=1e-4)
    cos = (bf16 * fp32).sum(1) / (np.linalg.norm(bf16, axis=1) * np.linalg.norm(fp32, axis=1))
    assert cos.min() >= 0.99, f"min cosine bf16 vs fp32 {cos.min():.4f}"


def test_pool_encodes_queries_and_passages_with_their_prefixes(ray_session, weights, texts) -> None:
    """The live-refresh pool and the in-process QueryEncoder (the Ray Data actors' class) agree role by role."""
    from ragtrain.embed.encoders import QueryEncoder

    cfg = RetrieverConfig(model="tiny", query_prefix="query: ", passage_prefix="passage: ")
    index = IndexConfig(precision=Precision.fp32, shard_size=SHARD, batch_size=8)
    p = EncoderPool(cfg, PoolResources(num_actors=1, cpus_per_actor=0.5))
    try:
        p.set_weights(1, ray_session.put(weights))
        q, _ = p.encode(texts[:20], MAX_LENGTH, index, progress=False, role="query")
        d, _ = p.encode(texts[:20], MAX_LENGTH, index, progress=False, role="passage")
    finally:
        p.shutdown()
    enc = QueryEncoder(cfg, [weights], batch_size=8)
    np.testing.assert_allclose(q, enc.encode(texts[:20], MAX_LENGTH, role="query"), rtol=0, atol=1e-5)
    np.testing.assert_allclose(d, enc.encode(texts[:20], MAX_LENGTH, role="passage"), rtol=0, atol=1e-5)
    assert np.abs(q - d).max() > 1e-3  # the two prefixes really reached the encoder


def test_encode_before_set_weights_raises(ray_session) -> None:
    # encode must refuse to run without a snapshot before touching any actor.
    p = EncoderPool(CFG, PoolResources(num_actors=1, cpus_per_actor=0.5))
    try:
        with pytest.raises(RuntimeError, match="before set_weights"):
            p.encode(["a passage"], MAX_LENGTH, IndexConfig(precision=Precision.fp32, shard_size=SHARD), progress=False)
    finally:
        p.shutdown()


def test_pool_that_cannot_be_reserved_says_what_it_asked(ray_session, monkeypatch) -> None:
    import ragtrain.index.pool as pool_module

    monkeypatch.setattr(pool_module, "PLACEMENT_TIMEOUT_S", 1.0)  # the real wait is 30 s
    with pytest.raises(TimeoutError, match="no_such_resource") as e:
        EncoderPool(CFG, PoolResources(num_actors=1, cpus_per_actor=1, resources={"no_such_resource": 1}))
    assert "resources.pool" in str(e.value)
    # the reservation was given back: the pool's CPUs are free again
    assert ray_session.available_resources().get("CPU", 0) >= 1


def test_pool_reserves_its_cpus_in_a_placement_group(ray_session) -> None:
    before = ray_session.available_resources().get("CPU", 0)
    p = EncoderPool(CFG, PoolResources(num_actors=2, cpus_per_actor=0.5))
    try:
        table = ray_session.util.placement_group_table(p.placement_group)
        assert table["state"] == "CREATED" and len(table["bundles"]) == 2
        assert ray_session.available_resources().get("CPU", 0) == pytest.approx(before - 1.0)
    finally:
        p.shutdown()


def test_set_weights_with_missing_key_names_it(pool, ray_session, weights) -> None:
    ray = ray_session
    missing = "backbone.encoder.layer.1.output.dense.weight"
    assert missing in weights
    bad = {k: v for k, v in weights.items() if k != missing}
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            pool.set_weights(2, ray.put(bad))
        assert isinstance(e.value, RuntimeError)  # RayTaskError(RuntimeError) from load_state_dict(strict=True)
        assert missing in str(e.value) and "Missing key" in str(e.value)
        assert pool.version is None  # actors may hold a partial load: no snapshot is trusted until the next one
        with pytest.raises(RuntimeError, match="before set_weights"):
            pool.encode(
                ["a passage"], MAX_LENGTH, IndexConfig(precision=Precision.fp32, shard_size=SHARD), progress=False
            )
    finally:
        pool.set_weights(1, ray.put(weights))


def test_after_a_failed_set_weights_the_next_snapshot_is_served_whole(pool, ray_session, weights, texts) -> None:
    """A failed load leaves actors half-loaded (the pool then refuses to encode: the test above); the next good
    snapshot replaces every tensor, so the vectors are that snapshot's alone, not a mix."""
    ray = ray_session
    index = IndexConfig(precision=Precision.fp32, shard_size=SHARD)
    newer = _weights(seed=1)
    bad = {k: v for k, v in newer.items() if k != "backbone.encoder.layer.1.output.dense.weight"}
    try:
        with pytest.raises(ray.exceptions.RayTaskError):
            pool.set_weights(2, ray.put(bad))
        pool.set_weights(3, ray.put(newer))
        vecs, _ = pool.encode(texts[:20], MAX_LENGTH, index, progress=False)
        np.testing.assert_allclose(vecs, _local_encode(newer, texts[:20], index), rtol=0, atol=1e-5)
    finally:
        pool.set_weights(1, ray.put(weights))


def test_shutdown_returns_the_actor_cpus(pool, ray_session) -> None:
    """Runs last in this module: it shuts the shared pool down (the fixture's teardown is then a no-op)."""
    ray = ray_session
    actors = list(pool.actors)
    assert len(actors) == 2
    held = _wait_for_stable_cpus(ray)
    pool.shutdown()
    assert pool.actors == []
    start = time.monotonic()
    back = _wait_for_cpus(ray, held + 2)
    assert back == pytest.approx(held + 2), f"available CPUs {held} -> {back} after shutdown, expected {held + 2}"
    assert time.monotonic() - start < 10
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actors[0].node_id.remote(), timeout=30)


@pytest.mark.slow  # ~13 s: a replacement actor's start; the pool serves live refresh, whose training run is slow too
def test_killed_actor_shard_is_retried_and_every_passage_indexed_once(ray_session, weights, texts) -> None:
    from ragtrain.index.faiss_index import build_index

    index = IndexConfig(precision=Precision.fp32, shard_size=SHARD)
    p = EncoderPool(CFG, PoolResources(num_actors=2, cpus_per_actor=0.5))
    try:
        p.set_weights(1, ray_session.put(weights))
        p.fault_shard = 1  # the actor that receives shard 1 exits (os._exit) before encoding it
        first = list(p.actors)
        vecs, stats = p.encode(texts, MAX_LENGTH, index, progress=False)
        assert stats["retried_shards"] == 1
        assert len(p.actors) == 2 and p.actors != first  # the dead actor was replaced in its bundle
        np.testing.assert_allclose(vecs, _local_encode(weights, texts, index), rtol=0, atol=1e-5)
        ids = [f"d{i}" for i in range(len(texts))]
        built = build_index(vecs, ids, "Flat", "fp", "tiny")
        assert built.index.ntotal == len(texts) and len(set(built.doc_ids)) == len(texts)
        _, rows = built.search(vecs, 1)
        assert (rows[:, 0] == np.arange(len(texts))).mean() > 0.95  # each passage finds itself: none lost or swapped
        again, stats = p.encode(texts[:20], MAX_LENGTH, index, progress=False)  # the fault fires once
        assert stats["retried_shards"] == 0
    finally:
        p.shutdown()
