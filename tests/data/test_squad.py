"""data=squad: the reader on tiny hand-made SQuAD files (corpus, answers, chunk mapping, splits by article, every bad
input with its message), the config keys, the command line, and the shared SQuAD file when it is present."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ragtrain.config import to_typed
from ragtrain.corpus.chunk import chunk_passage
from ragtrain.corpus.load import load_data
from ragtrain.data.squad import gold_passage, load_squad, read_squad, split_articles
from ragtrain.data.types import DataError, Passage
from ragtrain.runtime.errors import ConfigError
from tests.conftest import REPO, SQUAD, compose
from tests.corpus.helpers import WhitespaceTokenizer

ALPHA0 = "Alpha One is a town on the river Bo. It was founded in 1901 by Ann Lee and her brother Tom Lee."
ALPHA1 = "The town hall of Alpha One was built of red stone in 1950."
BETA0 = "Beta is a mountain. Its summit is 3,000 metres high."
GAMMA0 = "Gamma is a lake known for its blue water."
DELTA0 = "Delta is a river delta with many birds."
HELD0 = "Held Out is an island without any question about it."


def qa(qid: str, question: str, context: str, *texts: str, start: int | None = None) -> dict[str, Any]:
    """A SQuAD question whose answers are found in `context` (or put at `start`)."""
    answers = [{"text": t, "answer_start": context.find(t) if start is None else start} for t in texts]
    return {"id": qid, "question": question, "answers": answers}


def articles() -> list[dict[str, Any]]:
    return [
        {
            "title": "Alpha_One",
            "paragraphs": [
                {
                    "context": ALPHA0,
                    "qas": [
                        qa("a1", "When was Alpha One founded?", ALPHA0, "1901", "in 1901", "1901"),
                        qa("a2", "Who founded Alpha One?", ALPHA0, "Ann Lee", "Ann Lee and her brother Tom Lee"),
                    ],
                },
                {"context": ALPHA1, "qas": [qa("a3", "What is the town hall built of?", ALPHA1, "red stone")]},
            ],
        },
        {"title": "Beta", "paragraphs": [{"context": BETA0, "qas": [qa("b1", "How high is Beta?", BETA0, "3,000")]}]},
        {"title": "Gamma", "paragraphs": [{"context": GAMMA0, "qas": [qa("g1", "Colour of Gamma?", GAMMA0, "blue")]}]},
        {
            "title": "Delta",
            "paragraphs": [{"context": DELTA0, "qas": [qa("d1", "What lives there?", DELTA0, "birds")]}],
        },
        {"title": "Held_Out", "paragraphs": [{"context": HELD0, "qas": []}]},
    ]


def write(tmp_path: Path, data: list[dict[str, Any]] | None = None, version: str = "1.1", name: str = "s.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"version": version, "data": articles() if data is None else data}), encoding="utf-8")
    return path


# ---------------------------------------------------------------- the corpus, answers and gold passages


def test_every_paragraph_is_a_passage_and_every_answer_is_kept(tmp_path: Path) -> None:
    d = load_squad(write(tmp_path), split="dev", dev_titles=["Beta"], log=lambda _: None)
    assert list(d.corpus) == ["Alpha_One#0", "Alpha_One#1", "Beta#0", "Gamma#0", "Delta#0", "Held_Out#0"]
    assert d.corpus["Alpha_One#1"] == Passage("Alpha_One#1", "Alpha One", ALPHA1)  # title with spaces, text as is
    assert d.answers["a1"] == ["1901", "in 1901", "1901"]  # all gold answers, in file order
    assert d.answers["a2"] == ["Ann Lee", "Ann Lee and her brother Tom Lee"]
    assert d.eval_qrels == {"b1": {"Beta#0": 1}}
    assert d.train_qrels == {
        "a1": {"Alpha_One#0": 1},
        "a2": {"Alpha_One#0": 1},
        "a3": {"Alpha_One#1": 1},
        "g1": {"Gamma#0": 1},
        "d1": {"Delta#0": 1},
    }
    assert set(d.queries) == {"a1", "a2", "a3", "b1", "g1", "d1"} and d.doc_of == {}
    assert d.name == "s" and d.split == "dev"


def test_root_is_the_file_or_a_folder_with_exactly_one_json(tmp_path: Path) -> None:
    path = write(tmp_path)
    assert read_squad(tmp_path).path == path == read_squad(path).path
    write(tmp_path, name="other.json")
    with pytest.raises(
        DataError, match=r"must hold exactly one SQuAD \*.json file, found 2 \(\['other.json', 's.json'\]"
    ):
        read_squad(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"must hold exactly one SQuAD \*.json file, found 0$"):
        read_squad(tmp_path / "empty")
    with pytest.raises(DataError, match=r"data.root='.*nope' does not exist"):
        read_squad(tmp_path / "nope")


def windows(size: int, overlap: int):
    """A chunker cutting a paragraph every `size` characters, `overlap` characters shared (offsets known by hand)."""

    def chunk(p: Passage) -> list[Passage]:
        out, start = [], 0
        while True:
            end = min(start + size, len(p.text))
            out.append(Passage(f"{p.id}#{len(out)}", p.title, p.text[start:end], p.id, start, end))
            if end == len(p.text):
                return out
            start = end - overlap

    return chunk


def test_each_answer_maps_to_the_chunk_holding_its_span(tmp_path: Path) -> None:
    # ALPHA0 in windows of 40 characters, 10 shared: [0,40) [30,70) [60,100); "1901" at 55, "Ann Lee" at 63,
    # "Ann Lee and her brother Tom Lee" at 63..94, "river Bo" at 27..35 (across the first border)
    assert (ALPHA0.find("1901"), ALPHA0.find("Ann Lee"), ALPHA0.find("river Bo")) == (55, 63, 27)
    data = articles()
    data[0]["paragraphs"][0]["qas"].append(qa("a4", "Which river?", ALPHA0, "river Bo"))
    d = load_squad(write(tmp_path, data), split="train", dev_titles=["Beta"], chunk=windows(40, 10), log=print)
    assert [p for p in d.corpus if p.startswith("Alpha_One#0")] == ["Alpha_One#0#0", "Alpha_One#0#1", "Alpha_One#0#2"]
    q = d.eval_qrels
    assert q["a1"] == {"Alpha_One#0#1": 1}  # "1901" and "in 1901" lie in the second window only
    # "Ann Lee" lies in windows 1 and 2 (the overlap): the first holding all of it; the long answer only in window 2
    assert q["a2"] == {"Alpha_One#0#1": 1, "Alpha_One#0#2": 1}
    assert q["a4"] == {"Alpha_One#0#0": 1}  # across the first border: the chunk holding its start
    assert q["a3"] == {"Alpha_One#1#1": 1}  # ALPHA1 in [0,40) [30,59): "red stone" at 40 is in the second only
    assert [p for p in d.corpus if p.startswith("Gamma")] == ["Gamma#0#0", "Gamma#0#1"]
    assert q["d1"] == {"Delta#0#0": 1}  # a paragraph that fits one window is one chunk
    assert d.doc_of == {}  # the gold passages are chunks: evaluation is on chunks, not MaxP over paragraphs


def test_gold_passage_of_a_start_between_two_chunk_bodies() -> None:
    # the text "aaaa   bbbb": two chunk bodies with whitespace between them
    chunks = [Passage("p#0", "", "aaaa", "p", 0, 4), Passage("p#1", "", "bbbb", "p", 7, 11)]
    assert gold_passage(chunks, 5, 6).id == "p#0"  # " bbbb" starts in the gap: the last chunk before it
    assert gold_passage(chunks, 7, 4).id == "p#1"


def test_chunked_by_the_corpus_chunker(tmp_path: Path) -> None:
    """The real chunker (whitespace tokens, sentence preference): every gold chunk holds its answer's text."""
    tok = WhitespaceTokenizer()

    def chunk(p: Passage) -> list[Passage]:
        return chunk_passage(p, tok, max_tokens=10, overlap=3)

    d = load_squad(write(tmp_path), split="train", dev_titles=["Beta"], chunk=chunk, log=lambda _: None)
    chunks = [p for p in d.corpus.values() if p.doc_id == "Alpha_One#0"]
    assert len(chunks) >= 2 and all(ALPHA0[c.start : c.end] == c.text for c in chunks)
    for qid in ("a1", "a2", "a3"):
        for pid in d.eval_qrels[qid]:
            assert any(a in d.corpus[pid].text for a in d.answers[qid]), (qid, pid)


# ---------------------------------------------------------------- splits by article


def test_named_splits_and_drawn_splits_never_share_an_article(tmp_path: Path) -> None:
    titles = ["Alpha_One", "Beta", "Gamma", "Delta", "Held_Out"]
    with_q = {"Alpha_One", "Beta", "Gamma", "Delta"}
    for seed in range(6):
        s = split_articles(titles, with_q, test_titles=["Gamma"], dev_articles=1, seed=seed)
        assert set(s) == with_q and s["Gamma"] == "test"  # Held_Out (no questions) is in no split
        assert sorted(s.values()) == ["dev", "test", "train", "train"]
        assert s == split_articles(titles, with_q, test_titles=["Gamma"], dev_articles=1, seed=seed)  # seeded
    draws = {tuple(sorted(split_articles(titles, with_q, dev_articles=0.5, seed=x).items())) for x in range(8)}
    assert len(draws) > 1  # the seed changes the draw
    for draw in draws:
        assert [v for _, v in draw].count("dev") == 2  # round(0.5 x 4 articles)
    # questions follow their article: the splits' questions are disjoint and cover every question
    path = write(tmp_path)
    got = {
        sp: load_squad(path, sp, dev_articles=1, test_articles=1, seed=3, log=lambda _: None)
        for sp in ("train", "dev", "test")
    }
    per_split = [set(got[sp].eval_qrels) for sp in ("train", "dev", "test")]
    assert sum(map(len, per_split)) == 6 and set.union(*per_split) == set(got["dev"].queries)
    assert got["dev"].train_qrels == got["train"].eval_qrels  # training never depends on the evaluated split
    article_of = {"a1": "A", "a2": "A", "a3": "A", "b1": "B", "g1": "G", "d1": "D"}
    assert [len({article_of[q] for q in qs}) for qs in per_split] == [2, 1, 1]


# ---------------------------------------------------------------- bad input: one line naming where and what


def broken(mutate) -> list[dict[str, Any]]:
    data = articles()
    mutate(data)
    return data


@pytest.mark.parametrize(
    "mutate,message",
    [
        (
            lambda d: d[0]["paragraphs"][1].pop("context"),
            r"article 0 \('Alpha_One'\), paragraph 1: missing key 'context'",
        ),
        (
            lambda d: d[0]["paragraphs"][0]["qas"][1].pop("answers"),
            r"article 0 \('Alpha_One'\), paragraph 0, question 1 \(id 'a2'\): missing key 'answers'",
        ),
        (
            lambda d: d[1]["paragraphs"][0]["qas"][0]["answers"][0].update(answer_start="7"),
            r"article 1 \('Beta'\), paragraph 0, question 0 \(id 'b1'\), answer 0: 'answer_start' must be a int",
        ),
        (lambda d: d[2].pop("title"), r"article 2: missing key 'title'"),
        (lambda d: d[3].update(paragraphs={}), r"article 3 \('Delta'\): 'paragraphs' must be a list, got dict"),
        (lambda d: d[2].update(title="Beta"), r"article 2 \('Beta'\): duplicate title \(also article 1\)"),
        (
            lambda d: d[2]["paragraphs"][0]["qas"][0].update(id="b1"),
            r"article 2 \('Gamma'\), paragraph 0, question 0 \(id 'b1'\): duplicate question id \(also .*article 1",
        ),
        (lambda d: d[3]["paragraphs"][0]["qas"][0].update(answers=[]), r"question 0 \(id 'd1'\): 'answers' is empty"),
        (lambda d: d[4]["paragraphs"][0].update(context="  "), r"article 4 \('Held_Out'\), paragraph 0: empty context"),
    ],
)
def test_a_malformed_file_names_the_article_paragraph_and_question(tmp_path: Path, mutate, message: str) -> None:
    with pytest.raises(DataError, match=message):
        read_squad(write(tmp_path, broken(mutate)))


def test_invalid_json_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text('{"version": "1.1",\n "data": [}\n')
    with pytest.raises(DataError, match=r"s.json:2:11: invalid JSON \(Expecting value\)"):
        read_squad(path)


def test_an_answer_start_off_its_text_fails_with_a_count_or_is_skipped(tmp_path: Path) -> None:
    def shift(d: list[dict[str, Any]]) -> None:
        d[0]["paragraphs"][0]["qas"][0]["answers"][1]["answer_start"] += 1  # a1 keeps two good answers
        d[1]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] = 0  # b1 has no good answer left

    path = write(tmp_path, broken(shift))
    with pytest.raises(DataError, match=r"2 answers do not match their context at answer_start \(first: article 0 "
                       r"\('Alpha_One'\), paragraph 0, question 0 \(id 'a1'\), answer 1: 'in 1901' at answer_start "
                       r"\d+ reads 'n 1901 '\); .* data.on_error=skip"):  # fmt: skip
        read_squad(path)
    lines: list[str] = []
    d = load_squad(path, "train", dev_titles=["Gamma"], on_error="skip", log=lines.append)
    assert d.answers["a1"] == ["1901", "1901"] and "b1" not in d.queries and "b1" not in d.train_qrels
    skipped = "\n".join(lines)
    assert "skipped 2 answers not matching their context" in skipped
    assert "skipped 1 questions with no matching answer left" in skipped


def test_a_v2_file_is_refused_with_its_unanswerable_count_or_they_are_skipped(tmp_path: Path) -> None:
    data = articles()
    data[1]["paragraphs"][0]["qas"].append(
        {"id": "b2", "question": "Who lives on Beta?", "answers": [], "is_impossible": True,
         "plausible_answers": [{"text": "Beta", "answer_start": 0}]}
    )  # fmt: skip
    data[0]["paragraphs"][0]["qas"][0]["is_impossible"] = False
    path = write(tmp_path, data, version="v2.0")
    with pytest.raises(DataError, match=r"s.json: a SQuAD v2.0 file \(1 unanswerable question\).*data.on_error=skip"):
        read_squad(path)
    lines: list[str] = []
    d = load_squad(path, "dev", dev_titles=["Beta"], on_error="skip", log=lines.append)
    assert set(d.eval_qrels) == {"b1"} and "a1" in d.train_qrels
    assert "skipped 1 unanswerable questions (SQuAD v2.0)" in "\n".join(lines)
    # the version alone marks a v2.0 file
    with pytest.raises(DataError, match=r"SQuAD v2.0 file \(0 unanswerable"):
        read_squad(write(tmp_path, version="v2.0"))
    # without the version, one unanswerable question marks it too
    with pytest.raises(DataError, match=r"s.json: a SQuAD v2.0 file \(1 unanswerable question\)"):
        read_squad(write(tmp_path, data))


def test_a_v1_file_whose_questions_say_is_impossible_false_is_read_as_v1(tmp_path: Path) -> None:
    data = articles()
    for article in data:
        for para in article["paragraphs"]:
            for q in para["qas"]:
                q["is_impossible"] = False
    assert len(read_squad(write(tmp_path, data)).questions) == 6


def test_one_mismatched_answer_is_named_in_the_singular_and_a_negative_start_is_not_quoted(tmp_path: Path) -> None:
    def negative(d: list[dict[str, Any]]) -> None:
        d[1]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] = -3

    with pytest.raises(DataError) as e:
        read_squad(write(tmp_path, broken(negative)))
    msg = str(e.value)
    assert "1 answer does not match its context at answer_start" in msg
    assert "'3,000' at answer_start -3, before the context's start" in msg and "reads" not in msg


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"test_titles": ["Alpha One"]}, r"data.test_titles names 'Alpha One', .* close matches: \['Alpha_One'\]"),
        (
            {"dev_titles": ["Held_Out"]},
            r"data.dev_titles names 'Held_Out', an article without questions in this file .*"
            r"choose articles with questions, e.g. \['Alpha_One', 'Beta', 'Gamma'\]",
        ),
        (
            {"split": "test"},
            r"data.split=test is empty: no article is in it \(set data.test_titles or data.test_articles\)",
        ),
        ({"dev_articles": 5}, r"data.dev_articles=5 asks for 5 articles, but only 4 articles with questions are left"),
        (
            {"split": "train", "dev_titles": ["Alpha_One", "Beta"], "test_titles": ["Gamma", "Delta"]},
            r"data.split=train is empty",
        ),
    ],
)
def test_bad_split_settings_name_the_key(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    kwargs = {"split": "dev", "dev_titles": ["Beta"], **kwargs}
    if "dev_articles" in kwargs:
        kwargs["dev_titles"] = []
    with pytest.raises(DataError, match=message):
        load_squad(write(tmp_path), log=lambda _: None, **kwargs)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["data.dev_size=10"],
            r"data.dev_size applies to data=beir and data=documents only \(data=squad .* splits it by article",
        ),
        (["data.test_titles=[Beta]", "data.test_articles=2"], r"data.test_articles must be 0 when data.test_titles"),
        (["data.dev_titles=[Beta]", "data.dev_articles=0", "data.test_titles=[Beta]"], r"shares \['Beta'\] with"),
        (["data.dev_titles=[Beta,Beta]", "data.dev_articles=0"], r"data.dev_titles names \['Beta'\] more than once"),
        (["data.split=validation"], r"data.split must be one of \['train', 'dev', 'test'\] with data=squad"),
        (["data.dev_articles=1.5"], r"data.dev_articles must be 0 \(none\), a count"),
        (["data=beir", "data.root=/x", "data.test_titles=[Beta]"], r"data.test_titles applies to data=squad only"),
    ],
)
def test_bad_squad_config_names_the_key(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        to_typed(compose(["data=squad", f"data.root={tmp_path}", *overrides, f"output_dir={tmp_path / 'out'}"]))


def test_load_data_reads_squad_composed_as_users_compose_it(tmp_path: Path) -> None:
    (tmp_path / "sq").mkdir()
    write(tmp_path / "sq")
    cfg = to_typed(
        compose(
            [
                "data=squad",
                f"data.root={tmp_path / 'sq'}",
                "data.test_titles=[Gamma,Delta]",
                "data.split=test",
                "data.dev_articles=1",
                f"output_dir={tmp_path / 'out'}",
            ]
        )
    )
    d = load_data(cfg.data, cfg.retriever, tmp_path / "out")
    assert set(d.eval_qrels) == {"g1", "d1"} and len(d.corpus) == 6
    assert type(d.corpus).__name__ == "PassageStore" and d.corpus["Gamma#0"].text == GAMMA0
    # one of the two other articles is drawn as dev: train holds the other one, whole
    assert set(d.train_qrels) in ({"a1", "a2", "a3"}, {"b1"})


def test_cli_bad_squad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "sq").mkdir()
    write(tmp_path / "sq")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ragtrain",
            "data=squad",
            f"data.root={tmp_path / 'sq'}",
            "data.test_titles=[Warsw]",
            "data.split=test",
            "stages=[index]",
            f"output_dir={tmp_path / 'out'}",
            "logger=none",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("data error: data.test_titles names 'Warsw'")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# ---------------------------------------------------------------- the shared SQuAD v1.1 file


@pytest.mark.skipif(not SQUAD.exists(), reason=f"SQuAD not present at {SQUAD}")
def test_the_shared_squad_file() -> None:
    raw = json.loads(next(SQUAD.glob("*.json")).read_text())
    asked = {a["title"]: sum(len(p["qas"]) for p in a["paragraphs"]) for a in raw["data"]}
    pair = ["Normans", "Nikola_Tesla"]
    d = load_squad(SQUAD, "test", test_titles=pair, dev_articles=4, log=lambda _: None)
    assert len(d.corpus) == 2067 and len(d.queries) == 7894  # every paragraph, every question of the 38 articles
    assert len(d.eval_qrels) == asked["Normans"] + asked["Nikola_Tesla"]
    assert all(next(iter(g)).split("#")[0] in pair for g in d.eval_qrels.values())
    assert len(d.train_qrels) + len(d.eval_qrels) < 7894  # the 4 dev articles' questions are in neither
    assert sum(n == 0 for n in asked.values()) == 10  # held-out articles: corpus only
    # this file holds out Super_Bowl_50's and Warsaw's questions: naming them is refused, not evaluated on nothing
    with pytest.raises(DataError, match=r"data.test_titles names 'Super_Bowl_50', an article without questions"):
        load_squad(SQUAD, "test", test_titles=["Super_Bowl_50", "Warsaw"], log=lambda _: None)
    for qid, golds in d.eval_qrels.items():  # one gold paragraph, holding every answer of its question
        ((pid, grade),) = golds.items()
        assert grade == 1 and all(a in d.corpus[pid].text for a in d.answers[qid])
