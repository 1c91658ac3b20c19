"""Read a SQuAD v1.1 file as an open-domain QA set: every paragraph a passage, every question with all its answers.

File: the official schema, ``{"version": "1.1", "data": [{"title", "paragraphs": [{"context", "qas": [{"id",
"question", "answers": [{"text", "answer_start"}]}]}]}]}``. ``data.root`` is that file, or a folder holding exactly
one ``*.json`` file (any other count is an error naming the folder and the files found).

Corpus: paragraph ``j`` of the article titled ``T`` is passage ``T#j`` (0-based, file order), with the title, its
underscores read as spaces (``Super_Bowl_50`` -> "Super Bowl 50"), as the passage title and the context, exactly as
in the file, as its text (answer offsets index it). Articles without questions stay in the corpus. With
``data.chunk.enabled`` each paragraph is split by the corpus chunker (ragtrain/corpus/chunk.py: ids ``T#j#k``, a
chunk's character span in the context) and the gold passages are chunks.

Gold passages (qrels, grade 1): for each answer, the passage holding its span ``[answer_start, answer_start +
len(text))``: the paragraph; chunked, the first chunk that holds the whole span, else (a span across a chunk border)
the first chunk that holds its start. A question whose answers lie in different chunks has each of them as gold.

Answers: every gold answer's text, in file order (duplicates kept, as the official evaluation reads them).

Splits: by article, never by question (`split_articles`).

Bad input (``DataError``, one line naming the file and the article / paragraph / question by index and title):
invalid JSON or UTF-8, a missing or mistyped field, an empty context or question, a duplicate question id or
article title; an ``answer_start`` whose span does not read its ``text`` (counted; ``data.on_error=fail`` refuses the
file, ``skip`` drops those answers, and a question left with none); a SQuAD v2.0 file (``version`` v2.0, or
``is_impossible`` / ``plausible_answers`` keys: refused under ``fail`` with the count of unanswerable questions;
under ``skip`` those questions are dropped and counted, the answerable ones kept).
"""

from __future__ import annotations

import difflib
import json
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .clean import check_id
from .store import write_store
from .types import DataError, Passage, RetrievalData

__all__ = ["SquadFile", "load_squad", "read_squad", "split_articles", "squad_file"]

SPLITS = ("train", "dev", "test")
# Splits a passage into chunk passages (id, doc_id, start, end set; text = the paragraph's text[start:end])
Chunker = Callable[[Passage], list[Passage]]


@dataclass
class Question:
    """One SQuAD question: its article, paragraph (passage id) and every kept answer (text, answer_start)."""

    id: str
    text: str
    title: str
    paragraph: str
    answers: list[tuple[str, int]]


@dataclass
class SquadFile:
    """A parsed SQuAD file: articles in file order (title -> contexts), questions, and what was skipped."""

    path: Path
    articles: dict[str, list[str]] = field(default_factory=dict)
    questions: list[Question] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)  # what data.on_error=skip dropped, by kind


def squad_file(root: str | Path) -> Path:
    """data.root as the SQuAD file: the file itself, or the one *.json file in the folder."""
    root = Path(root)
    if not root.exists():
        raise DataError(
            f"data.root={str(root)!r} does not exist: point data.root at a SQuAD v1.1 .json file or the folder "
            "that holds it (the data=squad default is $RAGTRAIN_DATA/squad, else ../shared/data/squad)"
        )
    if root.is_file():
        return root
    found = sorted(p for p in root.glob("*.json") if p.is_file())
    if len(found) != 1:
        names = [p.name for p in found]
        raise DataError(
            f"data.root={str(root)!r} must hold exactly one SQuAD *.json file, found {len(found)}"
            + (f" ({names[:5]}): point data.root at one of them" if found else "")
        )
    return found[0]


def _where(path: Path, a: int, title: Any, p: int | None = None, q: int | None = None, qid: Any = None) -> str:
    """'<file>: article 3 ('Warsaw'), paragraph 2, question 0 (id '5733...')'."""
    out = f"{path}: article {a}" + (f" ({title!r})" if isinstance(title, str) else "")
    if p is not None:
        out += f", paragraph {p}"
    if q is not None:
        out += f", question {q}" + (f" (id {qid!r})" if isinstance(qid, str) else "")
    return out


def _field(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """obj[key], which must exist and be of `kind` (bool is not an int here)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise DataError(f"{where}: missing key {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise DataError(f"{where}: {key!r} must be a {name}, got {type(value).__name__}")
    return value


def _load_json(path: Path) -> Any:
    """The file's JSON; a UTF-8 or JSON error names the byte offset or line:column."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a leading BOM is dropped
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 at byte offset {e.start} ({e.reason})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}:{e.colno}: invalid JSON ({e.msg})") from None


def _is_v2(doc: dict[str, Any]) -> tuple[bool, int]:
    """(whether the file is SQuAD v2.0, its count of unanswerable questions). v2.0 by its version, or by a question
    that is unanswerable (`is_impossible` true, or no answers beside v2.0's `plausible_answers`): v1.1 files in the
    wild carry `is_impossible: false` on answerable questions, and those stay v1.1."""
    v2 = str(doc.get("version", "")).lstrip("v") == "2.0"
    unanswerable = 0
    for article in doc["data"]:
        for para in article.get("paragraphs", []) if isinstance(article, dict) else []:
            for qa in para.get("qas", []) if isinstance(para, dict) else []:
                unanswerable += isinstance(qa, dict) and _unanswerable(qa)
    return v2 or unanswerable > 0, unanswerable


def _unanswerable(qa: dict[str, Any]) -> bool:
    """A SQuAD v2.0 question without an answer: marked impossible, or holding only plausible answers."""
    return bool(qa.get("is_impossible")) or ("plausible_answers" in qa and not qa.get("answers"))


def _answers(qa: dict[str, Any], context: str, where: str, mismatched: list[str]) -> list[tuple[str, int]]:
    """A question's (text, answer_start) answers whose span reads their text; the others go to `mismatched`."""
    golds = _field(qa, "answers", list, where)
    if not golds:
        raise DataError(f"{where}: 'answers' is empty (SQuAD v1.1 questions have at least one)")
    kept: list[tuple[str, int]] = []
    for i, ans in enumerate(golds):
        aw = f"{where}, answer {i}"
        text = _field(ans, "text", str, aw)
        start = _field(ans, "answer_start", int, aw)
        if not text.strip():
            raise DataError(f"{aw}: empty answer text")
        if start < 0:
            mismatched.append(f"{aw}: {text!r} at answer_start {start}, before the context's start")
            continue
        if context[start : start + len(text)] != text:
            mismatched.append(f"{aw}: {text!r} at answer_start {start} reads {context[start : start + len(text)]!r}")
            continue
        kept.append((text, start))
    return kept


def read_squad(root: str | Path, on_error: str = "fail") -> SquadFile:
    """Parse and check the SQuAD file at data.root (see the module doc); raises DataError on bad input."""
    if on_error not in ("fail", "skip"):
        raise DataError(f"data.on_error must be one of ['fail', 'skip'], got {on_error!r}")
    path = squad_file(root)
    doc = _load_json(path)
    where = str(path)
    articles = _field(doc, "data", list, where)
    v2, unanswerable = _is_v2(doc)
    if v2 and on_error == "fail":
        raise DataError(
            f"{path}: a SQuAD v2.0 file ({unanswerable} unanswerable question{'s' * (unanswerable != 1)}); "
            "data=squad reads SQuAD v1.1: set "
            "data.on_error=skip to drop the unanswerable questions (counted) and keep the answerable ones"
        )
    out = SquadFile(path)
    seen_q: dict[str, str] = {}
    seen_title: dict[str, int] = {}
    mismatched: list[str] = []  # where each answer whose answer_start does not read its text is
    for a, article in enumerate(articles):
        title = _field(article, "title", str, _where(path, a, None))
        at = _where(path, a, title)
        if not title.strip():
            raise DataError(f"{at}: empty title")
        check_id(title, at, kind="article")  # the title is part of every passage id
        if title in seen_title:
            raise DataError(f"{at}: duplicate title (also article {seen_title[title]})")
        seen_title[title] = a
        contexts: list[str] = []
        for p, para in enumerate(_field(article, "paragraphs", list, at)):
            pw = _where(path, a, title, p)
            context = _field(para, "context", str, pw)
            if not context.strip():
                raise DataError(f"{pw}: empty context")
            contexts.append(context)
            for q, qa in enumerate(_field(para, "qas", list, pw)):
                qw = _where(path, a, title, p, q, qa.get("id") if isinstance(qa, dict) else None)
                qid = _field(qa, "id", str, qw)
                text = _field(qa, "question", str, qw)
                if not text.strip():
                    raise DataError(f"{qw}: empty question")
                check_id(qid, qw, kind="question")
                if qid in seen_q:
                    raise DataError(f"{qw}: duplicate question id (also {seen_q[qid]})")
                seen_q[qid] = qw
                if v2 and (_unanswerable(qa) or not qa.get("answers")):  # only under skip: fail stopped above
                    out.skipped["unanswerable questions (SQuAD v2.0)"] += 1
                    continue
                kept = _answers(qa, context, qw, mismatched)
                if kept:
                    out.questions.append(Question(qid, text, title, f"{title}#{p}", kept))
                else:  # only under skip: fail stops below, before anything is used
                    out.skipped["questions with no matching answer left"] += 1
        out.articles[title] = contexts
    if mismatched:
        if on_error == "fail":
            n = len(mismatched)
            raise DataError(
                f"{path}: {n} answer{' does not match its' if n == 1 else 's do not match their'} context at "
                f"answer_start (first: "
                f"{mismatched[0].removeprefix(f'{path}: ')}); fix the file, or set data.on_error=skip to drop those "
                "answers (and a question left with none)"
            )
        out.skipped["answers not matching their context at answer_start"] = len(mismatched)
    if not out.articles:
        raise DataError(f"{path}: no articles ('data' is empty)")
    return out


def _count(size: float, n: int) -> int:
    """A count (int >= 1) or a fraction in (0, 1) of `n` articles, rounded (at least 1 for a fraction > 0)."""
    if isinstance(size, float) and 0 < size < 1:
        return max(1, round(size * n))
    return int(size)


def _unknown(key: str, names: Sequence[str], titles: Sequence[str], with_questions: set[str]) -> None:
    """A split list naming a title the file lacks, or an article without questions: one line, close matches."""
    for name in names:
        if name not in titles:
            close = difflib.get_close_matches(name, titles, n=3, cutoff=0.5)
            hint = f"; close matches: {close}" if close else f"; titles look like {list(titles)[:3]}"
            raise DataError(f"data.{key} names {name!r}, which is not an article title of the file{hint}")
        if name not in with_questions:
            some = [t for t in titles if t in with_questions][:3]
            raise DataError(
                f"data.{key} names {name!r}, an article without questions in this file (its paragraphs are in "
                f"the corpus only, e.g. held out for independent evaluation): choose articles with questions, "
                f"e.g. {some}"
            )


def split_articles(
    titles: Sequence[str],
    with_questions: set[str],
    dev_titles: Sequence[str] = (),
    test_titles: Sequence[str] = (),
    dev_articles: float = 0,
    test_articles: float = 0,
    seed: int = 0,
) -> dict[str, str]:
    """article title -> "train" | "dev" | "test", for the articles with questions (the others are in no split).

    Named titles first; then `test_articles`, then `dev_articles` are drawn from the remaining articles (sorted,
    shuffled with `seed`: the draw depends only on the titles and the seed); train is the rest."""
    _unknown("dev_titles", dev_titles, titles, with_questions)
    _unknown("test_titles", test_titles, titles, with_questions)
    split = {t: "dev" for t in dev_titles} | {t: "test" for t in test_titles}
    rest = sorted(t for t in with_questions if t not in split)
    random.Random(seed).shuffle(rest)
    for name, size in (("test", test_articles), ("dev", dev_articles)):
        n = _count(size, len(with_questions))
        if n > len(rest):
            raise DataError(
                f"data.{name}_articles={size} asks for {n} articles, but only {len(rest)} articles with "
                "questions are left for it"
            )
        split |= {t: name for t in rest[:n]}
        rest = rest[n:]
    return split | {t: "train" for t in rest}


def load_squad(
    root: str | Path,
    split: str = "dev",
    dev_titles: Sequence[str] = (),
    test_titles: Sequence[str] = (),
    dev_articles: float = 0,
    test_articles: float = 0,
    seed: int = 0,
    on_error: str = "fail",
    store_path: str | Path | None = None,
    chunk: Chunker | None = None,
    log: Callable[[str], None] = print,
) -> RetrievalData:
    """The SQuAD file at `root` as RetrievalData (see the module doc): every paragraph (or, with `chunk`, its chunks)
    in the corpus, qrels on the passage of each answer, every gold answer kept, split by article."""
    if split not in SPLITS:
        raise DataError(f"data.split={split!r}: data=squad has the splits {list(SPLITS)}")
    sq = read_squad(root, on_error)
    titles = list(sq.articles)
    with_questions = {q.title for q in sq.questions}
    split_of = split_articles(titles, with_questions, dev_titles, test_titles, dev_articles, test_articles, seed)
    members = sorted((t for t, s in split_of.items() if s == split), key=titles.index)
    if not members:
        how = {"train": "every article with questions is in dev or test", "dev": "set data.dev_titles or "
               "data.dev_articles", "test": "set data.test_titles or data.test_articles"}[split]  # fmt: skip
        raise DataError(f"data.split={split} is empty: no article is in it ({how})")

    passages: list[Passage] = []
    chunks_of: dict[str, list[Passage]] = {}
    for title, contexts in sq.articles.items():
        for j, context in enumerate(contexts):
            para = Passage(id=f"{title}#{j}", title=title.replace("_", " "), text=context)
            chunks_of[para.id] = chunk(para) if chunk is not None else [para]
            passages.extend(chunks_of[para.id])

    qrels: dict[str, dict[str, dict[str, int]]] = {s: {} for s in SPLITS}
    queries: dict[str, str] = {}
    answers: dict[str, list[str]] = {}
    for q in sq.questions:
        queries[q.id] = q.text
        answers[q.id] = [text for text, _ in q.answers]
        gold = {gold_passage(chunks_of[q.paragraph], start, len(text)).id: 1 for text, start in q.answers}
        qrels[split_of[q.title]][q.id] = gold

    for kind, n in sq.skipped.items():
        log(f"[data] {sq.path}: skipped {n} {kind} (data.on_error=skip)")
    counts = {s: sum(1 for v in split_of.values() if v == s) for s in SPLITS}
    log(
        f"[data] {sq.path.name}: {len(titles)} articles ({len(titles) - len(with_questions)} without questions, "
        f"corpus only), {sum(map(len, sq.articles.values()))} paragraphs -> {len(passages)} passages, "
        f"{len(queries)} questions; articles train/dev/test {counts['train']}/{counts['dev']}/{counts['test']} "
        f"({len(qrels['train'])}/{len(qrels['dev'])}/{len(qrels['test'])} questions)"
    )
    corpus: Mapping[str, Passage] = (
        {p.id: p for p in passages} if store_path is None else write_store(store_path, passages)
    )
    return RetrievalData(
        name=sq.path.stem,
        corpus=corpus,
        queries=queries,
        train_qrels=qrels["train"],
        eval_qrels=qrels[split],
        split=split,
        answers=answers,
    )


def gold_passage(chunks: Sequence[Passage], start: int, length: int) -> Passage:
    """The passage of `chunks` (one paragraph's, in order) holding the answer span [start, start + length): the
    first holding all of it, else the first holding its start, else (a start in whitespace between two chunks'
    bodies) the last chunk beginning at or before it. An unchunked paragraph is its own one passage."""
    if len(chunks) == 1:
        return chunks[0]
    end = start + length
    for c in chunks:
        if c.start <= start and end <= c.end:
            return c
    for c in chunks:
        if c.start <= start < c.end:
            return c
    before = [c for c in chunks if c.start <= start]
    return before[-1] if before else chunks[0]
