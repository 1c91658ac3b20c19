"""Document-level evaluation of chunk passages (MaxP), and training pairs / hard negatives on chunks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ragtrain.corpus.dataset import passage_qrels
from ragtrain.data.types import Passage, RetrievalData
from ragtrain.eval.metrics import evaluate, maxp_run, run_from_scores
from ragtrain.retriever.batching import build_examples

CHUNKS = ["d1#0", "d1#1", "d2#0", "d2#1", "d3#0"]
DOC_OF = {p: p.split("#")[0] for p in CHUNKS}
# chunk scores per query: a document's score is the max over its chunks
SCORES = {
    "q1": [0.9, 0.2, 0.5, 0.95, 0.7],  # docs: d2 .95 > d1 .9 > d3 .7
    "q2": [0.6, 0.55, 0.5, 0.1, 0.8],
}  # docs: d3 .8 > d1 .6 > d2 .5
QRELS = {"q1": {"d1": 1}, "q2": {"d3": 1, "d2": 1}}
# hand-computed: q1 relevant at rank 2; q2 relevant at ranks 1 and 3 of 2 relevant
NDCG = {"q1": 1 / math.log2(3), "q2": (1 + 1 / math.log2(4)) / (1 + 1 / math.log2(3))}


def _passage_run() -> dict[str, list[str]]:
    qids = sorted(SCORES)
    rows = np.argsort(-np.array([SCORES[q] for q in qids]), axis=1)
    return run_from_scores(qids, CHUNKS, rows)


def test_maxp_ranks_documents_by_their_best_chunk() -> None:
    run = _passage_run()
    assert run["q1"] == ["d2#1", "d1#0", "d3#0", "d2#0", "d1#1"]
    assert maxp_run(run, DOC_OF) == {"q1": ["d2", "d1", "d3"], "q2": ["d3", "d1", "d2"]}
    assert maxp_run(run, DOC_OF, depth=2)["q2"] == ["d3", "d1"]  # the cut-off counts distinct documents


def test_maxp_metrics_equal_the_hand_computed_case() -> None:
    m = evaluate(maxp_run(_passage_run(), DOC_OF), QRELS)
    assert m["ndcg@10"] == pytest.approx((NDCG["q1"] + NDCG["q2"]) / 2, abs=1e-12)
    assert m["mrr@10"] == pytest.approx((0.5 + 1.0) / 2) and m["recall@1"] == pytest.approx((0 + 0.5) / 2)
    assert m["recall@5"] == pytest.approx(1.0)
    # without MaxP the chunk ids never match document qrels: the mapping is what makes qrels work unchanged
    assert evaluate(_passage_run(), QRELS)["ndcg@10"] == 0.0


def _chunked_data() -> RetrievalData:
    corpus = {p: Passage(p, "", f"text {p}", doc_id=DOC_OF[p]) for p in CHUNKS}
    return RetrievalData(
        "x", corpus, {"q1": "one?", "q2": "two?"}, train_qrels=QRELS, eval_qrels=QRELS, split="dev", doc_of=dict(DOC_OF)
    )


def _one_hot_index(r, chunks: list[str], scores: list[list[float]], tmp_path):
    """A real Flat index whose inner products are exactly `scores` (one-hot passage vectors, query vectors = the
    scores), and `r`'s query encoder answering with them."""
    from ragtrain.index.faiss_index import build_index
    from ragtrain.pipeline.retrieval import BuiltIndex

    index = build_index(np.eye(len(chunks), dtype=np.float32), chunks, r.cfg.index.factory, "fp", "one-hot")
    queries = np.array(scores, dtype=np.float32)
    r.encode_queries = lambda built, qids: queries[: len(qids)]
    return BuiltIndex("one-hot", index, [], list(chunks), {})


def test_pipeline_evaluate_uses_maxp_and_retrieves_deeper(tmp_path) -> None:
    from ragtrain.config import Config
    from ragtrain.pipeline.retrieval import Retrieval

    cfg = Config(output_dir=str(tmp_path))
    cfg.index.top_k = 3  # 3 documents: all of them
    r = Retrieval(cfg, _chunked_data())
    built = _one_hot_index(r, CHUNKS, [SCORES[q] for q in sorted(QRELS)], tmp_path)
    assert r.ranked(built) == {"q1": ["d2", "d1", "d3"], "q2": ["d3", "d1", "d2"]}
    m = r.evaluate(built)
    assert m["ndcg@10"] == pytest.approx((NDCG["q1"] + NDCG["q2"]) / 2, abs=1e-12)


def test_a_document_with_more_chunks_than_the_first_search_depth_does_not_hide_the_others(tmp_path) -> None:
    """One long document whose 50 chunks all outrank 5 short documents: a fixed passage depth of top_k x 10 = 30
    holds only the long one, so MaxP must search deeper to give every query its true top k documents."""
    from ragtrain.config import Config
    from ragtrain.pipeline.retrieval import MAXP_DEPTH_FACTOR, Retrieval

    long_doc = [f"big#{k}" for k in range(50)]
    short = [f"s{i}" for i in range(5)]
    chunks = long_doc + short
    corpus = {p: Passage(p, "", f"text {p}", doc_id=p.split("#")[0]) for p in chunks}
    doc_of = {p: p.split("#")[0] for p in long_doc}
    qrels = {"q1": {"s0": 1}, "q2": {"s3": 1}}
    data = RetrievalData(
        "x", corpus, {"q1": "one?", "q2": "two?"}, train_qrels=qrels, eval_qrels=qrels, split="dev", doc_of=doc_of
    )
    cfg = Config(output_dir=str(tmp_path))
    cfg.index.top_k = 3
    assert cfg.index.top_k * MAXP_DEPTH_FACTOR < len(long_doc)
    r = Retrieval(cfg, data)
    # q1: the long document, then s0 > s1 > ...; q2: the long document, then s3 > s2 > ...
    q1 = [1.0 - k / 1000 for k in range(50)] + [0.5, 0.4, 0.3, 0.2, 0.1]
    q2 = [1.0 - k / 1000 for k in range(50)] + [0.1, 0.2, 0.3, 0.5, 0.05]
    built = _one_hot_index(r, chunks, [q1, q2], tmp_path)
    assert r.ranked(built) == {"q1": ["big", "s0", "s1"], "q2": ["big", "s3", "s2"]}
    assert r.evaluate(built)["recall@10"] == 1.0  # the relevant short documents are found


def test_hard_negatives_never_pick_a_chunk_of_a_gold_document(tmp_path) -> None:
    from ragtrain.config import Config
    from ragtrain.index.faiss_index import build_index
    from ragtrain.pipeline.retrieval import BuiltIndex, Retrieval

    cfg = Config(output_dir=str(tmp_path))
    cfg.retriever.train.hard_negatives, cfg.retriever.train.hard_negative_depth = 1, 5
    r = Retrieval(cfg, _chunked_data())
    # A real Flat index whose inner products are exactly SCORES: one-hot passage vectors, query vectors = scores.
    index = build_index(np.eye(len(CHUNKS), dtype=np.float32), CHUNKS, cfg.index.factory, "fp", "one-hot")
    queries = np.array([SCORES[q] for q in sorted(QRELS)], dtype=np.float32)
    r.encode_queries = lambda built, qids: queries[: len(qids)]  # the query encoder
    negs = r.mine_negatives(BuiltIndex("one-hot", index, [], list(CHUNKS), {}))
    pos = {p: i for i, p in enumerate(CHUNKS)}
    assert negs["q1"] == [pos["d2#1"], pos["d3#0"], pos["d2#0"]]  # neither d1#0 nor d1#1
    assert negs["q2"] == [pos["d1#0"], pos["d1#1"]]  # no chunk of d2 or d3


def test_training_pairs_a_query_with_every_chunk_of_its_relevant_document() -> None:
    pos = {p: i for i, p in enumerate(CHUNKS)}
    examples = build_examples({"q1": "one?", "q2": "two?"}, passage_qrels(QRELS, DOC_OF), pos)
    assert [(e.query, CHUNKS[e.positive]) for e in examples] == [
        ("one?", "d1#0"),
        ("one?", "d1#1"),
        ("two?", "d2#0"),
        ("two?", "d2#1"),
        ("two?", "d3#0"),
    ]
    # every chunk of every gold document is masked as a negative of the query's other positives
    assert examples[0].gold == [pos["d1#0"], pos["d1#1"]]
    assert sorted(examples[2].gold) == [pos["d2#0"], pos["d2#1"], pos["d3#0"]]
