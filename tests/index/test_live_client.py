"""Live index refresh: versions swap in whole, a failed refresh keeps the old index, training never waits."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import ray
import torch

from ragtrain.config import to_typed
from ragtrain.index.faiss_index import build_index
from ragtrain.index.live_client import (
    LiveIndexClient,
    LiveVersion,
    VersionBook,
    make_probe,
    staleness,
)
from ragtrain.index.mining import MiningSpec, mine_rows
from ragtrain.retriever.batching import TrainData, build_examples, local_batch
from ragtrain.runtime.errors import ConfigError
from tests.conftest import compose, spawn, tiny_overrides


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_mined_negatives_skip_gold_and_top_ranks() -> None:
    rng = np.random.default_rng(0)
    docs = _unit(rng.normal(size=(50, 8)))
    index = build_index(docs, [f"d{i}" for i in range(50)], "Flat", "fp", "test")
    gold = [[3, 7], [10], [0, 1, 2]]
    qvecs = docs[[3, 10, 0]]  # each query sits on a gold passage: gold ranks first and must be removed
    negs = mine_rows(index, qvecs, gold, MiningSpec(depth=12, skip_top=2))
    _, rows = index.search(qvecs, 12)
    for i, g in enumerate(gold):
        assert rows[i][0] in g  # gold ranks first ...
        # ... and is not counted among the 2 skipped ranks: the first two NON-gold passages are the guard
        assert negs[i] == [int(r) for r in rows[i] if r not in g][2:]


def test_live_negatives_never_gold_and_same_count_per_rank() -> None:
    n = 20
    queries = {f"q{i:02d}": f"query {i}" for i in range(n)}
    qrels = {f"q{i:02d}": {f"d{i}": 1, f"d{i + 1}": 1} for i in range(n)}
    pos = {f"d{i}": i for i in range(n + 1)}
    data = TrainData([f"passage {i}" for i in range(n + 1)], build_examples(queries, qrels, pos))
    # a live table where some queries have too few candidates: topped up with random non-gold passages
    live = [
        [(i + 5) % (n + 1)] if i % 2 else [(i + 5) % (n + 1), (i + 6) % (n + 1), (i + 7) % (n + 1)] for i in range(n)
    ]
    for step in range(8):
        for rank in range(2):
            _, pids, golds = local_batch(data, 8, step, 0, rank, 2, 2, live_negatives=live)
            negs = pids[4:]
            assert len(negs) == 8  # 4 queries x 2 negatives on every rank
            for j, g in enumerate(golds):
                assert not set(negs[2 * j : 2 * j + 2]) & set(g)


def _version(v: int, step: int = 0) -> LiveVersion:
    return LiveVersion(v, step, [[100 + v]], np.zeros((1, 2), dtype=np.float32), 0.0)


def test_a_resumed_runs_versions_are_numbered_on_from_its_checkpoint() -> None:
    """A resumed run's live index publishes its first version as the checkpoint's newest + 1, not 0 again."""
    book = VersionBook(first=4)
    assert book.version() == 3 and book.latest() is None
    book.publish(_version(book.version() + 1, step=8))
    assert book.version() == 4 and book.version_for_step(9) == 4


def test_version_book_keeps_each_steps_version_for_a_replay() -> None:
    """The first ask fixes a step's version; after a restart the step gets the same one, later steps the newest."""
    book = VersionBook(keep=3)
    book.publish(_version(0))
    assert book.version_for_step(5) == 0
    book.publish(_version(1, step=5))  # a refresh lands while step 5 runs
    assert book.version_for_step(5) == 0  # the other ranks, or the step replayed after a worker restart
    assert book.version_for_step(6) == 1
    for v in (2, 3, 4):
        book.publish(_version(v))
    assert sorted(book.versions) == [2, 3, 4]
    assert book.version_for_step(5) == 4  # its version was dropped: the newest
    with pytest.raises(KeyError, match="no longer kept"):
        book.get(0)


def _agree(rank: int, world: int, port: int, out: str, broadcast: bool) -> None:
    """Two ranks whose own service answers differ for step 0 (rank 1 asked just before a refresh swapped in)."""
    import os

    import torch.distributed as dist

    from ragtrain.config.index import RefreshConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    book = VersionBook()
    book.publish(_version(0))
    if rank == 1:
        book.version_for_step(0)  # its answer for step 0 is version 0 ...
    book.publish(_version(1, step=0))  # ... rank 0's is version 1
    client = LiveIndexClient(book, RefreshConfig(), rank, broadcast=broadcast)
    assert client.live.version == 1  # the newest at start-up
    client.live = book.get(0)  # both ranks mined step -1 from version 0
    seen = [client.begin_step(0), client.negatives()]
    torch.save(seen, f"{out}.{rank}")
    dist.destroy_process_group()


def test_every_rank_mines_a_step_from_rank_0s_version(tmp_path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = str(tmp_path / "agree")
    spawn(_agree, (2, port, out, True), 2)
    assert [torch.load(f"{out}.{r}") for r in range(2)] == [[1, [[101]]]] * 2


class _Refreshing:
    """A live index that a refresh moves on after every search: version v's rows name it and the query."""

    def __init__(self) -> None:
        self.book = VersionBook()
        self.book.publish(_version(0))

    def latest(self) -> LiveVersion | None:
        return self.book.latest()

    def get(self, version: int) -> LiveVersion:
        return self.book.get(version)

    def search_pinned(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, int]:
        v = self.book.version()
        rows = np.array([[1000 * v + 10 * int(q[0]) + j for j in range(k)] for q in queries])
        self.book.publish(_version(v + 1))  # a refresh lands right after this search
        return np.zeros(rows.shape), rows, v


def _pinned(rank: int, world: int, port: int, out: str) -> None:
    """Two ranks of a joint step; rank 1's live index has moved on (a refresh landed before its search)."""
    import os

    import torch.distributed as dist

    from ragtrain.config.index import RefreshConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    service = _Refreshing()
    client = LiveIndexClient(service, RefreshConfig(), rank, broadcast=True)
    if rank == 1:
        service.search_pinned(np.zeros((1, 4), np.float32), 1)  # its own search would now read version 1
    queries = np.full((2, 4), 1 + rank, dtype=np.float32)  # rank r's queries: 1 + r in every dimension
    rows = client.search_step(queries, 3)
    torch.save([rows.tolist(), client.live.version, client.switched], f"{out}.{rank}")
    dist.destroy_process_group()


def test_every_rank_of_a_joint_step_reads_one_search_of_one_version(tmp_path) -> None:
    """Joint training searches the live index each step: rank 0 searches every rank's queries at once and
    broadcasts the rows with the version they came from, so a refresh between two ranks' searches cannot give one
    step two versions (each rank gets the rows of its own queries)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = str(tmp_path / "pinned")
    spawn(_pinned, (2, port, out), 2)
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    assert got[0] == [[[10, 11, 12]] * 2, 0, False]  # version 0, rank 0's queries (1)
    assert got[1] == [[[20, 21, 22]] * 2, 0, False]  # version 0 too, rank 1's queries (2)


def test_a_round_holds_pinned_searches_from_what_it_makes_searchable_until_it_publishes() -> None:
    """`search_pinned` reads a state and its version number under the service's `_state`: a round holds it from
    its commit (global) or each advance (eager, aligned) until that state is published, or until it ends."""
    import threading
    from types import SimpleNamespace

    from ragtrain.index.refresh_service import _Round

    service = SimpleNamespace(
        _state=threading.Lock(), _barrier=threading.RLock(), tag="live", actors=[None, None], encoder_version=0,
        spec=SimpleNamespace(fault=SimpleNamespace(kill_shard_before_apply=-1)),
        _save_point=lambda **_: None, publish_state=lambda *_: {"ok": True},
    )  # fmt: skip
    round_ = _Round(service, 1, 5, np.zeros((1, 4)), np.zeros((1, 4)), {})
    round_.commit("live1")
    assert service._state.locked() and service.tag == "live1"
    round_.advance()  # a second change before the publish: still one hold
    round_.publish()
    assert not service._state.locked() and round_.states == [{"ok": True}]
    round_.advance()
    assert service._state.locked()
    round_.release_state()  # the round ended (failed) before publishing
    assert not service._state.locked()


def test_staleness_metrics() -> None:
    rng = np.random.default_rng(1)
    p = _unit(rng.normal(size=(30, 16)))
    q = p[:10] + 0.01
    gold = [[i] for i in range(10)]
    same = staleness(p, p, q, gold)
    assert same["index/drift_cosine"] == pytest.approx(0.0, abs=1e-6)
    assert same["index/stale_vs_fresh_recall"] == 0.0 and same["index/fresh_recall@10"] == 1.0
    stale = _unit(rng.normal(size=(30, 16)))  # an index from an unrelated encoder
    m = staleness(stale, p, q, gold)
    assert m["index/drift_cosine"] > 0.5
    assert m["index/stale_vs_fresh_recall"] > 0.3


def test_probe_holds_the_probe_queries_gold() -> None:
    gold = [[0, 5], [9], [], [2]]
    probe = make_probe(gold, ["a", "b", "c", "d"], corpus_size=40, num_queries=3, num_passages=10, seed=0)
    assert len(probe.rows) == 10 and len(set(probe.rows)) == 10
    assert probe.queries == ["a", "b", "c"]
    for g, local in zip(gold, probe.gold):
        assert [probe.rows[i] for i in local] == g


def test_refresh_needs_a_schedule(tmp_path) -> None:
    with pytest.raises(ConfigError, match="refresh.enabled needs a schedule"):
        to_typed(compose(["experiment=quickstart", f"output_dir={tmp_path}", "refresh.enabled=true"]))


def _service(cfg, data, tmp_path):
    """The live service started from a version-0 build of vectors encoded in-process (the Ray Data encode that
    writes them in a run is tested in tests/corpus/test_encode.py), on the run's one index shard."""
    from ragtrain.embed.encoders import QueryEncoder
    from ragtrain.embed.model import build_encoder
    from ragtrain.pipeline.retrieval import BuiltIndex, Retrieval
    from tests.index.test_vector_files import _write_vectors

    torch.manual_seed(0)
    weights = build_encoder(cfg.retriever).state_dict()
    retrieval = Retrieval(cfg, data)
    vecs = QueryEncoder(cfg.retriever, [weights]).encode(list(retrieval.passages()), role="passage")
    shards = _write_vectors(tmp_path / "v0", retrieval.doc_ids, vecs, per_file=64)
    index = retrieval.index_from("zeroshot", shards, f"{cfg.retriever.model}@init", 0)
    built = BuiltIndex("zeroshot", index, [weights], retrieval.doc_ids, {}, shards=shards)
    service, probe = retrieval.start_service(built, weights)
    return retrieval, service, probe, weights


@ray.remote(num_cpus=0)
class _Gate:
    """Hands out a value only once opened (an async actor: `release` calls wait without blocking `open`)."""

    def __init__(self):
        import asyncio

        self.opened = asyncio.Event()

    async def release(self, value):
        await self.opened.wait()
        return value

    async def open(self) -> None:
        self.opened.set()


def _until(condition, what: str, deadline_s: float = 120.0) -> None:
    """Poll `condition` until true; fail naming `what` past the deadline (no assertion depends on timing)."""
    import time

    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.05)


def test_a_refresh_that_cannot_be_reserved_says_what_it_asked(ray_session, monkeypatch) -> None:
    import ragtrain.index.refresh_service as refresh_service
    from ragtrain.config.resources import PoolResources

    monkeypatch.setattr(refresh_service, "PLACEMENT_TIMEOUT_S", 1.0)  # the real wait is 30 s
    with pytest.raises(TimeoutError, match="no_such_resource") as e:
        refresh_service.reserve(PoolResources(num_actors=1, cpus_per_actor=1, resources={"no_such_resource": 1}))
    assert "resources.pool" in str(e.value) and "live refresh" in str(e.value)
    # the reservation was given back: its CPUs are free again
    assert ray_session.available_resources().get("CPU", 0) >= 1


def test_the_refresh_reserves_its_cpus_in_a_placement_group(ray_session) -> None:
    from ray.util.placement_group import remove_placement_group

    from ragtrain.config.resources import PoolResources
    from ragtrain.index.refresh_service import reserve

    before = ray_session.available_resources().get("CPU", 0)
    pg = reserve(PoolResources(num_actors=2, cpus_per_actor=0.5))
    try:
        table = ray_session.util.placement_group_table(pg)
        assert table["state"] == "CREATED" and len(table["bundles"]) == 2
        assert ray_session.available_resources().get("CPU", 0) == pytest.approx(before - 1.0)
    finally:
        remove_placement_group(pg)


def test_service_swaps_versions_and_keeps_the_old_one_on_failure(ray_session, tmp_path) -> None:
    import ray

    from ragtrain.corpus.load import load_data

    cfg = to_typed(
        compose(
            [
                "experiment=quickstart",
                *tiny_overrides(tmp_path),
                "retriever.train.hard_negatives=2",
                "refresh.enabled=true",
                "refresh.every_steps=2",
            ]
        )
    )
    data = load_data(cfg.data)
    retrieval, service, probe, weights = _service(cfg, data, tmp_path)
    try:
        v0 = ray.get(service.latest.remote())
        assert v0.version == 0 and len(v0.negatives) == len(data.train_qrels)
        new = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in weights.items()}
        ok = ray.get(service.refresh.remote(5, [ray.put(new)]))
        assert ok["ok"] and ok["version"] == 1
        # one index shard has the store's figures too: every row re-encoded, one version searched, its encode timed
        m = ok["metrics"]
        assert (
            m["index/encoded_fraction"] == 1.0
            and m["index/version_skew"] == 0.0
            and m["index/shard0_encode_seconds"] > 0
        )
        v1 = ray.get(service.latest.remote())
        assert v1.step == 5 and not np.allclose(v1.probe_vectors, v0.probe_vectors)
        # a snapshot that does not fit the encoder: the refresh fails, version 1 stays live and searchable
        bad = {k: v for k, v in new.items() if not k.endswith("bias")}
        failed = ray.get(service.refresh.remote(9, [ray.put(bad)]))
        assert not failed["ok"] and "Missing key" in failed["error"]
        assert ray.get(service.version.remote()) == 1
        _, rows = ray.get(service.search.remote(v1.probe_vectors[:3], 5))
        assert (rows >= 0).all()
        # only one refresh at a time: a second call while one runs is skipped, not queued. The first one's
        # snapshot comes from a gate that opens only after the second call, so the first is surely running then.
        gate = _Gate.remote()
        first = service.refresh.remote(11, [gate.release.remote(new)])
        _until(lambda: ray.get(service.busy.remote()), "the first refresh never started")
        second = ray.get(service.refresh.remote(12, [ray.put(new)]))
        assert second == {"ok": False, "skipped": "a refresh is already running", "step": 12}
        ray.get(gate.open.remote())
        assert ray.get(first)["ok"] and ray.get(service.version.remote()) == 2
        # a training step's pinned search: the rows of a plain search, and the version they were read from
        _, pinned, version = ray.get(service.search_pinned.remote(v1.probe_vectors[:3], 5))
        assert version == 2 and (pinned == ray.get(service.search.remote(v1.probe_vectors[:3], 5))[1]).all()
        report = retrieval.stop_service(service)
        assert len(report["failures"]) == 1
    finally:
        retrieval.close()


def test_a_small_run_refreshes_its_sharded_index_while_a_stopped_shard_fails_one_round(
    ray_session, tmp_path, capfd
) -> None:
    """The live refresh during training in a small form: 2 index shards refresh every 2 steps while one trainer
    worker mines its negatives from the live index. Shard 0 is SIGSTOPped while it encodes round 1 (it announces
    that through fault.hold_shard_encode): that round is abandoned once refresh.timeout_s has passed, one log line
    names the shard, the old index stays live and training goes on; the shard is resumed once the failure is in
    MLflow, and the later rounds land on every row, versions advancing, their metrics in MLflow.
    refresh.max_lag_steps holds a step whose live index is 4 steps behind until the round in flight ends, so rounds
    land whatever the box's speed. (That steps go on while a round runs needs a corpus whose refresh spans several
    steps: the slow test below.)"""
    import os
    import signal
    import threading
    import time

    from mlflow.tracking import MlflowClient

    from ragtrain.index.sharded import FAULTS
    from ragtrain.pipeline.stages import run

    timeout_s = 20  # a healthy round of this corpus takes well under a second; a held one is cut off at this
    overrides = [
        "experiment=quickstart",
        *tiny_overrides(tmp_path),
        "resources=laptop",  # 1 trainer worker + the refresh's 1 CPU, each in its own placement group
        "resources.num_cpus=4",
        "index.shards=2",
        "retriever.train.max_steps=10",
        "retriever.train.hard_negatives=1",
        "refresh.enabled=true",
        "refresh.every_steps=2",
        "refresh.max_lag_steps=4",
        "refresh.check_every=2",
        "refresh.search_probe=3",
        f"refresh.timeout_s={timeout_s}",
        "fault.hold_shard_encode=0",
        "zeroshot_eval=false",
        "export=false",
        "logger.experiment_name=small-refresh",
    ]
    cfg = to_typed(compose(overrides))
    note = tmp_path / "out" / "shards" / FAULTS / "encoding-shard-0.json"
    seen: dict = {}
    client = MlflowClient(cfg.logger.tracking_uri)

    def run_id() -> str | None:
        exp = client.get_experiment_by_name("small-refresh")
        runs = client.search_runs([exp.experiment_id]) if exp else []
        return runs[0].info.run_id if runs else None

    def failures_logged() -> bool:
        rid = run_id()
        return bool(rid and client.get_metric_history(rid, "index/refresh_failures"))

    def stop_the_shard() -> None:
        _until(note.exists, "the shard never announced its encode", 180)
        seen.update(json.loads(note.read_text()))
        os.kill(seen["pid"], signal.SIGSTOP)
        seen["stopped"] = time.monotonic()
        note.unlink()  # resumed, it goes on at once
        try:
            _until(failures_logged, "the round's failure never reached MLflow", 120)
            seen["failed"] = time.monotonic()
        finally:
            os.kill(seen["pid"], signal.SIGCONT)

    watcher = threading.Thread(target=stop_the_shard, daemon=True)
    watcher.start()
    results = run(cfg)
    watcher.join(timeout=5)
    # the held round: abandoned within the bound (the timeout, plus a step and an MLflow write on a busy box)
    assert seen["version"] == 1 and "failed" in seen
    assert seen["failed"] - seen["stopped"] < timeout_s + 30
    t = results["train"]
    assert t["index/refresh_failures"] >= 1 and t["index/final_version"] == t["index/refreshes"]
    report = json.loads((tmp_path / "out" / "refresh_history.json").read_text())
    assert report["failures"][0].startswith("step 2: ShardUnavailableError('index shard 0 did not answer a live encode")
    assert "(refresh.timeout_s)" in report["failures"][0]
    out, err = capfd.readouterr()
    lines = [x for x in (out + err).splitlines() if "index shard 0" in x]
    assert len(lines) == 1 and "refresh from step 2 failed, the old index stays live" in lines[0], lines
    # the later rounds: versions numbered on from the failed one's, every row of both shards each time
    history = report["history"]
    assert t["index/refreshes"] >= 2 and t["index/final_version"] >= 2
    assert [h["version"] for h in history] == list(range(1, len(history) + 1)) and len(history) >= 2
    assert all(h["metrics"]["index/encoded_fraction"] == 1.0 for h in history)
    # hard negatives come from the live index: every round mines them for every training query
    train_queries = int(re.search(r"(\d+) train queries", (tmp_path / "out" / "ragtrain.log").read_text())[1])
    assert train_queries > cfg.refresh.probe_queries
    assert {h["metrics"]["index/mined_queries"] for h in history} == {float(train_queries)}
    rid = run_id()
    versions = [m.value for m in client.get_metric_history(rid, "index/version")]
    assert versions == sorted(versions) and versions[-1] >= 2, versions
    for key in ("index/lag_steps", "index/drift_cosine", "index/refresh_seconds", "index/shard1_encode_seconds"):
        assert client.get_metric_history(rid, key), key
    # the bound held once a round had landed (a step waits for the round in flight; the failed round released its
    # waiters with the zero-shot version still live, so only those steps may lag further)
    landed = min(m.step for m in client.get_metric_history(rid, "index/version") if m.value >= 1)
    lags = [(m.step, m.value) for m in client.get_metric_history(rid, "index/lag_steps")]
    assert [(step, lag) for step, lag in lags if lag > 4 and step >= landed] == [], (lags, landed)
    assert json.loads((tmp_path / "out" / "status.json").read_text())["status"] == "complete"
    assert 0.0 <= results["trained"]["ndcg@10"] <= 1.0
    # each round's snapshot went out in the precision the shards encode in: bf16 is half the fp32 weights' bytes
    from ragtrain.embed.precision import resolved_index
    from ragtrain.pipeline.stages import initial_weights

    fp32_mb = sum(v.numel() * v.element_size() for v in initial_weights(cfg).values()) / 1e6
    bf16 = resolved_index(cfg).precision.value == "bf16"
    assert t["index/snapshot_mb"] == pytest.approx(fp32_mb / 2 if bf16 else fp32_mb, rel=0.01)
    for h in history:  # 3 timed single-query searches after every round
        assert 0.0 < h["metrics"]["index/search_ms_p50"] <= h["metrics"]["index/search_ms_p95"]


@pytest.mark.slow(
    reason="a training run beside the live refresh (~50 s); the service swap and rank-0 version rule stay in"
    " the default suite"
)
def test_training_steps_while_the_index_refreshes(ray_session, tmp_path) -> None:
    """A real run: versions increase during training, steps go on while a refresh runs, no stall."""
    from mlflow.tracking import MlflowClient

    from ragtrain.pipeline.stages import run

    overrides = [
        "experiment=quickstart",
        *tiny_overrides(tmp_path),
        "resources=laptop",  # 1 trainer worker + the refresh's 1 CPU, each in its own placement group
        "resources.num_cpus=4",
        "data.num_entities=150",  # a corpus big enough that a refresh spans several training steps
        "retriever.passage_max_length=128",
        "retriever.train.max_steps=40",
        "retriever.train.hard_negatives=2",
        "refresh.enabled=true",
        "refresh.every_steps=8",
        "refresh.check_every=4",
        "logger.experiment_name=refresh-test",
    ]
    cfg = to_typed(compose(overrides))
    results = run(cfg)
    t = results["train"]
    assert t["index/refreshes"] >= 2 and t["index/final_version"] >= 2
    assert t["index/refresh_failures"] == 0
    # No stall: steps completed while a refresh was in flight (a trainer that waited for the refresh would have
    # none: the refresh would always be finished when its step ends).
    assert t["index/steps_during_refresh"] >= 3
    history = json.loads((tmp_path / "out" / "refresh_history.json").read_text())["history"]
    # one entry per round (version 0, the zero-shot index, is published at the start, not a round); at one shard
    # under `global` each round publishes one state
    assert [h["version"] for h in history] == list(range(1, len(history) + 1))
    assert results["trained"]["ndcg@10"] > results["zeroshot"]["ndcg@10"]
    client = MlflowClient(cfg.logger.tracking_uri)
    run_id = client.search_runs([client.get_experiment_by_name("refresh-test").experiment_id])[0].info.run_id
    lag = client.get_metric_history(run_id, "index/lag_steps")
    versions = [m.value for m in client.get_metric_history(run_id, "index/version")]
    assert lag and versions == sorted(versions) and versions[-1] >= 2
    for key in ("index/drift_cosine", "index/stale_vs_fresh_recall", "index/refresh_seconds"):
        assert client.get_metric_history(run_id, key), key


@pytest.mark.slow(reason="an end-to-end run of its own, beyond the default suite's budget (make test-slow)")
@pytest.mark.parametrize("threshold", [1e-7, 0.9])
def test_adaptive_refresh_follows_measured_drift(ray_session, tmp_path, threshold) -> None:
    """refresh.drift_threshold: a refresh starts only at a staleness check whose drift exceeds the threshold."""
    from ragtrain.pipeline.stages import run

    overrides = [
        "experiment=quickstart",
        *tiny_overrides(tmp_path),
        "resources=laptop",
        "resources.num_cpus=4",
        "retriever.train.max_steps=16",
        "retriever.train.hard_negatives=1",
        "retriever.train.lr=1e-3",
        "refresh.enabled=true",
        "refresh.every_steps=0",
        f"refresh.drift_threshold={threshold}",
        "refresh.check_every=5",
        "logger=none",
    ]
    results = run(to_typed(compose(overrides)))
    history = json.loads((tmp_path / "out" / "refresh_history.json").read_text())["history"]
    if threshold > 0.5:  # 16 small steps never move the tiny encoder's passage vectors that far
        assert results["train"]["index/refreshes"] == 0 and history == []
        return
    assert results["train"]["index/refreshes"] >= 1
    started = [h["step"] for h in history]  # the rounds (version 0, the zero-shot index, is no round)
    assert started and all(s % 5 == 0 for s in started)  # only at checks, never on a step count


def test_the_summary_sums_refresh_seconds_and_summarises_sharded_rounds(ray_session) -> None:
    """What rank 0 logs as the run's refresh summary (run/index/*): total refresh seconds, and over a sharded
    refresh's rounds the mean encoded fraction and mixed recall and the largest version skew."""
    import ray

    from ragtrain.config.index import RefreshConfig

    book = VersionBook()
    book.publish(_version(0))
    client = LiveIndexClient(book, RefreshConfig(), rank=0)
    rounds = [
        {"ok": True, "version": 1, "step": 2, "seconds": 3.0, "metrics": {"index/encoded_fraction": 0.25,
         "index/mixed_recall_at_10": 0.9, "index/mined_agreement": 0.6, "index/version_skew": 1.0}},
        {"ok": True, "version": 2, "step": 4, "seconds": 5.0, "metrics": {"index/encoded_fraction": 0.25,
         "index/mixed_recall_at_10": 0.7, "index/mined_agreement": 0.4, "index/version_skew": 2.0}},
        {"ok": False, "error": "boom", "step": 6},
    ]  # fmt: skip
    for stats in rounds:
        client.pending = ray.put(stats)
        assert client.finished() == stats
    s = client.summary()
    assert s["index/refreshes"] == 2 and s["index/refresh_failures"] == 1
    assert s["index/refresh_seconds_total"] == 8.0 and s["index/encoded_fraction_mean"] == 0.25
    assert s["index/mined_agreement_mean"] == pytest.approx(0.5)
    assert s["index/mixed_recall_at_10_mean"] == pytest.approx(0.8) and s["index/version_skew_max"] == 2.0


def test_a_round_committed_late_counts_as_a_refresh_not_a_failure(ray_session, caplog) -> None:
    """A round whose apply failed after its barrier switched every search (`committed_late`): rank 0 counts it as
    a refresh (and as committed late), never as a failure, and says so in one warning line."""
    import ray

    from ragtrain.config.index import RefreshConfig

    book = VersionBook()
    book.publish(_version(0))
    client = LiveIndexClient(book, RefreshConfig(), rank=0)
    late = {"ok": True, "committed_late": True, "late": "ShardUnavailableError: index shard 1 did not answer",
            "version": 0, "encoder_version": 1, "step": 2, "seconds": 4.0, "states": 0, "metrics": {}}  # fmt: skip
    client.pending = ray.put(late)
    with caplog.at_level("WARNING"):
        logged = client._done_metrics(client.finished())
    assert logged == {"index/refresh_seconds": 4.0, "index/version": 0, "index/refreshes_committed_late": 1}
    s = client.summary()
    assert s["index/refreshes"] == 1 and s["index/refresh_failures"] == 0 and s["index/refreshes_committed_late"] == 1
    assert "refresh from step 2 committed late: searches switched to encoder version 1" in caplog.text


def test_the_summary_counts_the_steps_that_mined_from_mixed_versions() -> None:
    """Published states can mix encoder versions for a moment; what counts for training is whether a step's
    negatives came from one: index/steps_on_mixed_versions."""
    from ragtrain.config.index import RefreshConfig

    book = VersionBook()
    book.publish(_version(0))
    client = LiveIndexClient(book, RefreshConfig(), rank=0)
    mixed = LiveVersion(1, 2, [[7]], np.zeros((1, 2), dtype=np.float32), 0.0, version_skew=1.0)
    for step in range(6):
        if step == 2:
            book.publish(mixed)
        if step == 4:
            book.publish(_version(2, step=4))  # the round's last shard landed: one version again
        client.begin_step(step)
        client.after_step(step, dict, lambda _: {"index/drift_cosine": 0.0}, 1.0, 4)
    assert client.summary()["index/steps_on_mixed_versions"] == 2.0  # steps 2 and 3


@ray.remote
def _a_refresh_that_ends_after_training(book_version: int) -> dict:
    import time

    time.sleep(1.0)  # still encoding when the last training step ends
    return {"ok": True, "version": book_version, "step": 4, "seconds": 1.0, "metrics": {"index/encoded_fraction": 0.5}}


def test_a_refresh_still_running_when_training_ends_keeps_its_metrics(ray_session, tmp_path) -> None:
    """drain() waited for the refresh and dropped its metrics: its version and seconds never reached MLflow."""
    from mlflow.tracking import MlflowClient

    from ragtrain.config.index import RefreshConfig
    from ragtrain.config.logger import LoggerConfig
    from ragtrain.track.mlflow import RunLogger
    from tests.conftest import mlflow_db

    book = VersionBook()
    book.publish(_version(0))
    client = LiveIndexClient(book, RefreshConfig(), rank=0)
    client.pending = _a_refresh_that_ends_after_training.remote(1)
    assert client.in_flight()
    book.publish(_version(1, step=4))  # what the service publishes when the refresh completes
    logger = RunLogger(LoggerConfig(tracking_uri=mlflow_db(tmp_path / "m.db"), experiment_name="drain"), "r")
    metrics = client.drain()  # what rank 0 logs at the last step (retriever/train.py: finish)
    logger.sink().log(metrics, step=4)
    store = MlflowClient(logger.uri)
    assert [(m.step, m.value) for m in store.get_metric_history(logger.run_id, "index/version")] == [(4, 1.0)]
    assert [m.value for m in store.get_metric_history(logger.run_id, "index/refresh_seconds")] == [1.0]
    assert store.get_metric_history(logger.run_id, "index/encoded_fraction")[0].value == 0.5
    assert client.live.version == 1 and client.summary()["index/refreshes"] == 1
