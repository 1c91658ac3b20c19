"""Chunk windows, overlap, sentence preference and offsets on hand-made documents; the chunk budget checks."""

from __future__ import annotations

import itertools

import pytest

from ragtrain.corpus.chunk import chunk_document
from ragtrain.corpus.dataset import check_chunk_budget, chunk_data, passage_qrels
from ragtrain.data.types import DataError, Passage, RetrievalData
from ragtrain.runtime.errors import ConfigError

from .helpers import WhitespaceTokenizer

WS = WhitespaceTokenizer()


def _chunks(text: str, max_tokens: int, overlap: int, title: str = "") -> list[dict]:
    doc = {"id": "d", "title": title, "text": text}
    out = chunk_document(doc, WS, max_tokens, overlap)
    for c in out:  # offsets always address the cleaned document text exactly
        assert text[c["start"] : c["end"]] == c["text"] and c["doc_id"] == "d" and c["title"] == title
    return out


def test_fixed_windows_with_overlap_without_sentence_boundaries() -> None:
    text = "a b c d e f g h i j"
    out = _chunks(text, 4, 1)
    assert [c["text"] for c in out] == ["a b c d", "d e f g", "g h i j"]
    assert [c["id"] for c in out] == ["d#0", "d#1", "d#2"]
    assert [(c["start"], c["end"]) for c in out] == [(0, 7), (6, 13), (12, 19)]


def test_no_overlap_and_a_short_document() -> None:
    assert [c["text"] for c in _chunks("a b c d e", 2, 0)] == ["a b", "c d", "e"]
    [only] = _chunks("short doc", 10, 3)
    assert (only["id"], only["text"], only["start"], only["end"]) == ("d#0", "short doc", 0, 9)


def test_title_tokens_count_against_the_budget() -> None:
    out = _chunks("a b c d e f g h i j", 4, 1, title="T")  # 1 title token: bodies of 3 tokens
    assert [c["text"] for c in out] == ["a b c", "c d e", "e f g", "g h i", "i j"]
    with pytest.raises(DataError, match=r"title of document 'd' takes 3 of data.chunk.max_tokens=4 tokens"):
        _chunks("a b c", 4, 1, title="a long title")


def test_windows_prefer_sentence_boundaries() -> None:
    text = "One two three. Four five six seven. Eight nine."
    # budget 6 would cut after "six"; the last sentence start inside the window (token 3) is taken instead
    assert [c["text"] for c in _chunks(text, 6, 0)] == ["One two three.", "Four five six seven. Eight nine."]
    # with overlap 2 the next window starts 2 tokens back (no sentence start in that tail) ...
    out = _chunks(text, 6, 2)
    assert [c["text"] for c in out] == ["One two three.", "two three. Four five six seven.", "six seven. Eight nine."]


def test_overlap_moves_forward_to_a_sentence_start() -> None:
    text = "a b c. d e f g h i"
    out = _chunks(text, 6, 4)  # window 1 = a..f (the sentence start "d" is under half the budget)
    assert out[0]["text"] == "a b c. d e f"
    # 4 tokens of overlap would start at "c."; the sentence start "d" inside that tail is taken instead
    assert [c["text"] for c in out[1:]] == ["d e f g h i"]


def test_line_breaks_are_boundaries_and_the_window_never_goes_under_half() -> None:
    text = "x\ny y y y y y y y"
    out = _chunks(text, 6, 0)
    assert out[0]["text"] == "x\ny y y y y"  # a boundary at token 1 (< half of 6) is not used


def test_every_window_fits_and_covers_the_document_with_minilm() -> None:
    from ragtrain.config.retriever import RetrieverConfig
    from ragtrain.embed.model import load_tokenizer

    tok = load_tokenizer(RetrieverConfig(model="minilm"))
    text = (
        "Ærøskøbing is a town. Its harbour, built in 1750, is small! Why? Nobody knows.\n"
        "The café sells naïve pastries; prices rose 3.5% in 2024. "
    ) * 6
    doc = {"id": "x", "title": "Town guide", "text": text.strip()}
    out = chunk_document(doc, tok, 32, 8)
    n_title = len(tok("Town guide", add_special_tokens=False)["input_ids"])
    assert len(out) > 3
    for a, b in itertools.pairwise(out):
        assert a["start"] < b["start"] < a["end"] <= b["end"]  # consecutive windows overlap and advance
    for c in out:
        assert doc["text"][c["start"] : c["end"]] == c["text"]
        n = len(tok(c["title"] + " " + c["text"], add_special_tokens=False)["input_ids"])
        assert n <= 32 and len(tok(c["text"], add_special_tokens=False)["input_ids"]) <= 32 - n_title
    assert out[0]["start"] == 0 and out[-1]["end"] == len(doc["text"])


def test_chunk_budget_against_the_encoder() -> None:
    check_chunk_budget(254, model_max=512, passage_max_length=256)
    with pytest.raises(ConfigError, match=r"data.chunk.max_tokens must be <= 254 .*passage_max_length=256.*got 300"):
        check_chunk_budget(300, model_max=512, passage_max_length=256)
    with pytest.raises(ConfigError, match=r"must be <= 510 .*encoder maximum 512.*got 600"):
        check_chunk_budget(600, model_max=512, passage_max_length=1024)


def test_chunk_data_maps_passages_to_documents_and_qrels_expand() -> None:
    corpus = {"d1": Passage("d1", "T1", "a b c d e f"), "d2": Passage("d2", "", "g h")}
    data = RetrievalData("x", corpus, {"q": "?"}, {"q": {"d1": 1}}, {"q": {"d2": 1}}, "dev")
    ch = chunk_data(data, WS, 4, 1)
    assert list(ch.corpus) == ["d1#0", "d1#1", "d1#2", "d2#0"]  # "T1" takes 1 of 4 tokens: bodies of 3
    assert ch.doc_of == {"d1#0": "d1", "d1#1": "d1", "d1#2": "d1", "d2#0": "d2"}
    p = ch.corpus["d1#1"]
    assert (p.doc_id, p.title, p.text, p.start, p.end) == ("d1", "T1", "c d e", 4, 9)
    assert p.full_text() == "T1 c d e"  # the title is prepended to every chunk
    assert ch.train_qrels == {"q": {"d1": 1}}  # qrels stay on documents
    assert passage_qrels(ch.train_qrels, ch.doc_of) == {"q": {"d1#0": 1, "d1#1": 1, "d1#2": 1}}
    assert passage_qrels({"q": {"d1": 1}}, {}) == {"q": {"d1": 1}}


def test_cjk_full_stops_are_sentence_boundaries() -> None:
    """。！？ end sentences with no space after them: before, CJK text was always cut at the token budget."""
    from transformers import AutoTokenizer

    from ragtrain.embed.model import minilm_path

    tok = AutoTokenizer.from_pretrained(minilm_path())  # one token per CJK character
    text = "一二三。四五六七！八九十"
    out = chunk_document({"id": "d", "title": "", "text": text}, tok, 6, 0)
    assert [c["text"] for c in out] == ["一二三。", "四五六七！", "八九十"]
    assert all(text[c["start"] : c["end"]] == c["text"] for c in out)
