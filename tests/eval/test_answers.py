"""answer_recall@k against hand-computed cases, and the SQuAD normalisation it shares with EM / F1."""

from __future__ import annotations

import pytest

from ragtrain.eval import qa_metrics
from ragtrain.eval.answers import answer_recall, has_answer, match_tokens, normalize_answer


def test_normalisation_is_the_one_em_and_f1_use() -> None:
    assert qa_metrics.normalize_answer is normalize_answer
    assert normalize_answer("The  Denver Broncos!") == "denver broncos"


def test_an_answer_must_be_whole_tokens_of_the_passage() -> None:
    text = match_tokens("In 1990, the Broncos won; an Anna-Maria scored.")
    assert has_answer(text, ["broncos won"])
    assert has_answer(text, ["1990"])
    assert not has_answer(text, ["1"])  # inside "1990": not a token of the passage
    assert not has_answer(text, ["bronco"])
    assert has_answer(text, [match_tokens("Anna-Maria")]) and has_answer(text, ["maria"])


def test_punctuation_separates_tokens_where_squad_normalisation_would_glue_them() -> None:
    """Passages of the shared SQuAD file whose answers SQuAD's deletion of punctuation hid (module doc)."""
    for passage, answer in (
        ("graduating in 1873.:33 he", "1873"),
        ("from Pikes Peak to Paris.[citation needed]", "Paris"),
        ("Before Rollo's arrival", "Rollo"),
        ("in 1873–1874 (en dash)", "1874"),
        ("less than $1,000 a year", "less than $1,000"),
    ):
        assert has_answer(match_tokens(passage), [match_tokens(answer)]), (passage, answer)
        assert not has_answer(normalize_answer(passage), [normalize_answer(answer)]) or answer.startswith("less")


def test_answer_recall_hand_computed() -> None:
    texts = {
        "p1": "Super Bowl 50 was an American football game.",
        "p2": "The Denver Broncos defeated the Carolina Panthers 24-10.",
        "p3": "Levi's Stadium in Santa Clara, California.",
        "p4": "Nothing relevant here.",
    }
    run = {
        "q1": ["p1", "p2", "p3"],  # answer "Denver Broncos" first at rank 2
        "q2": ["p3", "p4"],  # answers: "Santa Clara" at rank 1 (the second gold answer matches)
        "q3": ["p4", "p1", "p2"],  # "Carolina Panthers" at rank 3
        "q4": ["p1", "p4"],  # "Broncos" retrieved nowhere in its top 2
        # q5 is missing from the run: it scores 0
    }
    answers = {
        "q1": ["Denver Broncos"],
        "q2": ["Levi Stadium", "Santa Clara"],
        "q3": ["the Carolina Panthers"],  # the article is dropped by the normalisation
        "q4": ["Broncos"],
        "q5": ["anything"],
        "q6": ["The", "..."],  # no token left: not evaluable, not counted
    }
    qids = ["q1", "q2", "q3", "q4", "q5", "q6"]
    got = answer_recall(run, answers, texts, qids, ks=(1, 2, 3))
    # rank of first hit: q1 2, q2 1, q3 3, q4 -, q5 -  (5 evaluated questions)
    assert got == pytest.approx({"answer_recall@1": 1 / 5, "answer_recall@2": 2 / 5, "answer_recall@3": 3 / 5})


def test_answer_recall_without_an_answerable_question_is_an_error() -> None:
    with pytest.raises(ValueError, match="no evaluable question"):
        answer_recall({"q": ["p"]}, {"q": ["a"]}, {"p": "a"}, qids=["other"])


def test_the_evaluation_output_carries_answer_recall_when_the_data_has_answers(tmp_path) -> None:
    """Retrieval.evaluate on a real Flat index whose inner products are set by hand (one-hot passage vectors)."""
    import numpy as np

    from ragtrain.config import Config
    from ragtrain.data.types import Passage, RetrievalData
    from ragtrain.index.faiss_index import build_index
    from ragtrain.pipeline.retrieval import BuiltIndex, Retrieval

    texts = ["Paris is in France.", "The Seine flows north.", "Lyon is a city.", "Bread and cheese."]
    ids = [f"p{i}" for i in range(4)]
    corpus = {i: Passage(i, "Title Seine", t) for i, t in zip(ids, texts)}  # the title is not searched
    qrels = {"q1": {"p0": 1}, "q2": {"p1": 1}}
    answers = {"q1": ["Paris"], "q2": ["north"]}
    data = RetrievalData("x", corpus, {"q1": "?", "q2": "?"}, qrels, qrels, "dev", answers=answers)
    scores = [[0.1, 0.9, 0.8, 0.7], [0.9, 0.2, 0.8, 0.1]]  # q1: p1 p2 p3 p0 | q2: p0 p2 p1 p3
    cfg = Config(output_dir=str(tmp_path))
    r = Retrieval(cfg, data)
    index = build_index(np.eye(4, dtype=np.float32), ids, cfg.index.factory, "fp", "one-hot")
    r.encode_queries = lambda built, qids: np.array(scores, dtype=np.float32)[: len(qids)]
    m = r.evaluate(BuiltIndex("one-hot", index, [], ids, {}))
    # first passage holding the answer: q1 at rank 4 (p0), q2 at rank 3 (p1)
    assert m["answer_recall@1"] == 0.0 and m["answer_recall@5"] == 1.0
    assert m["recall@1"] == 0.0 and m["ndcg@10"] > 0
    r.data.answers = {}  # a retrieval-only dataset: no answer recall in its output
    assert not any(k.startswith("answer_recall") for k in r.evaluate(BuiltIndex("one-hot", index, [], ids, {})))


def test_a_chunked_documents_corpus_counts_answers_on_its_passages(tmp_path) -> None:
    """qrels on documents (MaxP ranking) while answer recall reads the retrieved chunks themselves."""
    import numpy as np

    from ragtrain.config import Config
    from ragtrain.data.types import Passage, RetrievalData
    from ragtrain.index.faiss_index import build_index
    from ragtrain.pipeline.retrieval import BuiltIndex, Retrieval

    chunks = {"d1#0": "Nothing here.", "d1#1": "The answer is Vistula.", "d2#0": "Warsaw lies on a river."}
    corpus = {p: Passage(p, "", t, doc_id=p.split("#")[0]) for p, t in chunks.items()}
    doc_of = {p: p.split("#")[0] for p in chunks}
    qrels = {"q1": {"d1": 1}}
    data = RetrievalData("x", corpus, {"q1": "?"}, qrels, qrels, "dev", answers={"q1": ["Vistula"]}, doc_of=doc_of)
    cfg = Config(output_dir=str(tmp_path))
    cfg.index.top_k = 2
    r = Retrieval(cfg, data)
    ids = list(chunks)
    index = build_index(np.eye(3, dtype=np.float32), ids, cfg.index.factory, "fp", "one-hot")
    r.encode_queries = lambda built, qids: np.array([[0.9, 0.1, 0.5]], dtype=np.float32)[: len(qids)]
    m = r.evaluate(BuiltIndex("one-hot", index, [], ids, {}))
    # documents: d1 (its chunk d1#0 first) at rank 1; passages: d1#0, d2#0, d1#1 -> the answer at rank 3
    assert m["recall@1"] == 1.0
    assert (m["answer_recall@1"], m["answer_recall@5"]) == (0.0, 1.0)
