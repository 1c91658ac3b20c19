"""Tests for ragtrain.eval.metrics: hand-computed cases, trec_eval (pytrec_eval) as the oracle, run_from_scores."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from ragtrain.eval.metrics import DEFAULT_KS, evaluate, per_query, run_from_scores

L2 = math.log2


def approx(x: float) -> object:
    """Tight tolerance for hand-computed values (they differ only by float rounding)."""
    return pytest.approx(x, abs=1e-12)


# ---------------------------------------------------------------------------------------------
# Hand-computed cases
# ---------------------------------------------------------------------------------------------

# q1: binary relevance, 3 relevant docs, 2 of them retrieved (ranks 2 and 4).
# q2: graded relevance (a=2, b=1, z=1), plus a grade-0 judgment (c) that the run ranks first.
# q3: judged relevant doc, but the query is absent from the run -> all zeros.
# q4: only a grade-0 judgment -> not evaluated at all.
# q5: in the run only -> ignored.
QRELS = {
    "q1": {"d1": 1, "d3": 1, "d9": 1},
    "q2": {"a": 2, "b": 1, "c": 0, "z": 1},
    "q3": {"e": 1},
    "q4": {"f": 0},
}
RUN = {
    "q1": ["d2", "d1", "d4", "d3", "d5"],
    "q2": ["c", "b", "a", "x"],
    "q4": ["f"],
    "q5": ["d1"],
}

# q1: DCG  = 1/log2(3) + 1/log2(5)                  (hits at ranks 2 and 4)
#     IDCG = 1/log2(2) + 1/log2(3) + 1/log2(4)      (3 relevant docs, all grade 1)
Q1_NDCG = (1 / L2(3) + 1 / L2(5)) / (1 + 1 / L2(3) + 1 / L2(4))  # ~= 0.49820
# q2: ranking c(0) b(1) a(2) x(-): DCG = 0/log2(2) + 1/log2(3) + 2/log2(4) = 0.63093 + 1
#     ideal ordering of ALL relevant: a(2) b(1) z(1): IDCG = 2/1 + 1/log2(3) + 1/log2(4)
Q2_NDCG = (1 / L2(3) + 2 / L2(4)) / (2 + 1 / L2(3) + 1 / L2(4))  # ~= 0.52091
# (with the 2^g - 1 "Burges" gain it would be (1/log2(3) + 3/2) / (3 + 1/log2(3) + 1/2) instead)


def test_hand_per_query() -> None:
    pq = per_query(RUN, QRELS)
    # q4 (grade 0 only) and q5 (not in qrels) are not evaluated.
    assert set(pq) == {"q1", "q2", "q3"}

    q1 = pq["q1"]
    assert q1["ndcg@10"] == approx(Q1_NDCG)
    assert q1["mrr@10"] == approx(1 / 2)  # first relevant (d1) at rank 2
    assert q1["recall@1"] == 0.0  # d2 is not relevant
    assert q1["recall@5"] == approx(2 / 3)  # d1, d3 of {d1, d3, d9}
    assert q1["recall@10"] == approx(2 / 3)
    assert q1["recall@100"] == approx(2 / 3)

    q2 = pq["q2"]
    assert q2["ndcg@10"] == approx(Q2_NDCG)
    assert q2["mrr@10"] == approx(1 / 2)  # c has grade 0, so the first relevant is b at rank 2
    assert q2["recall@1"] == 0.0
    assert q2["recall@5"] == approx(2 / 3)  # b, a of {a, b, z}; c does not count
    assert q2["recall@100"] == approx(2 / 3)

    # q3 is absent from the run: 0 on every metric, but it is still an evaluated query.
    assert pq["q3"] == {m: 0.0 for m in pq["q1"]}


def test_hand_means_include_absent_query() -> None:
    res = evaluate(RUN, QRELS)
    assert list(res) == ["ndcg@10", "mrr@10", "recall@1", "recall@5", "recall@10", "recall@100"]
    # Mean over the 3 evaluated queries q1, q2, q3 (q3 contributes 0).
    assert res["ndcg@10"] == approx((Q1_NDCG + Q2_NDCG + 0) / 3)
    assert res["mrr@10"] == approx((1 / 2 + 1 / 2 + 0) / 3)
    assert res["recall@1"] == 0.0
    assert res["recall@5"] == approx((2 / 3 + 2 / 3 + 0) / 3)


def test_empty_ranking_equals_absent() -> None:
    qrels = {"q": {"a": 1}}
    assert per_query({"q": []}, qrels) == per_query({}, qrels)


def test_graded_ideal_ordering() -> None:
    # Run puts the grade-1 doc above the grade-2 doc.
    # DCG  = 1/log2(2) + 2/log2(3) = 1 + 1.26186 = 2.26186
    # IDCG = 2/log2(2) + 1/log2(3) = 2 + 0.63093 = 2.63093   -> nDCG ~= 0.85972
    res = per_query({"q": ["a", "b"]}, {"q": {"a": 1, "b": 2}})["q"]
    assert res["ndcg@10"] == approx((1 + 2 / L2(3)) / (2 + 1 / L2(3)))
    assert res["mrr@10"] == 1.0
    assert res["recall@1"] == approx(1 / 2)
    # The perfect order scores exactly 1.
    assert per_query({"q": ["b", "a"]}, {"q": {"a": 1, "b": 2}})["q"]["ndcg@10"] == approx(1.0)


def test_idcg_uses_unretrieved_relevant_docs() -> None:
    # 2 relevant docs (grade 2 and 1); the run only finds the grade-1 one, at rank 1.
    # DCG = 1/log2(2) = 1; IDCG = 2/log2(2) + 1/log2(3) = 2.63093 -> nDCG ~= 0.38009
    res = per_query({"q": ["b", "x"]}, {"q": {"a": 2, "b": 1}})["q"]
    assert res["ndcg@10"] == approx(1 / (2 + 1 / L2(3)))


def test_cutoffs_at_10() -> None:
    # 12 relevant docs, all grade 1; the run returns exactly them in order.
    rel = {f"r{i}": 1 for i in range(12)}
    ranked = [f"r{i}" for i in range(12)]
    res = per_query({"q": ranked}, {"q": rel}, ks=(10, 12))["q"]
    # IDCG is cut at 10 too, so a perfect top-10 is nDCG 1 even though 2 relevant docs remain.
    assert res["ndcg@10"] == approx(1.0)
    assert res["recall@10"] == approx(10 / 12)
    assert res["recall@12"] == approx(1.0)

    # Only relevant doc at rank 11: outside MRR@10 and nDCG@10, inside recall@11.
    ranked = [f"n{i}" for i in range(10)] + ["a"]
    res = per_query({"q": ranked}, {"q": {"a": 1}}, ks=(10, 11))["q"]
    assert res["mrr@10"] == 0.0
    assert res["ndcg@10"] == 0.0
    assert res["recall@10"] == 0.0
    assert res["recall@11"] == 1.0

    # Rank 10 is still inside: MRR = 1/10, nDCG = (1/log2(11)) / (1/log2(2)).
    res = per_query({"q": ranked[1:]}, {"q": {"a": 1}})["q"]
    assert res["mrr@10"] == approx(1 / 10)
    assert res["ndcg@10"] == approx(1 / L2(11))


def test_duplicates_count_once() -> None:
    # "a" twice: it is counted once, so recall@2 = 1/2 (not 2/2) and
    # DCG = 1/log2(2) (not 1 + 1/log2(3)); IDCG = 1 + 1/log2(3) -> nDCG ~= 0.61315.
    res = per_query({"q": ["a", "a"]}, {"q": {"a": 1, "b": 1}}, ks=(2,))["q"]
    assert res["recall@2"] == approx(1 / 2)
    assert res["ndcg@10"] == approx(1 / (1 + 1 / L2(3)))
    assert res["mrr@10"] == 1.0

    # Duplicates are dropped before ranks are assigned, so later docs move up:
    # ["x", "x", "a"] ranks as ["x", "a"] -> a at rank 2: MRR 1/2, recall@2 = 1.
    res = per_query({"q": ["x", "x", "a"]}, {"q": {"a": 1}}, ks=(1, 2))["q"]
    assert res["mrr@10"] == approx(1 / 2)
    assert res["recall@1"] == 0.0
    assert res["recall@2"] == 1.0
    assert res["ndcg@10"] == approx(1 / L2(3))


def test_custom_ks_and_key_order() -> None:
    res = evaluate({"q": ["a"]}, {"q": {"a": 1}}, ks=(3, 1, 3))
    # ndcg@10 and mrr@10 are always reported; recall follows ks, repeats dropped.
    assert list(res) == ["ndcg@10", "mrr@10", "recall@3", "recall@1"]
    assert all(v == 1.0 for v in res.values())
    assert DEFAULT_KS == (1, 5, 10, 100)


@pytest.mark.parametrize("ks", [(), (0,), (-1,), (2.5,), (True,)])
def test_bad_ks(ks: tuple) -> None:
    with pytest.raises(ValueError):
        evaluate({"q": ["a"]}, {"q": {"a": 1}}, ks=ks)


@pytest.mark.parametrize("qrels", [{}, {"q": {}}, {"q": {"a": 0, "b": -1}}])
def test_no_evaluable_query_raises(qrels: dict) -> None:
    with pytest.raises(ValueError, match="no evaluable query"):
        evaluate({"q": ["a", "b"]}, qrels)
    with pytest.raises(ValueError, match="no evaluable query"):
        per_query({"q": ["a", "b"]}, qrels)


def test_evaluate_is_mean_of_per_query() -> None:
    rng = np.random.default_rng(1)
    qrels, run = _random_case(rng, n_queries=50, n_docs=100, depth=30)
    pq = per_query(run, qrels)
    res = evaluate(run, qrels)
    for m, v in res.items():
        assert v == pytest.approx(np.mean([q[m] for q in pq.values()]), abs=1e-12)


# ---------------------------------------------------------------------------------------------
# Oracle: trec_eval, through pytrec_eval (the evaluator BEIR uses; C, so no JIT warm-up in the suite)
# ---------------------------------------------------------------------------------------------


def _random_case(
    rng: np.random.Generator, n_queries: int, n_docs: int, depth: int
) -> tuple[dict[str, dict[str, int]], dict[str, list[str]]]:
    """Random graded qrels (every query has >= 1 relevant doc) and runs biased toward them."""
    docs = np.array([f"doc{i}" for i in range(n_docs)])
    qrels: dict[str, dict[str, int]] = {}
    run: dict[str, list[str]] = {}
    for i in range(n_queries):
        qid = f"q{i}"
        n_judged = int(rng.integers(1, 21))
        judged = rng.choice(n_docs, size=n_judged, replace=False)
        grades = rng.integers(0, 3, size=n_judged)  # 0/1/2: grade-0 judgments included
        grades[0] = rng.integers(1, 3)  # >= 1 relevant doc, so trec_eval's convention coincides
        qrels[qid] = {str(docs[j]): int(g) for j, g in zip(judged, grades)}
        # Continuous scores (distinct a.s.) with a boost for judged docs, so the metrics are not
        # all ~0; some queries get a shorter list to exercise k > list length.
        score = rng.normal(size=n_docs)
        score[judged] += 1.2 * grades
        length = depth if i % 7 else depth // 2
        run[qid] = [str(d) for d in docs[np.argsort(-score)[:length]]]
    return qrels, run


def _scored(run: dict[str, list[str]], depth: int | None = None) -> dict[str, dict[str, float]]:
    """Dict run for trec_eval: scores strictly decreasing with rank; the first occurrence of a doc wins; only
    the first `depth` distinct docs when given."""
    out: dict[str, dict[str, float]] = {}
    for qid, ranked in run.items():
        scores: dict[str, float] = {}
        for doc in ranked:
            if depth is not None and len(scores) == depth:
                break
            scores.setdefault(doc, float(len(ranked) - len(scores)))
        out[qid] = scores
    return out


def _trec_eval(qrels: dict, run: dict[str, list[str]], ks: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """Per-query ndcg@10, mrr@10 and recall@k from trec_eval (metric -> qid -> value); a judged query the run
    lacks scores 0, as in ragtrain (trec_eval leaves it out)."""
    pytrec_eval = pytest.importorskip("pytrec_eval")
    full = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall." + ",".join(map(str, ks))})
    # trec_eval's recip_rank has no cut-off: MRR@10 is its value on the run cut at 10 distinct docs
    top10 = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"})
    a, b = full.evaluate(_scored(run)), top10.evaluate(_scored(run, depth=10))
    out: dict[str, dict[str, float]] = {"ndcg@10": {}, "mrr@10": {}, **{f"recall@{k}": {} for k in ks}}
    for qid in qrels:
        out["ndcg@10"][qid] = a.get(qid, {}).get("ndcg_cut_10", 0.0)
        out["mrr@10"][qid] = b.get(qid, {}).get("recip_rank", 0.0)
        for k in ks:
            out[f"recall@{k}"][qid] = a.get(qid, {}).get(f"recall_{k}", 0.0)
    return out


def test_trec_eval_ndcg_is_linear_gain() -> None:
    # Guards the oracle itself: trec_eval's ndcg_cut is the linear-gain nDCG that BEIR reports.
    q2 = _trec_eval({"q2": QRELS["q2"]}, {"q2": RUN["q2"]}, (10,))
    assert q2["ndcg@10"]["q2"] == pytest.approx(Q2_NDCG, abs=1e-9)


def test_matches_trec_eval_on_random_runs() -> None:
    rng = np.random.default_rng(0)
    qrels, run = _random_case(rng, n_queries=200, n_docs=500, depth=100)
    # Duplicates in some lists (ours: first occurrence counts; a dict run keeps the first).
    for i in range(0, 200, 5):
        ranked = run[f"q{i}"]
        for pos in rng.integers(1, len(ranked), size=5):
            ranked.insert(int(pos), ranked[int(rng.integers(0, pos))])
    # Run-only queries are ignored by both; a judged query missing from the run scores 0 in both.
    run["extra0"] = ["doc1", "doc2"]
    run["extra1"] = ["doc3"]
    del run["q3"]

    ks = (1, 3, 5, 10, 20, 100)
    ours_mean = evaluate(run, qrels, ks)
    ours = per_query(run, qrels, ks)
    metrics = list(ours_mean)
    assert metrics == ["ndcg@10", "mrr@10"] + [f"recall@{k}" for k in ks]
    oracle = _trec_eval(qrels, run, ks)

    assert set(ours) == set(qrels)
    for m in metrics:
        assert ours_mean[m] == pytest.approx(float(np.mean(list(oracle[m].values()))), abs=1e-6), m
        for qid in qrels:
            assert ours[qid][m] == pytest.approx(oracle[m][qid], abs=1e-6), (m, qid)
    # Sanity: the case is not degenerate (metrics strictly between 0 and 1).
    assert 0.05 < ours_mean["ndcg@10"] < 0.95
    assert 0.05 < ours_mean["recall@10"] < 0.95


def test_speed_1000_queries_top100() -> None:
    rng = np.random.default_rng(2)
    qrels, run = _random_case(rng, n_queries=1000, n_docs=5000, depth=100)
    best = math.inf
    for _ in range(3):  # best of 3: robust to a noisy neighbour on a shared CI box
        t0 = time.perf_counter()
        evaluate(run, qrels)
        best = min(best, time.perf_counter() - t0)
    assert best < 0.5, f"evaluate took {best:.3f}s for 1000 x 100"


# ---------------------------------------------------------------------------------------------
# run_from_scores
# ---------------------------------------------------------------------------------------------


def test_run_from_scores_skips_padding() -> None:
    doc_ids = ["a", "b", "c"]
    # FAISS pads with -1 when fewer than k results exist; a -1 mid-row is skipped too.
    idx = np.array([[2, 0, -1], [-1, -1, -1], [1, -1, 2]], dtype=np.int64)
    run = run_from_scores(["q1", "q2", "q3"], doc_ids, idx)
    assert run == {"q1": ["c", "a"], "q2": [], "q3": ["b", "c"]}
    assert all(type(d) is str for ranked in run.values() for d in ranked)
    # int32 works too, and the result feeds evaluate (q2 scores 0).
    run32 = run_from_scores(["q1", "q2", "q3"], doc_ids, idx.astype(np.int32))
    assert run32 == run
    res = evaluate(run32, {"q1": {"c": 1}, "q2": {"a": 1}})
    assert res["mrr@10"] == approx(1 / 2)


def test_run_from_scores_empty_k() -> None:
    assert run_from_scores(["q"], ["a"], np.zeros((1, 0), dtype=np.int64)) == {"q": []}


@pytest.mark.parametrize(
    ("ids", "idx"),
    [
        (["q1"], np.array([0, 1])),  # not 2-D
        (["q1", "q2"], np.array([[0, 1]])),  # row count mismatch
        (["q1", "q1"], np.array([[0], [1]])),  # duplicate query ids
        (["q1"], np.array([[0, 3]])),  # out of range
        (["q1"], np.array([[0, -2]])),  # negative other than -1 would wrap around
        (["q1"], np.array([[0.0, 1.0]])),  # float positions
    ],
)
def test_run_from_scores_rejects_bad_input(ids: list[str], idx: np.ndarray) -> None:
    with pytest.raises(ValueError):
        run_from_scores(ids, ["a", "b", "c"], idx)
