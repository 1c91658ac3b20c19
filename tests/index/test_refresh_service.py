"""Live refresh over index shards: partial re-encoding by priority, the consistency policies, the version-mix
metrics, and a restarted shard continuing from its persisted round (real Ray actors, real FAISS)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import numpy as np
import pytest

from ragtrain.config import to_typed
from ragtrain.config.index import RefreshConfig
from ragtrain.embed.align import fit_alignment
from ragtrain.index.checks import check_refresh
from ragtrain.index.consistency import POLICIES
from ragtrain.index.consistency.aligned import Aligned
from ragtrain.index.consistency.eager import Eager
from ragtrain.index.consistency.global_ import Global
from ragtrain.index.live_rows import JOURNAL, LiveRows, version_summary
from ragtrain.index.priority import PRIORITIES
from ragtrain.index.priority.base import RoundRows, by_score
from ragtrain.index.priority.drift import predict_drift
from ragtrain.index.refresh_service import mined_agreement, mixed_recall, node_traffic
from ragtrain.index.sharded import ShardUnavailableError
from ragtrain.runtime.errors import ConfigError
from tests.conftest import compose, tiny_overrides


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _round(versions: np.ndarray, budget: int, cursor: int, hot: np.ndarray | None = None, vectors=None) -> RoundRows:
    n = len(versions)
    stored = np.eye(n, dtype=np.float32) if vectors is None else vectors
    return RoundRows(stored, versions, cursor, budget, 1, 0, hot, lambda rows: -stored[rows])


def _chosen(priority: str, r: RoundRows) -> list[int]:
    choice = PRIORITIES[priority]().choose(r)
    return sorted([*choice.encoded_rows.tolist(), *choice.rows.tolist()])


def test_oldest_is_round_robin_hot_takes_counts_first_drift_takes_the_largest() -> None:
    versions = np.zeros(10, dtype=np.int64)
    assert _chosen("oldest", _round(versions, 4, cursor=8)) == [0, 1, 8, 9]
    hot = np.array([0, 5, 0, 0, 9, 0, 0, 0, 0, 1])
    assert _chosen("hot", _round(versions, 3, cursor=0, hot=hot)) == [1, 4, 9]
    assert _chosen("hot", _round(versions, 5, cursor=6, hot=hot)) == [1, 4, 6, 7, 9]  # then by age
    assert sorted(by_score(np.linspace(0, 1, 10), _round(versions, 2, cursor=0), 2).tolist()) == [8, 9]
    # drift: a seeded sample (10 % of the budget) is encoded first; rows near a sampled row that moved come next.
    # Rows 0-19 lie near one axis and move (their new vector is the opposite one), rows 20-39 near another and stay.
    near = _unit(np.repeat(np.eye(2), 20, axis=0) + 0.01 * np.random.default_rng(0).normal(size=(40, 2)))
    r = RoundRows(
        near,
        np.zeros(40, dtype=np.int64),
        0,
        20,
        1,
        1,
        None,
        lambda rows: np.where(rows[:, None] < 20, -near[rows], near[rows]),
    )
    choice = PRIORITIES["drift"]().choose(r)
    assert choice.encoded_rows.tolist() == [13, 20]  # the seed's sample: one row of each kind
    assert len(choice.rows) == 18 and all(row < 20 for row in choice.rows)  # the moving kind, the sample aside
    assert _chosen("drift", _round(versions, 10, cursor=3)) == list(range(10))  # a full round needs no sample


def test_drift_of_unsampled_rows_is_their_nearest_sampled_rows() -> None:
    stored = _unit(np.array([[1, 0], [0.9, 0.1], [0, 1], [0.1, 0.9]], dtype=np.float32))
    predicted = predict_drift(stored, np.array([0, 2]), np.array([0.5, 0.01]))
    assert predicted.tolist() == [0.5, 0.5, 0.01, 0.01]


def test_a_partial_round_encodes_its_share_applies_it_and_a_restart_continues_from_disk(tmp_path) -> None:
    rng = np.random.default_rng(0)
    old = _unit(rng.normal(size=(40, 8)))
    new = _unit(rng.normal(size=(40, 8)))
    texts = [str(i) for i in range(40)]
    rows = LiveRows(tmp_path, old, lambda local: [texts[i] for i in local])

    def encode(batch: list[str]) -> np.ndarray:
        return new[[int(t) for t in batch]]

    for version, want in ((1, range(0, 10)), (2, range(10, 20))):  # oldest: round robin over the rows
        stats = rows.encode_round(version, encode, 0.25, PRIORITIES["oldest"](), None, seed=0)
        assert stats["encoded"] == 10
        assert rows.apply(version) == {0: 40 - 10 * version, **{v: 10 for v in range(1, version + 1)}}
        np.testing.assert_array_equal(rows.vectors[list(want)], new[list(want)])
    np.testing.assert_array_equal(rows.vectors[20:], old[20:])  # the rest keep their vectors
    again = LiveRows(tmp_path, old, lambda local: [texts[i] for i in local])  # a restarted shard
    assert again.mix() == rows.mix() and again.cursor == 20
    np.testing.assert_array_equal(again.vectors, rows.vectors)
    with pytest.raises(RuntimeError, match="no pending round of version 3"):
        again.apply(3)
    drift = rows.encode_round(
        3, encode, 0.25, PRIORITIES["drift"](), None, seed=0
    )  # a sample first, then the predicted rest
    assert drift["encoded"] == 10


def test_a_round_lands_in_a_staged_build_first_and_moves_the_cursor_only_when_applied(tmp_path) -> None:
    """global builds the new rows in before applying them; a round that never lands (its shard restarted, say)
    leaves its rows next in turn, and the persisted state the last applied round's."""
    rng = np.random.default_rng(2)
    old, new = _unit(rng.normal(size=(20, 8))), _unit(rng.normal(size=(20, 8)))
    rows = LiveRows(tmp_path, old, lambda local: [str(i) for i in local])

    def encode(batch: list[str]) -> np.ndarray:
        return new[[int(t) for t in batch]]

    rows.encode_round(1, encode, 0.25, PRIORITIES["oldest"](), None, seed=0)
    staged = rows.staged(1)
    np.testing.assert_array_equal(staged[:5], new[:5])
    np.testing.assert_array_equal(staged[5:], old[5:])
    np.testing.assert_array_equal(rows.vectors, old)  # nothing stored yet
    with pytest.raises(RuntimeError, match="no pending round of version 2"):
        rows.staged(2)
    rows.encode_round(
        2, encode, 0.25, PRIORITIES["oldest"](), None, seed=0
    )  # round 1 never landed: the same rows again
    assert rows.pending[1].tolist() == [0, 1, 2, 3, 4] and rows.cursor == 0
    rows.apply(2)
    assert rows.cursor == 5 and rows.mix() == {0: 15, 2: 5}


def test_a_journaled_round_is_finished_when_committed_and_dropped_when_not(tmp_path) -> None:
    """A staged round is journaled before the barrier; a shard restarted after it finishes the round the service
    committed (its apply, retried, is then a no-op), and drops one it did not commit (a round that failed before
    the barrier), keeping the last applied state."""
    rng = np.random.default_rng(3)
    old, new = _unit(rng.normal(size=(20, 8))), _unit(rng.normal(size=(20, 8)))

    def encode(batch: list[str]) -> np.ndarray:
        return new[[int(t) for t in batch]]

    def restarted() -> LiveRows:
        return LiveRows(tmp_path, old, lambda local: [str(i) for i in local])

    for committed, want in ((0, "rolled back"), (1, "rolled forward")):
        rows = restarted()
        rows.encode_round(1, encode, 0.5, PRIORITIES["oldest"](), None, seed=0)
        rows.journal(1)  # then the shard dies, before its apply
        again = restarted()
        assert again.resolve(committed) == want and not (tmp_path / JOURNAL).exists()
        if committed == 0:
            assert again.mix() == {0: 20} and again.cursor == 0
            np.testing.assert_array_equal(again.vectors, old)
    assert again.mix() == {0: 10, 1: 10} and again.cursor == 10 and again.applied == 1
    np.testing.assert_array_equal(again.vectors[:10], new[:10])
    assert again.apply(1) == {0: 10, 1: 10}  # the service's apply, retried on the restarted shard
    assert restarted().mix() == {0: 10, 1: 10} and restarted().resolve(1) is None  # persisted, nothing journaled


def test_eager_mixes_versions_and_aligned_maps_the_old_rows_into_the_new_space() -> None:
    """Half the rows re-encoded by a new encoder that rotates the space: eager searches a mix and misses what a
    consistent index finds; aligned maps the old half through the map fitted on anchors and finds it all."""
    rng = np.random.default_rng(1)
    old = _unit(rng.normal(size=(200, 16)))
    rot = np.linalg.qr(rng.normal(size=(16, 16)))[0]
    new = _unit(old @ rot)
    rows = LiveRows.__new__(LiveRows)
    rows.vectors, rows.versions = old.copy(), np.zeros(200, dtype=np.int64)
    rows.vectors[:100], rows.versions[:100] = new[:100], 1
    queries = _unit(new[:20] + 0.05 * rng.normal(size=(20, 16)))  # queries from the new encoder
    eager = mixed_recall(queries, rows.searchable(), new)
    anchors = rng.choice(200, size=32, replace=False)
    maps = {0: fit_alignment(old[anchors], new[anchors]).weight}
    aligned = mixed_recall(queries, rows.searchable(maps), new)
    assert aligned == pytest.approx(1.0) and eager < 0.9
    # the hard negatives mined from each state (depth 10 past the top 1, the gold row excluded) agree likewise
    gold = [[i] for i in range(20)]
    agree = {name: mined_agreement(queries, v, new, gold, 10, 1) for name, v in
             (("eager", rows.searchable()), ("aligned", rows.searchable(maps)), ("consistent", new))}  # fmt: skip
    assert agree["consistent"] == 1.0 and agree["aligned"] == pytest.approx(1.0) and agree["eager"] < 0.9
    s = version_summary([rows.mix()], {0: 0, 1: 30}, step=40)
    assert s == {
        "index/version_skew": 1.0,
        "index/newest_version_share": 0.5,
        "index/oldest_version_share": 0.5,
        "index/staleness_steps": 40.0,
        "index/version_count": 2.0,
    }


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("fraction", 0.0, r"^refresh.fraction must be in \(0, 1\]"),
        ("fraction", 1.5, r"^refresh.fraction must be in \(0, 1\]"),
        ("search_probe", -1, r"^refresh.search_probe must be >= 0"),
    ],
)
def test_bad_refresh_settings_name_the_key_and_the_choices(key, value, match) -> None:
    with pytest.raises(ConfigError, match=match):
        RefreshConfig(enabled=True, every_steps=2, **{key: value})


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("consistency", "lazy", r"^refresh.consistency='lazy' is not a known choice; valid choices: \['global', "),
        ("priority", "random", r"^refresh.priority='random' is not a known choice; valid choices: \['oldest', "),
    ],
)
def test_an_unknown_variant_is_refused_with_the_registrys_names(key, value, match) -> None:
    with pytest.raises(ConfigError, match=match):
        check_refresh(RefreshConfig(enabled=True, every_steps=2, **{key: value}))


def test_an_unknown_variant_on_the_command_line_is_one_line_and_exit_2(tmp_path) -> None:
    from tests.test_checks import _cli

    # a partial refresh (fraction < 1): one that re-encodes every row reads no priority, and says so first
    r = _cli(
        tmp_path, "refresh.enabled=true", "refresh.every_steps=2", "refresh.fraction=0.5", "refresh.priority=newest"
    )
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert (
        last
        == "config error: refresh.priority='newest' is not a known choice; valid choices: ['oldest', 'drift', 'hot']"
    )
    assert "Traceback" not in r.stderr and not (tmp_path / "out" / "config.yaml").exists()


def test_anchors_under_a_policy_that_reads_none_warn() -> None:
    from ragtrain.index.checks import refresh_warnings

    eager = RefreshConfig(enabled=True, every_steps=2, consistency="eager", anchors=512)
    assert refresh_warnings(eager) == ["refresh.anchors=512 is read only by refresh.consistency=aligned (eager here)"]
    assert refresh_warnings(RefreshConfig(enabled=True, every_steps=2, consistency="aligned", anchors=512)) == []


def test_a_registered_variant_is_a_valid_choice(monkeypatch) -> None:
    """Adding a variant is its class and one registry line: the checks accept its name from then on."""

    class Patient(Eager):  # e.g. a policy that waits for half the shards before landing any
        pass

    monkeypatch.setitem(POLICIES, "patient", Patient)
    check_refresh(RefreshConfig(enabled=True, every_steps=2, consistency="patient"), dim=8, rows=100)


def test_aligned_with_fewer_anchors_than_the_dimension_fails_before_any_work(ray_session, tmp_path) -> None:
    from ragtrain.pipeline.stages import run

    over = ["refresh.enabled=true", "refresh.every_steps=2", "refresh.consistency=aligned", "refresh.anchors=16"]
    cfg = to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp_path), *over]))
    with pytest.raises(ConfigError, match=r"^refresh.anchors=16: refresh.consistency=aligned fits a 64 x 64 map"):
        run(cfg)
    assert not (tmp_path / "out" / "config.yaml").exists()


def test_ties_go_to_the_oldest_vectors() -> None:
    """Rows nobody retrieved (count 0) are taken oldest version first, not always from the same place."""
    versions = np.array([3, 3, 0, 3, 1, 0, 3, 3])
    hot = np.array([0, 0, 0, 0, 0, 0, 5, 0])
    assert _chosen("hot", _round(versions, 3, cursor=0, hot=hot)) == [2, 5, 6]
    assert sorted(by_score(np.zeros(8), _round(versions, 3, cursor=0), 3).tolist()) == [2, 4, 5]


class _Round:
    """A `RefreshRound` that records, in order, what its policy asks of it; the shard call `fail` raises."""

    def __init__(self, fail: str | None = None) -> None:
        self.version, self.shards, self.kill_before_apply = 4, [0, 1, 2], -1
        self.fail, self.asked, self._tag = fail, [], "live3"

    @property
    def tag(self) -> str:
        return self._tag

    def finished_encodes(self):
        for shard in (2, 0, 1):  # the order the encodes finish in
            self.asked.append(("encoded", shard))
            yield shard

    def call(self, shards, method, *args):
        self.asked.append((method, tuple(shards), *args))
        if method == self.fail:
            raise ShardUnavailableError(f"index shard 1 did not answer {method}")
        return [{}] * len(shards)

    def barrier(self):
        self.asked.append(("barrier",))
        return nullcontext()

    def discard(self, tag: str) -> None:
        self.asked.append(("discard", tag))

    def commit(self, tag: str) -> None:
        self.asked.append(("commit", tag))
        self._tag = tag

    def advance(self) -> None:
        self.asked.append(("advance",))

    def align(self):
        self.asked.append(("align",))
        return {3: "the map of version 3"}

    def publish(self) -> None:
        self.asked.append(("publish",))


def test_global_commits_once_after_every_shard_built_then_applies() -> None:
    """Every encode, then every shard's staged build under the barrier, one commit, then the applies and one
    published state: searches switch once. An apply that fails comes after the commit (the service reports the
    round committed late); a build that fails discards the staged builds and commits nothing."""
    r = _Round()
    Global().land(r)
    assert r.asked == [
        ("encoded", 2), ("encoded", 0), ("encoded", 1), ("barrier",), ("live_build", (0, 1, 2), "live4", {}, 4),
        ("commit", "live4"), ("live_apply", (0, 1, 2), 4, -1), ("publish",),
    ]  # fmt: skip
    late = _Round(fail="live_apply")
    with pytest.raises(ShardUnavailableError):
        Global().land(late)
    assert ("commit", "live4") in late.asked and late.asked[-1][0] == "live_apply"
    failed = _Round(fail="live_build")
    with pytest.raises(ShardUnavailableError):
        Global().land(failed)
    assert failed.asked[-1] == ("discard", "live4") and not any(a[0] == "commit" for a in failed.asked)


def test_eager_lands_each_shard_as_its_encode_finishes_and_aligned_rebuilds_every_shard() -> None:
    r = _Round()
    Eager().land(r)
    assert r.asked[:5] == [("encoded", 2), ("live_apply", (2,), 4), ("advance",), ("live_build", (2,), "live3", {}),
                           ("publish",)]  # fmt: skip
    assert len(r.asked) == 15 and not any(a[0] in ("commit", "barrier") for a in r.asked)
    a = _Round()
    Aligned().land(a)
    assert a.asked[:6] == [
        ("encoded", 2), ("live_apply", (2,), 4), ("advance",), ("align",),
        ("live_build", (0, 1, 2), "live3", {3: "the map of version 3"}), ("publish",),
    ]  # fmt: skip


def test_only_a_policy_with_a_barrier_takes_the_fault_between_barrier_and_apply(monkeypatch, tmp_path) -> None:
    """The check reads the policy class's `has_barrier` (no name is hard-coded): eager has none and is refused
    naming the key; global, and a newly registered policy with a barrier, take it."""
    over = ["refresh.enabled=true", "refresh.every_steps=5", "fault.kill_shard_before_apply=0"]
    cfg = to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp_path), *over, "refresh.consistency=eager"]))
    with pytest.raises(
        ConfigError,
        match=r"^fault.kill_shard_before_apply kills a shard between the barrier and the apply of "
        r"refresh.consistency=global, and refresh.consistency=eager has no barrier, got 0$",
    ):
        check_refresh(cfg.refresh, fault=cfg.fault)
    check_refresh(replace(cfg.refresh, consistency="global"), fault=cfg.fault)
    check_refresh(cfg.refresh)  # no fault settings given: the names alone

    class Fenced(Eager):
        has_barrier = True

    monkeypatch.setitem(POLICIES, "fenced", Fenced)
    check_refresh(replace(cfg.refresh, consistency="fenced"), fault=cfg.fault)
    with pytest.raises(ConfigError, match=r"apply of refresh.consistency=global/fenced, and .*eager has no barrier"):
        check_refresh(cfg.refresh, fault=cfg.fault)


def test_a_fault_hook_the_policy_has_no_place_for_is_one_line_and_exit_2_before_any_work(tmp_path) -> None:
    from tests.test_checks import _cli

    over = ["refresh.enabled=true", "refresh.every_steps=2", "refresh.consistency=eager"]
    r = _cli(tmp_path, *over, "fault.kill_shard_before_apply=0")
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: fault.kill_shard_before_apply kills a shard between the barrier and")
    assert "Traceback" not in r.stderr and not (tmp_path / "out" / "config.yaml").exists()


def test_a_rounds_bytes_count_each_node_once_and_need_every_shards_counters() -> None:
    """Two shards of one node read the same counters over overlapping spans: the node counts once, at the larger
    reading; the nodes add up. A shard without counters leaves the figure out rather than undercount it."""
    mb = 1_000_000
    encoded = [
        {"node": "a", "rx_bytes": 90 * mb, "tx_bytes": 1 * mb},
        {"node": "a", "rx_bytes": 91 * mb, "tx_bytes": 2 * mb},
        {"node": "b", "rx_bytes": 45 * mb, "tx_bytes": 3 * mb},
    ]
    assert node_traffic(encoded) == {"index/round_rx_mb": 136.0, "index/round_tx_mb": 5.0}
    assert node_traffic([*encoded, {"shard": 3}]) == {}
    assert node_traffic([]) == {}
