"""Index shards: N IndexShard actors answer exactly as one index (Flat, and IVF with the shared quantiser), persist
each build with a manifest, restart from it after a real kill, and fail a search in bounded time naming the shard."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ragtrain.config.index import IndexConfig
from ragtrain.config.resources import PoolResources
from ragtrain.index.commit_point import COMMIT_POINT
from ragtrain.index.faiss_index import IndexMismatchError
from ragtrain.index.live_rows import JOURNAL
from ragtrain.index.sharded import (
    FAULTS,
    LIVE_STATE,
    MANIFEST,
    SEARCH_BATCH,
    ReadOnlyShards,
    ShardGroup,
    ShardUnavailableError,
    _Shard,
    merge_topk,
    open_saved,
    resolve_shards,
    shard_ranges,
)
from ragtrain.index.vector_files import build_from_vectors
from ragtrain.runtime.errors import ConfigError
from tests.index.test_vector_files import _vectors, _write_vectors

ROWS = 400


@pytest.fixture(scope="module")
def vectors(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    x = _vectors(ROWS)
    x[7] = x[300]  # a duplicate passage: equal scores
    return x, _write_vectors(tmp / "vec", [f"d{i}" for i in range(ROWS)], x, per_file=64), tmp


@pytest.fixture(scope="module")
def groups(ray_session, vectors):
    """Shard groups of 1 and 2 actors (started once for the module). Each actor costs seconds of CPU to start
    (imports); 2 shards already split rows, ties and ranges between actors, so a third group would prove nothing
    more."""
    _, _, tmp = vectors
    made = {n: ShardGroup(n, tmp / f"root{n}", PoolResources(num_actors=1), timeout_s=60.0) for n in (1, 2)}
    yield made
    for g in made.values():
        g.close()


def test_ranges_are_contiguous_and_stable() -> None:
    assert shard_ranges(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert shard_ranges(10, 3) == shard_ranges(10, 3) and shard_ranges(5, 5)[-1] == (4, 5)
    with pytest.raises(ValueError):
        shard_ranges(2, 3)


def test_merge_orders_by_score_then_global_row_and_pads_last() -> None:
    a = (np.array([[0.9, 0.5, -3e38]], np.float32), np.array([[1, 0, -1]]))
    b = (np.array([[0.9, 0.7, 0.1]], np.float32), np.array([[0, 2, 1]]))
    scores, rows = merge_topk([a, b], [0, 10], k=5)
    assert rows.tolist() == [[1, 10, 12, 0, 11]] and scores[0, :2].tolist() == pytest.approx([0.9, 0.9])
    scores, rows = merge_topk([a, (b[0][:, :0], b[1][:, :0])], [0, 10], k=3)  # fewer rows than k: -1 last
    assert rows.tolist() == [[1, 0, -1]]


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat"])
def test_n_shards_return_exactly_what_one_index_returns(groups, vectors, factory) -> None:
    x, shards, _ = vectors
    idx = IndexConfig(factory=factory, nprobe=3)
    one = build_from_vectors(shards, idx.factory, "fp", "enc", 2, idx.precision.value, seed=0)
    one.set_search_params(idx.nprobe, idx.ef_search)
    q = _vectors(30, seed=5)
    want_scores, want_rows = one.search(q, 10)
    for n, group in groups.items():
        index = group.build("t", shards, idx, "fp", "enc", 2, seed=0)
        assert index.doc_ids == one.doc_ids and index.ntotal == ROWS and index.meta.extra["shards"] == n
        scores, rows = index.search(q, 10)
        np.testing.assert_array_equal(rows, want_rows, err_msg=f"{n} shards, {factory}")
        np.testing.assert_array_equal(scores, want_scores, err_msg=f"{n} shards, {factory}")
        # equal scores (a duplicate passage, rows 7 and 300 in different shards when n > 1) come in row order,
        # whatever the shard count (one FAISS index orders ties by its heap, not by row)
        _, tied = index.search(x[[7]], 2)
        assert sorted(one.search(x[[7]], 2)[1][0].tolist()) == [7, 300] and tied.tolist() == [[7, 300]]
        assert index.search_ids(q[:2], 3) == one.search_ids(q[:2], 3)
        np.testing.assert_allclose(index.reconstruct_first(ROWS), x, atol=1e-6)


def test_each_shard_persists_its_build_with_a_manifest_and_saves_a_loadable_folder(groups, vectors, tmp_path) -> None:
    x, shards, tmp = vectors
    group = groups[2]
    index = group.build("saved", shards, IndexConfig(), "fp", "enc", 1, seed=0)
    for i, (lo, hi) in enumerate(shard_ranges(ROWS, 2)):
        m = json.loads((tmp / "root2" / "saved" / f"shard-{i}" / MANIFEST).read_text())
        assert (m["shard"], m["start"], m["stop"], m["rows"], m["factory"], m["dim"]) == (
            i,
            lo,
            hi,
            hi - lo,
            "Flat",
            x.shape[1],
        )
        assert m["version"] >= 1 and len(m["checksum"]) == 64
    out = index.save(tmp_path / "index")
    local = open_saved(out, expect_corpus="fp")
    assert isinstance(local, ReadOnlyShards) and local.doc_ids == index.doc_ids
    q = _vectors(5, seed=9)
    for a, b in zip(local.search(q, 7), index.search(q, 7)):
        np.testing.assert_array_equal(a, b)
    loaded = group.load("reloaded", out)  # a saved folder into the actors (the generator's saved-index path)
    np.testing.assert_array_equal(loaded.search(q, 7)[1], index.search(q, 7)[1])
    with pytest.raises(IndexMismatchError, match="different corpus"):
        open_saved(out, expect_corpus="other")
    (out / "shard-1" / "index.faiss").write_bytes(b"garbage")
    with pytest.raises(IndexMismatchError, match=r"index shard .*shard-1 is corrupt"):
        open_saved(out)
    index.drop()
    loaded.drop()


def test_a_killed_shard_restarts_from_its_persisted_build_mid_search(groups, vectors) -> None:
    _, shards, _ = vectors
    group = groups[2]
    index = group.build("k", shards, IndexConfig(), "fp", "enc", 1, seed=0)
    q = _vectors(16 * SEARCH_BATCH, seed=3)  # 16 batches: the kill lands while they are being answered
    want = index.search(q, 10)
    pid = group.info()[1]["pid"]
    with ThreadPoolExecutor(1) as pool:
        searching = pool.submit(index.search, q, 10)
        time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)  # a real crash of shard 1 with search calls in flight
        got = searching.result()  # retried on the restarted actor, which reloaded build "k" from its folder
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0], want[0])
    after = group.info()[1]
    assert after["pid"] != pid and "k" in after["restored"] and after["versions"]["k"] == group.versions["k"]
    index.drop()


def test_a_stalled_shard_fails_the_search_in_bounded_time_naming_it(groups, vectors) -> None:
    _, shards, _ = vectors
    group = groups[2]
    index = group.build("s", shards, IndexConfig(), "fp", "enc", 1, seed=0)
    index.timeout_s = 1.0
    pid = group.info()[1]["pid"]
    os.kill(pid, signal.SIGSTOP)  # a node that stops answering (not dead: no restart comes)
    try:
        t0 = time.monotonic()
        with pytest.raises(ShardUnavailableError, match=r"^index shard 1 did not answer a search of 's' within 1 s"):
            index.search(_vectors(4, seed=1), 5)
        assert time.monotonic() - t0 < 10
    finally:
        os.kill(pid, signal.SIGCONT)
    index.timeout_s = 60.0
    assert index.search(_vectors(4, seed=1), 5)[1].shape == (4, 5)  # answers again once resumed
    index.drop()


def test_shard_count_checks() -> None:
    nodes = [{"Alive": True, "Resources": {"CPU": 2.0, "memory": 1.0, "node:127.0.0.1": 1.0}}]
    assert resolve_shards("3", 10) == 3
    with pytest.raises(ConfigError, match=r"^index.shards=11 asks for 11 shards but the corpus has only 10 passages"):
        resolve_shards("11", 10)
    with pytest.raises(ConfigError, match=r"no node offers it \(this cluster has: CPU, memory\)"):
        resolve_shards("auto", 10, nodes)
    labelled = nodes + [
        {"Alive": True, "Resources": {"CPU": 1.0, "index_node": 1.0}},
        {"Alive": False, "Resources": {"index_node": 1.0}},
    ]
    assert resolve_shards("auto", 10, labelled) == 1


@pytest.fixture(scope="module")
def on_shards(ray_session, tmp_path_factory):
    """Retrieval with index.shards=3 over a passage store (each shard reads its rows from the store file), its
    zero-shot build evaluated, and a changed snapshot for live refresh rounds."""
    import torch

    from ragtrain.config import to_typed
    from ragtrain.corpus.load import load_data
    from ragtrain.data.store import PassageStore
    from ragtrain.pipeline.retrieval import Retrieval
    from ragtrain.pipeline.stages import initial_weights
    from tests.conftest import compose, tiny_overrides

    tmp = tmp_path_factory.mktemp("on_shards")
    over = ["index.shards=3", "retriever.train.hard_negatives=1", "refresh.enabled=true", "refresh.every_steps=2"]
    cfg = to_typed(compose([*tiny_overrides(tmp), *over]))
    out = Path(cfg.output_dir)
    out.mkdir(parents=True)
    data = load_data(cfg.data, cfg.retriever, out)
    assert isinstance(data.corpus, PassageStore)
    sharded, weights = Retrieval(cfg, data), initial_weights(cfg)
    torch.manual_seed(0)
    changed = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in weights.items()}
    try:
        built, metrics = sharded.build_and_evaluate("zeroshot", [weights], "tiny@init", 0)
        yield cfg, data, sharded, built, metrics, weights, changed
    finally:
        sharded.close()


def test_a_run_on_shards_encodes_each_range_and_evaluates_as_one_index(on_shards, capsys) -> None:
    """Each shard read its rows from the passage store and encoded them; the evaluation, the mined negatives and
    the generator's searcher equal those of one index of the same vectors; the saved folder serves `python -m
    ragtrain search`, and a missing shard there is one line naming it (exit 2). (The Ray Data encode of one
    shard against three shards' own encodes: the pipeline test below.)"""
    from omegaconf import OmegaConf

    from ragtrain.commands.search import main as search_main
    from ragtrain.commands.search import search
    from ragtrain.generator.retriever_client import IndexPayload, Searcher
    from ragtrain.pipeline.retrieval import BuiltIndex

    cfg, data, sharded, a, metrics, weights, _ = on_shards
    out = Path(cfg.output_dir)
    assert a.index.meta.extra["shards"] == 3 and a.index.meta.extra["rows_per_shard"] == [40, 40, 40]
    assert [f.split("/")[0] for f in a.shards.files] == ["shard-0", "shard-1", "shard-2"]
    assert a.shards.ids() == sharded.doc_ids == a.index.doc_ids  # corpus order, range after range
    idx = cfg.index
    one = build_from_vectors(a.shards, idx.factory, sharded.fingerprint, "tiny@init", 0, idx.precision.value, cfg.seed)
    one.set_search_params(idx.nprobe, idx.ef_search)
    b = BuiltIndex("one", one, [weights], sharded.doc_ids, {}, a.shards)
    want = sharded.evaluate(b)
    assert {k: metrics[k] for k in want} == pytest.approx(want, abs=1e-12)
    assert metrics["index_shard_peak_rss_mb"] > 0 and "index_host_peak_rss_mb" not in metrics
    assert sharded.mine_negatives(a) == sharded.mine_negatives(b)
    payload = IndexPayload.from_index(a.index, cfg.retriever, [weights], cfg.index.precision)  # searchers scatter
    questions = [data.queries[q] for q in sorted(data.eval_qrels)[:5]]
    assert Searcher(payload).search(questions, 5) == Searcher(
        IndexPayload.from_index(one, cfg.retriever, [weights], cfg.index.precision)
    ).search(questions, 5)
    a.index.save(out / "index")
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    _, hits = search(out, questions[0], k=3)
    assert [h["id"] for h in hits] == one.search_ids(sharded.encode_queries(a, sorted(data.eval_qrels)[:1]), 3)[0]
    (out / "index" / "shard-2" / "index.faiss").unlink()
    capsys.readouterr()
    assert search_main([str(out), "a question"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"search error: index shard {out / 'index' / 'shard-2'}: index.faiss is missing"]


@pytest.mark.parametrize(
    ("consistency", "fraction", "priority"),
    [("global", 1.0, "oldest"), ("aligned", 0.25, "hot"), ("eager", 0.5, "oldest")],  # the last drops the build
)
def test_a_live_round_publishes_what_its_consistency_lets_searches_see(
    on_shards, consistency, fraction, priority
) -> None:
    """One refresh round over the 3 shards: global publishes one state, all new; eager and aligned one state per
    shard, the first mixing two encoder versions; a partial round leaves the unchosen rows at version 0. Under
    eager, with the zero-shot build dropped (as a run drops it), a shard killed between rounds continues the next
    one from its persisted rows."""
    import ray

    cfg, _, sharded, built, _, weights, changed = on_shards
    r = cfg.refresh
    r.consistency, r.fraction, r.priority, r.anchors = consistency, fraction, priority, 64
    service, _ = sharded.start_service(built, weights)
    try:
        assert ray.get(service.latest.remote()).version == 0
        done = ray.get(service.refresh.remote(5, [ray.put(changed)]))
        assert done["ok"], done
        m = done["metrics"]
        assert m["index/encoded_fraction"] == pytest.approx(3 * max(1, round(fraction * 40)) / 120)
        assert {f"index/shard{i}_encode_seconds" for i in range(3)} <= set(m)
        states = ray.get(service.report.remote())["history"][-1]["state_metrics"]
        if consistency == "global":  # one state, all at the new version: searches never saw a mix
            assert len(states) == 1 and m["index/mixed_recall_at_10"] == 1.0 and m["index/mined_agreement"] == 1.0
            assert states[0]["index/version_skew"] == (0 if fraction == 1 else 1)
        else:  # a state per shard: the first mixes the new shard with two old ones
            assert len(states) == 3 and states[0]["index/version_skew"] == 1
            assert states[0]["index/newest_version_share"] == pytest.approx(max(1, round(fraction * 40)) / 120)
        assert states[-1]["index/newest_version_share"] == pytest.approx(max(1, round(fraction * 40)) / 40)
        if consistency == "global":
            _the_live_rows_survive_a_restart_and_a_failed_round(sharded, service, changed)
        if (consistency, priority) == ("eager", "oldest"):
            built.index.drop()  # as a run does once training starts: the live rows keep their own copy of it
            shard = sharded.shard_group.actors[1]
            before = ray.get(shard.live_mix.remote())
            os.kill(ray.get(shard.info.remote())["pid"], signal.SIGKILL)
            again = ray.get(service.refresh.remote(7, [ray.put(changed)]))  # restarts, reloads its rows, goes on
            assert again["ok"], again
            assert ray.get(shard.live_mix.remote()) == {1: before[1], 2: before[0]}  # round 1 kept, round 2 the rest
    finally:
        sharded.stop_service(service)


def _the_live_rows_survive_a_restart_and_a_failed_round(sharded, service, changed) -> None:
    """After a global round: every shard's applied rows are on disk (where no build's tag points: dropping the old
    tag at the barrier keeps them); a round that fails does not lend its version number to the next. (That a shard
    killed under a search comes back with these rows and the search is answered the same: the global case of
    test_a_shard_killed_during_a_round_is_restarted_and_the_round_lands_on_one_new_version, whose kill lands with
    the search in flight; a second kill here cost a shard restart, seconds of CPU, for the same check.)"""
    import ray

    root = sharded.shard_group.root
    for i in range(3):
        with np.load(root / LIVE_STATE / f"shard-{i}" / "live_state.npz") as z:
            assert z["versions"].tolist() == [1] * 40
    failed = ray.get(service.refresh.remote(7, [ray.put(None)]))  # no weights: the round fails at its first encode
    assert not failed["ok"] and "error" in failed
    again = ray.get(service.refresh.remote(9, [ray.put(changed)]))
    assert again["ok"] and again["encoder_version"] == 3, again


def _until(condition, what: str, deadline_s: float = 120.0):
    """Poll `condition` until it returns something true (returned); fail naming `what` past the deadline."""
    end = time.monotonic() + deadline_s
    while not (got := condition()):
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.02)
    return got


def _announced(root: Path, shard: int) -> dict | None:
    """fault.hold_shard_encode's announcement: the held shard's pid and the version it is encoding."""
    note = root / FAULTS / f"encoding-shard-{shard}.json"
    return json.loads(note.read_text()) if note.exists() else None


@contextmanager
def _live(sharded, built, weights, cfg, **fault):
    """A live service on the module's 3 shards with these fault hooks, the hooks' once-per-run markers cleared;
    version 0 is a build of the zero-shot vectors of its own (a test above drops the zero-shot build, as runs do)."""
    import ray

    from ragtrain.pipeline.retrieval import BuiltIndex

    shutil.rmtree(sharded.shard_group.root / FAULTS, ignore_errors=True)
    saved = replace(cfg.fault)
    for k, v in fault.items():
        setattr(cfg.fault, k, v)
    index = sharded.index_from("faults", built.shards, "tiny@init", 0)
    service = None
    try:
        start = BuiltIndex("faults", index, [weights], sharded.doc_ids, {}, built.shards)
        service, _ = sharded.start_service(start, weights)
        yield service, ray
    finally:
        cfg.fault = saved
        if service is not None:
            sharded.stop_service(service)
        index.drop()


# each test kills a shard the module's others spare: an actor is restarted at most MAX_SHARD_RESTARTS times
@pytest.mark.parametrize(("consistency", "victim"), [("global", 2), ("eager", 0)])
def test_a_shard_killed_during_a_round_is_restarted_and_the_round_lands_on_one_new_version(
    on_shards, consistency, victim
) -> None:
    """A shard announces that it is encoding version 1 (fault.hold_shard_encode) and is SIGKILLed there, the round
    still unanswered: Ray retries the encode on the restarted actor, which takes its rows back from disk, so the round
    completes, every shard's rows are at version 1 (under global the one state published never mixed versions), and
    the next round is version 2. Then (under global: a search is retried by the service whatever the consistency,
    and each shard restart costs seconds of CPU) a search held up by the stopped shard when it is killed is
    answered, after the restore, exactly as before."""
    cfg, _, sharded, built, _, weights, changed = on_shards
    r = cfg.refresh
    r.consistency, r.fraction, r.priority = consistency, 1.0, "oldest"
    root, shard = sharded.shard_group.root, sharded.shard_group.actors[victim]
    with _live(sharded, built, weights, cfg, hold_shard_encode=victim) as (service, ray):
        pid = ray.get(shard.info.remote())["pid"]
        round_ = service.refresh.remote(5, [ray.put(changed)])
        note = _until(lambda: _announced(root, victim), "the shard never announced its encode")
        assert note == {"pid": pid, "version": 1, "shard": victim}  # the round's encode is running in that process
        assert ray.wait([round_], timeout=0)[0] == []  # and the round is unanswered: the kill lands mid-round
        os.kill(pid, signal.SIGKILL)
        (root / FAULTS / f"encoding-shard-{victim}.json").unlink()
        done = ray.get(round_)
        assert done["ok"] and done["encoder_version"] == 1, done
        assert ray.get(shard.info.remote())["pid"] != pid
        assert [ray.get(a.live_mix.remote()) for a in sharded.shard_group.actors] == [{1: 40}] * 3
        states = ray.get(service.report.remote())["history"][-1]["state_metrics"]
        if consistency == "global":  # one switch: searches saw version 0 everywhere, then version 1 everywhere
            assert [s["index/version_skew"] for s in states] == [0.0]
        again = ray.get(service.refresh.remote(7, [ray.put(changed)]))
        assert again["ok"] and again["encoder_version"] == 2, again  # no version number repeats
        if consistency != "global":
            return  # a search's retry is the service's, whatever the consistency: one kill under global shows it
        queries = ray.get(shard.live_rows.remote([0, 1, 2]))
        before = ray.get(service.search.remote(queries, 5))
        pid = ray.get(shard.info.remote())["pid"]
        os.kill(pid, signal.SIGSTOP)  # the shard cannot answer: the search below waits on it
        try:
            searching = service.search.remote(queries, 5)
            assert ray.wait([searching], timeout=1.0)[0] == []  # in flight, held up by the stopped shard
        finally:
            os.kill(pid, signal.SIGKILL)  # a stopped process dies at once
        after = ray.get(searching)  # retried on the restarted shard, whose live rows come back from disk
        np.testing.assert_array_equal(after[1], before[1])
        np.testing.assert_allclose(after[0], before[0], atol=1e-6)
        assert ray.get(shard.live_mix.remote()) == {2: 40}


def test_a_shard_killed_between_the_barrier_and_its_apply_finishes_the_round_from_its_journal(on_shards) -> None:
    """Under global, shard 1 dies (fault.kill_shard_before_apply) after every search was switched to version 1 and
    before it applied the round: restarted, it finishes the round it journaled before the barrier, so the round
    completes, every shard (and its persisted state) is at version 1, no journal is left, and a search of the live
    index is an exact search over every shard's rows: one version, no mix."""
    cfg, _, sharded, built, _, weights, changed = on_shards
    r = cfg.refresh
    r.consistency, r.fraction, r.priority = "global", 1.0, "oldest"
    root, group = sharded.shard_group.root, sharded.shard_group
    with _live(sharded, built, weights, cfg, kill_shard_before_apply=1) as (service, ray):
        pid = ray.get(group.actors[1].info.remote())["pid"]
        done = ray.get(service.refresh.remote(5, [ray.put(changed)]))
        assert (root / FAULTS / "kill-before-apply-shard-1").read_text() == str(pid)  # it died there
        assert ray.get(group.actors[1].info.remote())["pid"] != pid
        assert done["ok"] and done["encoder_version"] == 1, done
        assert [ray.get(a.live_mix.remote()) for a in group.actors] == [{1: 40}] * 3
        for i in range(3):
            folder = root / LIVE_STATE / f"shard-{i}"
            assert not (folder / JOURNAL).exists()
            with np.load(folder / "live_state.npz") as z:
                assert z["versions"].tolist() == [1] * 40 and int(z["applied"]) == 1
        states = ray.get(service.report.remote())["history"][-1]["state_metrics"]
        assert [s["index/version_skew"] for s in states] == [0.0]
        rows = np.concatenate([ray.get(a.live_rows.remote(list(range(40)))) for a in group.actors])
        queries = rows[[3, 50, 117]]
        got = ray.get(service.search.remote(queries, 5))
        want = np.argsort(-(queries @ rows.T), axis=1, kind="stable")[:, :5]
        np.testing.assert_array_equal(got[1], want)


def test_a_killed_service_restarts_from_its_commit_point(on_shards) -> None:
    """After a global round the commit point (version 1, build live1) is in the run folder; the service actor is
    killed (Ray restarts it): the restarted one (its in-memory history gone) serves the committed version and build,
    the published version and the same search results, and the next round is version 2 on every shard."""
    cfg, _, sharded, built, _, weights, changed = on_shards
    r = cfg.refresh
    r.consistency, r.fraction, r.priority = "global", 1.0, "oldest"
    root, group = sharded.shard_group.root, sharded.shard_group
    with _live(sharded, built, weights, cfg) as (service, ray):
        done = ray.get(service.refresh.remote(5, [ray.put(changed)]))
        assert done["ok"] and done["encoder_version"] == 1, done
        committed = ray.get(service.committed.remote())
        assert committed == {"encoder_version": 1, "tag": "live1"} and (root / COMMIT_POINT).is_file()
        published = ray.get(service.latest.remote())
        queries = ray.get(group.actors[0].live_rows.remote([0, 1, 2]))
        before = ray.get(service.search.remote(queries, 5))
        old_pid = ray.get(service.__ray_call__.remote(lambda _: os.getpid()))
        ray.kill(service, no_restart=False)
        # the kill is asynchronous: calls go on reaching the old process until it is gone
        _until(lambda: ray.get(service.__ray_call__.remote(lambda _: os.getpid())) != old_pid, "no restart", 120)
        assert ray.get(service.committed.remote()) == committed  # answered by the restarted actor
        assert ray.get(service.report.remote())["history"] == []  # a new process: nothing of the old one's memory
        again = ray.get(service.latest.remote())
        assert again.version == published.version and again.negatives == published.negatives
        after = ray.get(service.search.remote(queries, 5))
        np.testing.assert_array_equal(after[1], before[1])
        np.testing.assert_allclose(after[0], before[0], atol=1e-6)
        nxt = ray.get(service.refresh.remote(7, [ray.put(changed)]))
        assert nxt["ok"] and nxt["encoder_version"] == 2 and nxt["version"] == published.version + 1, nxt
        assert [ray.get(a.live_mix.remote()) for a in group.actors] == [{2: 40}] * 3
    assert not (root / COMMIT_POINT).exists()  # the live index ended: nothing for a later service to resume


class _LateApplyShard(_Shard):
    """An index shard whose live apply waits while `<root>/.faults/late-apply` exists: one that does not answer
    its apply within refresh.timeout_s, after the barrier switched every search."""

    def live_apply(self, version: int, kill_shard: int = -1) -> dict:
        gate = self.root / FAULTS / "late-apply"
        while gate.exists():
            time.sleep(0.05)
        return super().live_apply(version, kill_shard)


def test_an_apply_that_times_out_after_the_barrier_is_committed_late_not_failed(on_shards) -> None:
    """Shard 1 does not answer its apply within refresh.timeout_s, after the barrier: the round is reported
    committed late (searches switched to version 1 and stay there), not failed; once the shard answers it holds
    version 1 like the others, searches are exact over every shard's rows, and the next round is version 2."""
    import ray

    cfg, _, sharded, built, _, weights, changed = on_shards
    r = cfg.refresh
    r.consistency, r.fraction, r.priority = "global", 1.0, "oldest"
    root, group = sharded.shard_group.root, sharded.shard_group
    from ragtrain.embed.precision import resolved_index

    real, timeout = group.actors[1], r.timeout_s
    late = ray.remote(num_cpus=0, max_concurrency=4)(_LateApplyShard).remote(1, str(root))
    # its first encoder load imports torch (seconds on a busy box): done here, so the round's encode is quick
    ray.get(late.encode_few.remote(0, [ray.put(weights)], cfg.retriever, resolved_index(cfg), ["warm"], "query"))
    group.actors[1], r.timeout_s = late, 20.0  # encodes and builds answer within it; the held apply does not
    try:
        with _live(sharded, built, weights, cfg) as (service, _):
            gate = root / FAULTS / "late-apply"
            gate.parent.mkdir(parents=True, exist_ok=True)
            gate.touch()
            done = ray.get(service.refresh.remote(5, [ray.put(changed)]))
            gate.unlink()
            assert done["ok"] and done["committed_late"] and done["encoder_version"] == 1, done
            assert "index shard 1 did not answer a live refresh call within 20 s (refresh.timeout_s)" in done["late"]
            assert ray.get(service.committed.remote()) == {"encoder_version": 1, "tag": "live1"}
            assert ray.get(service.report.remote())["failures"] == []
            _until(lambda: ray.get(late.live_mix.remote()) == {1: 40}, "the late apply never landed", 60)
            assert [ray.get(a.live_mix.remote()) for a in group.actors] == [{1: 40}] * 3
            rows = np.concatenate([ray.get(a.live_rows.remote(list(range(40)))) for a in group.actors])
            queries = rows[[3, 50, 117]]
            got = ray.get(service.search.remote(queries, 5))
            np.testing.assert_array_equal(got[1], np.argsort(-(queries @ rows.T), axis=1, kind="stable")[:, :5])
            again = ray.get(service.refresh.remote(7, [ray.put(changed)]))
            assert again["ok"] and not again.get("committed_late") and again["encoder_version"] == 2, again
    finally:
        group.actors[1], r.timeout_s = real, timeout
        ray.kill(late)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("index.shards=121",), r"^index.shards=121 asks for 121 shards but the corpus has only 120 passages"),
        (
            ("index.shards=auto",),
            r"^index.shards=auto places one shard per node offering the 'index_node' resource, "
            r"but no node offers it \(this cluster has: CPU, memory, object_store_memory\): start",
        ),
        (
            ("index.shards=2", "fault.kill_encode_actor_at_batch=0"),
            r"^fault.kill_encode_actor_at_batch kills a Ray Data",
        ),
    ],
)
def test_shard_settings_the_run_cannot_serve_fail_before_any_work(ray_session, tmp_path, overrides, match) -> None:
    from ragtrain.config import to_typed
    from ragtrain.pipeline.stages import run
    from tests.conftest import compose, tiny_overrides

    cfg = to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp_path), *overrides]))
    with pytest.raises(ConfigError, match=match):
        run(cfg)
    assert not (Path(cfg.output_dir) / "config.yaml").exists()  # not taken for a run
    assert not (Path(cfg.output_dir) / "shards").exists()


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_shard_count_that_is_not_one_is_refused_by_the_config(value) -> None:
    with pytest.raises(ConfigError, match=rf"^index.shards must be a positive number of shards or auto .*'{value}'"):
        IndexConfig(shards=value)


def test_a_sharded_quickstart_gives_the_figures_of_one_index(quickstart_run, tmp_path) -> None:
    """The shared quickstart (index.shards=1: one Ray Data encode, one shard) and its index stage at index.shards=2
    (each shard encodes its own range) give the same figures; the saved 2-shard folder serves the generator's
    searcher as it ranks in-process. (The trained index is the same build with other weights: an index-only run of
    the initial encoder checks the sharding without a second training. Two shards, not three: the run starts its
    shard actors twice, once to encode and once in the generator's load, each costing seconds of CPU to start, and
    two already split the corpus into ranges encoded apart.)"""
    from ragtrain.config import to_typed
    from ragtrain.pipeline.stages import run
    from tests.conftest import compose, quickstart_overrides

    one = quickstart_run[1]
    two = run(
        to_typed(
            compose(
                [
                    *quickstart_overrides(tmp_path / "2"),
                    "logger=none",
                    "index.shards=2",
                    "stages=[index]",
                    "index.align_anchors=0",
                ]
            )
        )
    )
    assert "trained" not in two
    for key in ("ndcg@10", "mrr@10", "recall@100"):
        assert two["zeroshot"][key] == pytest.approx(one["zeroshot"][key], abs=1e-9), key
    saved = tmp_path / "2" / "out" / "index"
    assert open_saved(saved).meta.extra["shards"] == 2 and sorted(p.name for p in saved.glob("shard-*")) == [
        "shard-0",
        "shard-1",
    ]
    # stages=[generator]: the saved sharded folder is checked in-process, then loaded into shard actors
    from ragtrain.corpus.load import load_data
    from ragtrain.generator.retriever_client import Searcher
    from ragtrain.generator.stage import resolve_index
    from ragtrain.index.sharded import ShardedIndex

    cfg = to_typed(compose([*quickstart_overrides(tmp_path / "2"), "index.shards=2"]))
    data = load_data(cfg.data, cfg.retriever)
    payload = resolve_index(cfg, data, None, Path(cfg.output_dir))
    assert isinstance(payload.index, ShardedIndex)
    questions = [data.queries[q] for q in sorted(data.eval_qrels)[:3]]
    assert Searcher(payload).search(questions, 4) == [
        open_saved(saved).search_ids(q, 4)[0]
        for q in (Searcher(payload).encode([t], cfg.retriever.query_max_length) for t in questions)
    ]


def _swap_first_ids(path: Path) -> None:
    lines = path.read_text().splitlines()
    lines[0], lines[1] = lines[1], lines[0]
    path.write_text("\n".join(lines) + "\n")


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc, indent=2))


def _swap_ranges(doc: dict) -> None:  # shard 0 and 1 "hold" each other's rows: rows still add up
    a, b = doc["shards"][0], doc["shards"][1]
    for k in ("start", "stop", "rows"):
        a[k], b[k] = b[k], a[k]


# (file, its damage, the message): every file a search of a saved sharded index reads
DAMAGES = {
    "shard ids": ("shard-1/doc_ids.txt", _swap_first_ids, r"shard-1 is corrupt: doc_ids.txt does not match"),
    "shard meta": (
        "shard-0/index_meta.json",
        lambda p: _edit_json(p, lambda d: d.update(encoder="other@x")),
        r"shard-0 is corrupt: index_meta.json does not match",
    ),
    "shard manifest": (
        "shard-1/manifest.json",
        lambda p: _edit_json(p, lambda d: d.update(start=d["start"] + 1)),
        r"shard-1/manifest.json does not match the checksum in .*sharded.json",
    ),
    "shard list": (
        "sharded.json",
        lambda p: _edit_json(p, _swap_ranges),
        r"sharded.json does not match its own checksum",
    ),
    "top meta": (
        "index_meta.json",
        lambda p: _edit_json(p, lambda d: d.update(ntotal=d["ntotal"] - 1)),
        r"index/index_meta.json does not match the checksum in .*sharded.json",
    ),
    "top meta truncated": (
        "index_meta.json",
        lambda p: p.write_bytes(p.read_bytes()[:40]),
        r"index/index_meta.json does not match the checksum in .*sharded.json",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_every_file_a_saved_sharded_index_is_searched_with_is_checked(groups, vectors, tmp_path, damage) -> None:
    """Edits to a saved index's files other than index.faiss gave other passages' ids with exit 0."""
    _, shards, _ = vectors
    index = groups[2].build("checked", shards, IndexConfig(), "fp", "enc", 1, seed=0)
    out = index.save(tmp_path / "index")
    index.drop()
    open_saved(out)  # as saved: it loads
    name, edit, match = DAMAGES[damage]
    edit(out / name)
    with pytest.raises(IndexMismatchError, match=match):
        open_saved(out)


def test_the_list_of_shards_is_checked_for_consistency(groups, vectors, tmp_path) -> None:
    """A list of shards whose checksum holds (rewritten by a tool) must still describe one index: contiguous
    ranges that add up to the metadata's rows, every shard of one dim, metric, factory and encoder."""
    from ragtrain.index.integrity import seal_shard_list
    from ragtrain.index.sharded import SHARDED

    _, shards, _ = vectors
    index = groups[2].build("listed", shards, IndexConfig(), "fp", "enc", 1, seed=0)
    out = index.save(tmp_path / "index")
    index.drop()
    saved = json.loads((out / SHARDED).read_text())

    def resealed(edit) -> None:
        doc = json.loads(json.dumps(saved))
        edit(doc)
        (out / SHARDED).write_text(json.dumps(seal_shard_list(doc), indent=2))

    resealed(_swap_ranges)
    with pytest.raises(
        IndexMismatchError, match=r"shard-0 holds rows \[200, 400\) but .*manifest.json says \[0, 200\)"
    ):
        open_saved(out)
    resealed(lambda d: d["shards"].pop())
    with pytest.raises(IndexMismatchError, match=r"the shards hold rows \[0, 200\), its index_meta.json 400"):
        open_saved(out)
    resealed(lambda d: None)
    open_saved(out)
    _edit_json(out / "shard-1" / MANIFEST, lambda d: d.update(encoder="other@x"))
    m1 = out / "shard-1" / MANIFEST  # a shard of another encoder, listed with its manifest's checksum
    resealed(lambda d: d["shards"][1].update(manifest=_sha256(m1)))
    with pytest.raises(IndexMismatchError, match=r"shard-1 was built by encoder 'other@x', the index by 'enc'"):
        open_saved(out)


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("damage", ["top meta truncated", "shard ids"])
def test_search_of_a_damaged_saved_index_is_one_line_and_exit_2(groups, vectors, tmp_path, capsys, damage) -> None:
    """`python -m ragtrain search <run> "q"` on a run whose saved index was damaged: one line naming the file."""
    from omegaconf import OmegaConf

    from ragtrain.commands.search import main as search_main
    from ragtrain.config import to_typed
    from tests.conftest import compose, tiny_overrides

    _, shards, _ = vectors
    out = tmp_path / "run"
    index = groups[2].build("searched", shards, IndexConfig(), "fp", "enc", 1, seed=0)
    index.save(out / "index")
    index.drop()
    cfg = to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp_path)]))
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    name, edit, match = DAMAGES[damage]
    edit(out / "index" / name)
    capsys.readouterr()
    assert search_main([str(out), "a question"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("search error: ") and re.search(match, err[0]), err


class _GpuCopy:
    """Stands for a shard's FAISS GPU copy (no GPU here): searches the CPU build, and refuses k > 2048 with FAISS's
    GPU message, as GpuIndex::search does."""

    def __init__(self, cpu) -> None:
        self.cpu, self.ks = cpu, []

    @property
    def ntotal(self) -> int:
        return self.cpu.ntotal

    def search(self, q, k):
        self.ks.append(k)
        if k > 2048:
            raise RuntimeError("Error: 'k > 0 && k <= (idx_t)getMaxKSelection()' failed: GPU index only supports "
                               "min/max-K selection up to 2048 (requested 3000)")  # fmt: skip
        return self.cpu.search(q, k)


def test_a_gpu_shard_answers_searches_deeper_than_the_gpu_limit_from_its_cpu_build(tmp_path) -> None:
    """index.device=cuda: a shard searches on its GPU copy up to FAISS's GPU limit of k = 2048, and deeper
    searches (hard-negative mining, MaxP over chunks ask for more) on the CPU build it keeps, with the same ranking."""
    from ragtrain.index.faiss_index import build_index
    from ragtrain.index.sharded import _Shard

    x = _vectors(3000)
    build = build_index(x, [f"d{i}" for i in range(3000)], "Flat", "fp", "enc")
    shard = _Shard(0, str(tmp_path), device="cuda")
    gpu = _GpuCopy(build.index)
    shard.indexes["t"], shard.on_gpu["t"] = build, gpu
    for k in (10, 2048, 3000):
        scores, rows = shard.search("t", x[:4], k)
        assert rows.shape == (4, k) and (rows[:, 0] == np.arange(4)).all()
        np.testing.assert_array_equal(rows, build.search(x[:4], k)[1])
    assert gpu.ks == [10, 2048]  # 3000 went to the CPU build


def test_ivf_nprobe_past_the_gpu_limit_is_refused_for_a_gpu_index() -> None:
    with pytest.raises(ConfigError, match=r"^index.nprobe must be <= 2048 with index.device=cuda"):
        IndexConfig(device="cuda", factory="IVF4096,Flat", nprobe=4096)
    assert IndexConfig(device="cpu", factory="IVF4096,Flat", nprobe=4096).nprobe == 4096
