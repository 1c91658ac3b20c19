"""Load and write retrieval datasets in the BEIR folder format.

Folder layout::

    <root>/corpus.jsonl      (or corpus.jsonl.gz)  {"_id", "title"?, "text", "metadata"?} per line
    <root>/queries.jsonl     (or queries.jsonl.gz) {"_id", "text", "metadata"?} per line
    <root>/qrels/<split>.tsv header ``query-id<TAB>corpus-id<TAB>score``, then one pair per line

If both a plain and a ``.gz`` file exist, the plain one is read. A query's
``metadata.answers`` (a list of strings) or ``metadata.answer`` (one string), when present, is loaded into
``RetrievalData.answers`` (``write_beir`` writes ``metadata.answers``: the synthetic KB's or SQuAD's short answers).

Split semantics
---------------
* ``dev``: if ``qrels/dev.tsv`` exists it is the dev split and ``train_qrels`` is all
  of ``qrels/train.tsv``. Otherwise dev is *carved* from train: the sorted train
  query ids are shuffled with ``random.Random(seed)`` and the first ``dev_size`` of
  them (int = count, float in (0, 1) = fraction of train queries, rounded) are dev;
  ``train_qrels`` is train minus those queries. The carve is deterministic per seed.
* ``train``: ``eval_qrels`` equals ``train_qrels`` (train minus dev).
* any other name (e.g. ``test``): ``eval_qrels`` comes from ``qrels/<split>.tsv``.
  ``train_qrels`` is still train minus dev -- the carve happens whenever
  ``qrels/train.tsv`` exists -- so training data never depends on the evaluated split.
* without ``qrels/train.tsv`` (an eval-only folder) ``train_qrels`` is ``{}`` and
  ``dev`` / ``train`` cannot be evaluated.

Rows with score <= 0 are kept (graded qrels); deciding relevance is the evaluator's job.
Every problem raises ``DataError`` naming the file (and line) and the reason.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .clean import check_id
from .store import write_store
from .types import DataError, Passage, RetrievalData

__all__ = ["load_beir", "write_beir"]

Qrels = dict[str, dict[str, int]]


def _find_file(root: Path, name: str) -> Path | None:
    """Return ``root/name`` or ``root/name.gz``, whichever exists (plain first), else None."""
    for candidate in (root / name, root / (name + ".gz")):
        if candidate.is_file():
            return candidate
    return None


def _open_bytes(path: Path) -> gzip.GzipFile | io.BufferedReader:
    """Open a file for reading bytes, gunzipping transparently when it ends in ``.gz``."""
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Yield ``(1-based line number, line)`` for non-blank lines; a UTF-8 error names its line and byte offset
    (decoded a line at a time, so the offset is the file's, not a decoder buffer's); a leading BOM is dropped."""
    offset = 0
    try:
        with _open_bytes(path) as f:
            # Numbering counts blank lines too, so messages match what an editor shows.
            for lineno, raw in enumerate(f, start=1):
                if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                    raw, offset = raw[len(codecs.BOM_UTF8) :], len(codecs.BOM_UTF8)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    gz = " of the uncompressed text" if path.suffix == ".gz" else ""
                    raise DataError(
                        f"{path}:{lineno}: not valid UTF-8 at byte offset {offset + e.start}{gz} ({e.reason})"
                    ) from None
                offset += len(raw)
                if line.strip():
                    yield lineno, line
    except (gzip.BadGzipFile, EOFError) as e:
        raise DataError(f"{path}: corrupt gzip file ({e})") from e


def _read_jsonl(
    path: Path, required: tuple[str, ...], optional: tuple[str, ...], kind: str
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line, object)`` from a JSONL file, checking required/optional string keys and unique ``_id``s (of
    a `kind`: "document" or "query")."""
    seen: set[str] = set()
    for lineno, line in _numbered_lines(path):
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e})") from e
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        for key in required:
            if key not in obj:
                raise DataError(f"{where}: missing key '{key}'")
        for key in required + optional:
            if key in obj and not isinstance(obj[key], str):
                raise DataError(f"{where}: key '{key}' must be a string, got {type(obj[key]).__name__}")
        if obj["_id"] in seen:
            raise DataError(f"{where}: duplicate _id '{obj['_id']}'")
        check_id(obj["_id"], where, kind=kind)
        seen.add(obj["_id"])
        yield lineno, obj


def _corpus_passages(path: Path) -> Iterator[Passage]:
    """The passages of a BEIR corpus file in file order, one line at a time."""
    for lineno, obj in _read_jsonl(path, required=("_id", "text"), optional=("title",), kind="document"):
        if not (obj["text"].strip() or obj.get("title", "").strip()):  # it would be indexed as an empty passage
            raise DataError(f"{path}:{lineno}: document {obj['_id']!r} has no text (empty title and text)")
        yield Passage(id=obj["_id"], title=obj.get("title", ""), text=obj["text"])


def _read_corpus(path: Path, store_path: Path | None = None) -> Mapping[str, Passage]:
    """Parse a BEIR corpus file into ``{doc id: Passage}`` in file order: a dict, or with `store_path` a
    `PassageStore` written line by line (the corpus is never in memory)."""
    if store_path is None:
        corpus: Mapping[str, Passage] = {p.id: p for p in _corpus_passages(path)}
    else:
        corpus = write_store(store_path, _corpus_passages(path))
    if not len(corpus):
        raise DataError(f"{path}: corpus is empty (no passages)")
    return corpus


def _read_queries(path: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Parse a BEIR queries file into ``({qid: text}, {qid: gold answers from metadata})``."""
    queries: dict[str, str] = {}
    answers: dict[str, list[str]] = {}
    for lineno, obj in _read_jsonl(path, required=("_id", "text"), optional=(), kind="query"):
        if not obj["text"].strip():
            raise DataError(f"{path}:{lineno}: query {obj['_id']!r} has no text")
        queries[obj["_id"]] = obj["text"]
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            continue
        golds = meta.get("answers")
        if isinstance(golds, list) and golds and all(isinstance(a, str) for a in golds):
            answers[obj["_id"]] = list(golds)
        elif isinstance(meta.get("answer"), str):
            answers[obj["_id"]] = [meta["answer"]]
    return queries, answers


def _read_qrels(path: Path, doc_alias: dict[str, str] | None = None) -> Qrels:
    """Parse a ``query-id<TAB>corpus-id<TAB>score`` file into ``{qid: {docid: score}}`` (aliases resolved)."""
    qrels: Qrels = {}
    named_as: dict[tuple[str, str], str] = {}  # (query, kept document) -> the id its first judgment named
    first = True
    for lineno, line in _numbered_lines(path):
        where = f"{path}:{lineno}"
        if first and line.startswith("query-id"):
            first = False
            continue  # the BEIR header row
        first = False
        cols = [c.strip() for c in line.rstrip("\r\n").split("\t")]
        if len(cols) != 3:
            raise DataError(f"{where}: expected 3 tab-separated columns (query-id, corpus-id, score), got {len(cols)}")
        qid, docid, raw_score = cols
        if not qid or not docid:
            raise DataError(f"{where}: empty query-id or corpus-id")
        try:
            score = int(raw_score)
        except ValueError:
            raise DataError(f"{where}: score {raw_score!r} is not an integer") from None
        named, docid = docid, (doc_alias or {}).get(docid, docid)  # a dropped duplicate: judge its kept copy
        grades = qrels.setdefault(qid, {})
        # An exact repeat is harmless; conflicting grades mean the file is wrong.
        if docid in grades and grades[docid] != score:
            earlier = named_as[(qid, docid)]
            if earlier != named:  # the conflict comes from deduplication: say so, the pair is not repeated as such
                raise DataError(
                    f"{where}: ({qid!r}, {named!r}) has score {score}, but this query scores "
                    f"{earlier!r} {grades[docid]}, and the two are exact duplicates (one document after "
                    f"deduplication): score the copies alike or remove one"
                )
            raise DataError(
                f"{where}: pair ({qid!r}, {docid!r}) repeated with a different score ({grades[docid]} vs {score})"
            )
        grades[docid] = score
        named_as.setdefault((qid, docid), named)
    return qrels


def _check_ids(path: Path, qrels: Qrels, corpus: Mapping[str, Passage], queries: dict[str, str]) -> None:
    """Raise one DataError listing qrels ids absent from the queries or the corpus."""
    bad_q = [q for q in qrels if q not in queries]
    bad_d: dict[str, None] = {}  # dict as an ordered set: first-seen order, no duplicates
    for grades in qrels.values():
        for d in grades:
            if d not in corpus:
                bad_d[d] = None
    if not bad_q and not bad_d:
        return
    parts = []
    if bad_q:
        parts.append(f"{len(bad_q)} unknown query id(s) (not in queries), first: {bad_q[:5]}")
    if bad_d:
        parts.append(f"{len(bad_d)} unknown corpus id(s) (not in corpus), first: {list(bad_d)[:5]}")
    raise DataError(f"{path}: " + "; ".join(parts))


def _dev_count(dev_size: int | float, n_train: int, train_path: Path) -> int:
    """Turn ``data.dev_size`` (count or fraction) into a validated number of dev queries."""
    if isinstance(dev_size, bool) or not isinstance(dev_size, (int, float)):
        raise DataError(f"data.dev_size must be an int or a float in (0, 1), got {dev_size!r}")
    if isinstance(dev_size, float):
        if not 0.0 < dev_size < 1.0:
            raise DataError(f"data.dev_size={dev_size} as a fraction must be in (0, 1)")
        count = round(dev_size * n_train)
    else:
        count = dev_size
    if count <= 0 or count >= n_train:
        raise DataError(
            f"data.dev_size={dev_size} gives {count} dev queries, but it must be between 1 and "
            f"{n_train - 1}: {train_path} has {n_train} train queries and training needs at least one"
        )
    return count


def check_split(root: Path, split: str) -> None:
    """`split` has qrels under `root` (dev may be carved from train.tsv): else one line with the valid splits."""
    qrels_dir = root / "qrels"
    available = sorted(p.stem for p in qrels_dir.glob("*.tsv")) if qrels_dir.is_dir() else []
    train_path, dev_path = qrels_dir / "train.tsv", qrels_dir / "dev.tsv"
    has_train, has_dev = train_path.is_file(), dev_path.is_file()
    choices = available + (["dev"] if has_train and not has_dev else [])
    split_ok = (split == "dev" and (has_dev or has_train)) or (split != "dev" and split in available)
    if not split_ok:
        wanted = dev_path if split == "dev" else qrels_dir / f"{split}.tsv"
        extra = " (dev is carved from train.tsv when dev.tsv is absent)" if split == "dev" else ""
        raise DataError(
            f"qrels file {wanted} not found{extra}; valid splits for {root}: "
            + (", ".join(sorted(choices)) if choices else f"none (no .tsv files in {qrels_dir})")
        )


def _splits(
    root: Path,
    split: str,
    dev_size: int | float,
    seed: int,
    corpus: Mapping[str, Passage],
    queries: dict[str, str],
    doc_alias: dict[str, str] | None,
) -> tuple[Qrels, Qrels]:
    """(train qrels, evaluated qrels): a dev split carved from train (seeded) when there is no qrels/dev.tsv."""
    qrels_dir = root / "qrels"
    train_path, dev_path = qrels_dir / "train.tsv", qrels_dir / "dev.tsv"
    has_train, has_dev = train_path.is_file(), dev_path.is_file()
    train: Qrels = {}
    if has_train:
        train = _read_qrels(train_path, doc_alias)
        _check_ids(train_path, train, corpus, queries)
    if has_dev:
        dev = _read_qrels(dev_path, doc_alias)
        _check_ids(dev_path, dev, corpus, queries)
        train_qrels = train
    elif train:
        # Sort first so the carve depends only on the ids and the seed, not on file order.
        order = sorted(train)
        random.Random(seed).shuffle(order)
        dev_ids = set(order[: _dev_count(dev_size, len(order), train_path)])
        dev = {q: g for q, g in train.items() if q in dev_ids}
        train_qrels = {q: g for q, g in train.items() if q not in dev_ids}
    else:
        dev, train_qrels = {}, {}

    if split == "train":
        eval_path, eval_qrels = train_path, train_qrels
    elif split == "dev":
        eval_path, eval_qrels = (dev_path if has_dev else train_path), dev
    else:
        eval_path = qrels_dir / f"{split}.tsv"
        eval_qrels = _read_qrels(eval_path, doc_alias)
        _check_ids(eval_path, eval_qrels, corpus, queries)
    if not eval_qrels:
        raise DataError(f"{eval_path}: no qrels for split '{split}'")
    return train_qrels, eval_qrels


def load_beir(
    root: str | Path,
    split: str = "dev",
    dev_size: int | float = 100,
    seed: int = 0,
    corpus: Mapping[str, Passage] | None = None,
    doc_alias: dict[str, str] | None = None,
    store_path: str | Path | None = None,
) -> RetrievalData:
    """Load a BEIR-format folder, carving a dev split from train when there is no qrels/dev.tsv.

    With ``corpus`` (a folder of raw documents, ragtrain/corpus) no corpus file is read and qrels ids are checked
    against that corpus; ``doc_alias`` maps dropped duplicate document ids to the kept ones. With ``store_path``
    the corpus file streams into a `PassageStore` there instead of a dict.
    """
    root = Path(root)
    if not root.exists():
        raise DataError(
            f"data.root={str(root)!r} does not exist: point data.root at a BEIR folder, or set "
            "RAGTRAIN_DATA to the folder that holds it (the data=scifact default is "
            "$RAGTRAIN_DATA/scifact, else ../shared/data/scifact next to the checkout)"
        )
    if not root.is_dir():
        raise DataError(f"data root {root} is not a directory")
    corpus_path = _find_file(root, "corpus.jsonl")
    if corpus_path is None and corpus is None:
        raise DataError(f"corpus file missing: neither {root / 'corpus.jsonl'} nor {root / 'corpus.jsonl.gz'} exists")
    queries_path = _find_file(root, "queries.jsonl")
    if queries_path is None:
        raise DataError(f"queries file missing: {root / 'queries.jsonl'} does not exist")

    check_split(root, split)  # before parsing anything big, so a typo fails instantly
    if corpus is None:
        assert corpus_path is not None
        corpus = _read_corpus(corpus_path, Path(store_path) if store_path is not None else None)
    queries, answers = _read_queries(queries_path)

    train_qrels, eval_qrels = _splits(root, split, dev_size, seed, corpus, queries, doc_alias)
    # Copy the per-query dicts so mutating eval_qrels can never alter train_qrels (split=train).
    return RetrievalData(
        name=root.resolve().name,
        corpus=corpus,
        queries=queries,
        train_qrels={q: dict(g) for q, g in train_qrels.items()},
        eval_qrels={q: dict(g) for q, g in eval_qrels.items()},
        split=split,
        answers=answers,
    )


def write_beir(data: RetrievalData, root: str | Path, qrels: dict[str, dict[str, dict[str, int]]]) -> None:
    """Write ``data`` as a BEIR folder: corpus.jsonl, queries.jsonl and qrels/<name>.tsv per entry of ``qrels``."""
    root = Path(root)
    for name in qrels:
        # The split name becomes a file name; refuse anything that could escape qrels/.
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise DataError(f"invalid qrels split name {name!r}")
    (root / "qrels").mkdir(parents=True, exist_ok=True)
    with open(root / "corpus.jsonl", "w", encoding="utf-8") as f:
        for p in data.corpus.values():
            f.write(json.dumps({"_id": p.id, "title": p.title, "text": p.text}, ensure_ascii=False) + "\n")
    with open(root / "queries.jsonl", "w", encoding="utf-8") as f:
        for qid, text in data.queries.items():
            obj: dict[str, Any] = {"_id": qid, "text": text}
            if qid in data.answers:
                obj["metadata"] = {"answers": list(data.answers[qid])}
            f.write(json.dumps(obj, ensure_ascii=False) + "\n")
    for name, split_qrels in qrels.items():
        with open(root / "qrels" / f"{name}.tsv", "w", encoding="utf-8") as f:
            f.write("query-id\tcorpus-id\tscore\n")
            for qid, grades in split_qrels.items():
                for docid, score in grades.items():
                    f.write(f"{qid}\t{docid}\t{int(score)}\n")
