"""Hard-negative candidates: gold removed first, then the top non-gold ranks skipped (the false-negative guard)."""

from __future__ import annotations

from ragtrain.index.mining import hard_negative_candidates


def test_skip_top_counts_non_gold_ranks_only() -> None:
    ranked = ["gold", "likely_false_negative", "b", "c", "d"]
    # gold at rank 1 and skip_top=1: the passage at rank 2, the likeliest false negative, is the one skipped
    assert hard_negative_candidates(ranked, {"gold"}, skip_top=1) == ["b", "c", "d"]
    assert hard_negative_candidates(ranked, {"gold"}, skip_top=0) == ["likely_false_negative", "b", "c", "d"]


def test_gold_anywhere_is_never_a_candidate() -> None:
    ranked = [7, 3, 9, 1, 4, 8]
    assert hard_negative_candidates(ranked, {3, 4}, skip_top=2) == [1, 8]
    assert hard_negative_candidates(ranked, set(), skip_top=6) == []


# --- false-negative control on hand-made scores ---------------------------------------------------------------

import types  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from ragtrain.config.retriever import RetrieverTrainConfig  # noqa: E402
from ragtrain.index.mining import MiningSpec, mine_rows, positive_scores  # noqa: E402
from ragtrain.retriever.batching import TrainData, TrainExample, local_batch  # noqa: E402
from ragtrain.runtime.errors import ConfigError  # noqa: E402

RANKED = ["gold", "a", "b", "c", "d"]
SCORES = [0.90, 0.88, 0.80, 0.70, 0.50]


def test_margin_drops_candidates_above_a_share_of_the_positive() -> None:
    # (1 - 0.1) x 0.9 = 0.81: "a" (0.88) is a likely false negative, "b" (0.80) is kept
    assert hard_negative_candidates(RANKED, {"gold"}, 0, SCORES, positive_score=0.9, margin=0.1) == ["b", "c", "d"]
    # margin 0 drops only candidates scoring above the positive itself
    assert hard_negative_candidates(RANKED, {"gold"}, 0, SCORES, positive_score=0.85, margin=0.0) == ["b", "c", "d"]
    # the positive's score is the query's, not the top search score: a low positive drops more
    assert hard_negative_candidates(RANKED, {"gold"}, 0, SCORES, positive_score=0.6, margin=0.1) == ["d"]


def test_absolute_ceiling_and_filters_are_independent() -> None:
    assert hard_negative_candidates(RANKED, {"gold"}, 0, SCORES, max_score=0.75) == ["c", "d"]
    # skip_top=1 and the margin both remove "a": each is a filter on the non-gold ranking, they do not add up
    assert hard_negative_candidates(RANKED, {"gold"}, 1, SCORES, positive_score=0.9, margin=0.05) == ["b", "c", "d"]
    # the stricter of margin and ceiling wins
    assert hard_negative_candidates(RANKED, {"gold"}, 0, SCORES, positive_score=0.9, margin=0.05, max_score=0.6) == [
        "d"
    ]
    with pytest.raises(ValueError, match="positive"):
        hard_negative_candidates(RANKED, {"gold"}, 0, SCORES, margin=0.1)


class _FakeIndex:
    """index.search returning hand-made (scores, rows), -1 padded like FAISS."""

    def __init__(self, scores, rows, doc_ids=None):
        self.scores, self.rows, self.doc_ids = np.array(scores, np.float32), np.array(rows), doc_ids

    def search(self, qvecs, k):
        return self.scores[:, :k], self.rows[:, :k]


def _vectors():
    # 2-d unit vectors; query 0 = [1, 0]; its gold (row 4) scores 0.8, below every retrieved candidate but one
    q = np.array([[1.0, 0.0]], np.float32)
    angles = {0: 0.1, 1: 0.3, 2: 0.5, 3: 1.2, 4: np.arccos(0.8)}
    vecs = np.array([[np.cos(angles[i]), np.sin(angles[i])] for i in range(5)], np.float32)
    return q, vecs, (vecs @ q[0])


def test_positive_score_comes_from_the_vectors_even_when_gold_is_not_retrieved() -> None:
    q, vecs, s = _vectors()
    assert positive_scores(q, [[4]], vecs)[0] == pytest.approx(0.8)
    assert positive_scores(q, [[4, 0]], vecs)[0] == pytest.approx(s[0])  # several gold: the best one
    index = _FakeIndex([[s[0], s[1], s[2], s[3], -1.0]], [[0, 1, 2, 3, -1]])  # gold row 4 not in the top 4
    # threshold (1 - 0.05) x 0.8 = 0.76: rows 0..2 (cos 0.1..0.5 = 0.995, 0.955, 0.878) go, row 3 (0.362) stays
    assert mine_rows(index, q, [[4]], MiningSpec(5, 0, margin=0.05), passage_vectors=vecs) == [[3]]
    assert mine_rows(index, q, [[4]], MiningSpec(5, 0, max_score=0.9)) == [[2, 3]]
    assert mine_rows(index, q, [[4]], MiningSpec(5, 0)) == [[0, 1, 2, 3]]  # -1 padding dropped
    with pytest.raises(ValueError, match="passage vectors"):
        mine_rows(index, q, [[4]], MiningSpec(5, 0, margin=0.05))
    # the live index service calls it with these arguments in this order
    assert mine_rows(index, q, [[4]], MiningSpec(5, 0, 0.05, None), vecs) == [[3]]


def test_static_mining_in_the_pipeline_applies_the_filters_in_corpus_positions(tmp_path) -> None:
    from ragtrain.pipeline.retrieval import BuiltIndex, Retrieval

    q, vecs, s = _vectors()
    r = object.__new__(Retrieval)
    corpus = [f"d{i}" for i in range(5)]
    r.cfg = types.SimpleNamespace(
        retriever=types.SimpleNamespace(
            query_max_length=8, train=RetrieverTrainConfig(hard_negative_depth=5, hard_negative_margin=0.05)
        )
    )
    r.data = types.SimpleNamespace(queries={"q0": "question"})
    r.doc_ids = corpus
    r.train_qrels = {"q0": {"d4": 1}}
    r.encode_queries = lambda built, qids: q
    # the index holds the corpus in another row order (shards): rows are mapped back to corpus positions
    order = [3, 0, 4, 1, 2]
    by_score = sorted(range(5), key=lambda i: -s[order[i]])
    index = _FakeIndex([[s[order[i]] for i in by_score]], [by_score], [corpus[i] for i in order])
    # the positive's vector is read from the build's vector files (in shard order), gold rows only
    from tests.index.test_vector_files import _write_vectors

    shards = _write_vectors(tmp_path / "s", [corpus[i] for i in order], vecs[order], per_file=2)
    built = BuiltIndex("fake", index, [], corpus, {}, shards=shards)
    assert r.mine_negatives(built) == {"q0": [3]}
    r.cfg.retriever.train = RetrieverTrainConfig(hard_negative_depth=5, hard_negative_max_score=0.9)
    assert r.mine_negatives(built) == {"q0": [2, 3]}


def _data(negatives: list[int]) -> TrainData:
    exs = [TrainExample(f"q{i}", i, [i], list(negatives), i) for i in range(4)]
    return TrainData([f"p{i}" for i in range(40)], exs)


def test_several_hard_negatives_top_or_sampled_and_topped_up() -> None:
    data = _data([10, 11, 12, 13, 14, 15])
    _, pids, _ = local_batch(data, 4, 0, 0, 0, 1, 3, sampling="top")
    assert pids[4:] == [10, 11, 12] * 4  # the top-ranked candidates, in rank order
    _, pids, _ = local_batch(data, 4, 0, 0, 0, 1, 3, sampling="random")
    negs = [pids[4 + 3 * j : 7 + 3 * j] for j in range(4)]
    assert all(len(set(n)) == 3 and set(n) <= {10, 11, 12, 13, 14, 15} for n in negs)
    assert len({tuple(n) for n in negs}) > 1  # sampled per example
    # a query the filters left with 1 candidate is topped up with random non-gold passages (static and live alike)
    few = _data([10])
    queries, pids, golds = local_batch(few, 4, 0, 0, 0, 1, 3, sampling="top")
    for j, g in enumerate(golds):
        n = pids[4 + 3 * j : 7 + 3 * j]
        assert n[0] == 10 and len(set(n)) == 3 and not set(n) & set(g)


@pytest.mark.parametrize("key,value", [("hard_negative_margin", 1.0), ("hard_negative_margin", -0.1)])
def test_margin_outside_0_1_names_the_key(key, value) -> None:
    with pytest.raises(ConfigError, match=f"retriever.train.{key} must be in"):
        RetrieverTrainConfig(**{key: value})
