"""The `data:` group (conf/data/*.yaml): where the corpus, queries and qrels come from, and how they are split
and chunked."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ragtrain.errors import check as _check
from ragtrain.errors import driver_path


class DataSource(str, Enum):
    synthetic = "synthetic"
    beir = "beir"
    documents = "documents"  # a folder of raw documents (ragtrain/corpus): txt, md, html, jsonl, parquet
    squad = "squad"  # a SQuAD v1.1 JSON file: every paragraph a passage, questions with all their answers


class OnError(str, Enum):
    fail = "fail"
    skip = "skip"


class Prepare(str, Enum):
    auto = "auto"  # on Ray Data once the corpus files hold 64 MiB or more (ragtrain/corpus/prepare.py)
    driver = "driver"
    ray = "ray"


@dataclass
class ChunkConfig:
    """Split documents into passages with the retriever's tokenizer (ragtrain/corpus/chunk.py)."""

    enabled: bool = False
    max_tokens: int = 128  # tokens of a passage, its prepended title included (special tokens excluded)
    overlap: int = 32  # tokens shared by consecutive windows of one document

    def __post_init__(self) -> None:
        _check(self.max_tokens > 0, "data.chunk.max_tokens", "must be > 0", self.max_tokens)
        _check(self.overlap >= 0, "data.chunk.overlap", "must be >= 0", self.overlap)
        _check(
            self.overlap < self.max_tokens,
            "data.chunk.overlap",
            f"must be < data.chunk.max_tokens ({self.max_tokens})",
            self.overlap,
        )


@dataclass
class DataConfig:
    source: DataSource = DataSource.synthetic
    # beir: a BEIR folder (corpus.jsonl[.gz], queries.jsonl, qrels/<split>.tsv); documents: a folder of documents
    # (+ queries.jsonl, qrels/<split>.tsv); squad: a SQuAD v1.1 JSON file, or a folder holding exactly one *.json;
    # synthetic: must stay unset (the KB is generated)
    root: str | None = None
    split: str = "dev"  # evaluated split; dev is carved from train (seeded) when qrels/dev.tsv is absent
    # dev queries carved from train when qrels/<split>.tsv is absent: a count (>= 1) or a fraction in (0, 1)
    dev_size: float = 100
    seed: int = 0
    num_entities: int = 200  # synthetic KB size (and the generated documents' entity count)
    glob: str = "**/*"  # documents: which files under data.root are read (recursive by default)
    # documents: an unreadable, binary or non-UTF-8 file fails the run or is skipped; squad: an answer whose
    # answer_start does not match its context, or a SQuAD v2.0 file's unanswerable questions, fail or are skipped
    on_error: OnError = OnError.fail
    # squad: splits by article, never by question. dev_titles / test_titles name articles; else dev_articles /
    # test_articles articles (a count >= 1 or a fraction in (0, 1) of the articles with questions; 0 = none) are
    # drawn with data.seed from those not named. train = the other articles with questions.
    dev_titles: list[str] = field(default_factory=list)
    test_titles: list[str] = field(default_factory=list)
    dev_articles: float = 0
    test_articles: float = 0
    # documents: write ragtrain's generated article folder (ragtrain/corpus/docs_synthetic.py) into
    # <output_dir>/docs and read it; data.root must then stay unset
    generate: bool = False
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    # beir/documents: read + clean (documents) and chunk on Ray Data tasks and actors (ray), in the driver before
    # Ray starts (driver), or on Ray Data once the corpus files hold >= 64 MiB (auto). The store is the same. On Ray,
    # a documents folder is also encoded in the same stream when the first index is zero-shot (corpus/stream.py).
    prepare: Prepare = Prepare.auto

    def __post_init__(self) -> None:
        if self.root:  # read by Ray Data tasks and sweep trials, which run in other folders
            self.root = driver_path(self.root)
        choices = [s.value for s in DataSource]
        _check(
            self.source != DataSource.synthetic or self.root is None,
            "data.root",
            "is set but data=synthetic generates its data and would ignore it; choose data=beir (a BEIR folder), "
            f"data=documents (a folder of documents) or data=squad (a SQuAD file); data.source choices: {choices}",
            self.root,
        )
        _check(
            self.source != DataSource.beir or bool(self.root),
            "data.root",
            "must be set for data.source=beir",
            self.root,
        )
        if self.source == DataSource.documents:
            _check(
                bool(self.root) or self.generate,
                "data.root",
                "must be set for data.source=documents (or data.generate=true)",
                self.root,
            )
            _check(
                not (self.root and self.generate),
                "data.root",
                "must stay unset with data.generate=true (the folder is written to <output_dir>/docs)",
                self.root,
            )
        _check(
            not self.generate or self.source == DataSource.documents,
            "data.generate",
            "needs data.source=documents",
            self.generate,
        )
        _check(bool(self.glob.strip()), "data.glob", "must be a glob pattern relative to data.root", self.glob)
        _check(
            not self.chunk.enabled or self.source != DataSource.synthetic,
            "data.chunk.enabled",
            "needs data=documents, data=beir or data=squad (synthetic passages are single facts)",
            self.chunk.enabled,
        )
        _check(
            0 < self.dev_size < 1 or (self.dev_size >= 1 and float(self.dev_size).is_integer()),
            "data.dev_size",
            "must be a count of queries (an integer >= 1) or a fraction in (0, 1)",
            self.dev_size,
        )
        if self.dev_size >= 1:
            self.dev_size = int(self.dev_size)  # a count: the loaders treat a float as a fraction
        _check(self.num_entities >= 10, "data.num_entities", "must be >= 10", self.num_entities)
        if self.source == DataSource.synthetic:  # keys only a folder reads: set with synthetic, they would do nothing
            folders = "data=beir and data=documents"
            for key, value, default, where in (
                ("dev_size", self.dev_size, 100, folders),
                ("prepare", self.prepare, Prepare.auto, folders),
                ("glob", self.glob, "**/*", "data=documents"),
                ("on_error", self.on_error, OnError.fail, "data=documents and data=squad"),
            ):
                _check(
                    value == default,
                    f"data.{key}",
                    f"applies to {where} only (data=synthetic holds out a fixed "
                    "15 % of its entities as dev and test, and reads no files)",
                    value,
                )
        self._check_squad()

    def _check_squad(self) -> None:
        """data=squad's keys: set with another source they would do nothing; with squad, the keys it does not read."""
        squad_keys = (
            ("dev_titles", self.dev_titles, []),
            ("test_titles", self.test_titles, []),
            ("dev_articles", self.dev_articles, 0),
            ("test_articles", self.test_articles, 0),
        )
        if self.source != DataSource.squad:
            for key, value, default in squad_keys:
                _check(value == default, f"data.{key}", "applies to data=squad only (it splits by article)", value)
            return
        _check(bool(self.root), "data.root", "must be set for data.source=squad (a SQuAD v1.1 .json file)", self.root)
        for key, value, default, why in (
            ("dev_size", self.dev_size, 100, "data=squad splits by article: use data.dev_articles or data.dev_titles"),
            ("glob", self.glob, "**/*", "data=squad reads one JSON file (data.root)"),
            ("prepare", self.prepare, Prepare.auto, "data=squad reads and chunks its one file in the driver"),
        ):
            _check(value == default, f"data.{key}", f"does not apply here ({why})", value)
        _check(
            self.split in ("train", "dev", "test"),
            "data.split",
            "must be one of ['train', 'dev', 'test'] with data=squad (its splits are sets of articles)",
            self.split,
        )
        for name in ("dev", "test"):
            titles, count = getattr(self, f"{name}_titles"), getattr(self, f"{name}_articles")
            key = f"data.{name}_articles"
            _check(
                count == 0 or 0 < count < 1 or (count >= 1 and float(count).is_integer()),
                key,
                "must be 0 (none), a count of articles (an integer >= 1) or a fraction in (0, 1)",
                count,
            )
            if count >= 1:
                setattr(self, f"{name}_articles", int(count))  # a count: the reader treats a float as a fraction
            _check(
                not (titles and count),
                key,
                f"must be 0 when data.{name}_titles names the {name} articles (set one of the two)",
                count,
            )
            repeated = sorted({t for t in titles if titles.count(t) > 1})
            _check(not repeated, f"data.{name}_titles", f"names {repeated} more than once", titles)
        both = sorted(set(self.dev_titles) & set(self.test_titles))
        _check(not both, "data.test_titles", f"shares {both} with data.dev_titles: no article in two splits", both)
