"""The `data:` group (conf/data/*.yaml): where the corpus, queries and qrels come from, and how they are split
and chunked."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ragtrain.config.registry import Variant
from ragtrain.runtime.errors import ConfigError, driver_path
from ragtrain.runtime.errors import check as _check


class OnError(str, Enum):
    fail = "fail"
    skip = "skip"


class Prepare(str, Enum):
    auto = "auto"  # on Ray Data once the corpus files hold 64 MiB or more (ragtrain/corpus/prepare.py)
    driver = "driver"
    ray = "ray"


@dataclass(frozen=True)
class DataSourceVariant(Variant):
    """A data source (ragtrain/corpus/sources/): where the corpus, queries and qrels come from."""

    root: str | None = None  # what data.root names; None: the source generates its data (data.root stays unset)
    reads: tuple[str, ...] = ()  # the keys of OPTIONAL_KEYS it reads: set under another source, they are refused
    why: str = ""  # why the optional keys it does not read would do nothing (their error message says it)


# The data keys only some sources read, and their defaults: set under a source that does not read them, they
# would do nothing, so the config refuses them (naming the sources that read them).
OPTIONAL_KEYS: dict[str, object] = {
    "dev_size": 100,
    "glob": "**/*",
    "on_error": "fail",
    "prepare": "auto",
    "generate": False,
    "dev_titles": [],
    "test_titles": [],
    "dev_articles": 0,
    "test_articles": 0,
}
ARTICLE_KEYS = ("dev_titles", "test_titles", "dev_articles", "test_articles")  # a split by article (squad)

# The registry of `data.source` (one file in conf/data/ per source or dataset): name -> the loader class and the
# facts the checks read (docs/adding-a-variant.md)
DATA_SOURCES: dict[str, DataSourceVariant] = {
    "synthetic": DataSourceVariant(
        "ragtrain.corpus.sources.synthetic:Synthetic",
        why="data=synthetic holds out a fixed 15 % of its entities as dev and test, and reads no files",
    ),
    "beir": DataSourceVariant(
        "ragtrain.corpus.sources.beir:Beir",
        root="a BEIR folder",
        reads=("dev_size", "prepare"),
        why="data=beir reads a BEIR folder's corpus and qrels",
    ),
    # a folder of raw documents (ragtrain/corpus): txt, md, html, jsonl, parquet
    "documents": DataSourceVariant(
        "ragtrain.corpus.sources.documents:Documents",
        root="a folder of documents",
        reads=("dev_size", "glob", "on_error", "prepare", "generate"),
        why="data=documents reads a folder of documents",
    ),
    # a SQuAD v1.1 JSON file: every paragraph a passage, questions with all their answers
    "squad": DataSourceVariant(
        "ragtrain.corpus.sources.squad:Squad",
        root="a SQuAD v1.1 .json file",
        reads=("on_error", *ARTICLE_KEYS),
        why="data=squad reads and chunks its one JSON file in the driver and splits it by article: "
        "data.dev_articles or data.dev_titles set its dev split",
    ),
}


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
    source: str = "synthetic"  # a name in DATA_SOURCES: synthetic | beir | documents | squad
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
        _check(self.source in DATA_SOURCES, "data.source", f"must be one of {list(DATA_SOURCES)}", self.source)
        self._check_root()
        _check(bool(self.glob.strip()), "data.glob", "must be a glob pattern relative to data.root", self.glob)
        readers = [f"data={n}" for n, v in DATA_SOURCES.items() if v.root is not None]
        _check(
            not self.chunk.enabled or self.source_reads_files,
            "data.chunk.enabled",
            f"needs {', '.join(readers[:-1])} or {readers[-1]} ({self.source} passages are single facts)",
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
        self._check_optional_keys()
        if "dev_articles" in DATA_SOURCES[self.source].reads:
            self._check_articles()

    @property
    def source_reads_files(self) -> bool:
        """The source reads files (data.root, or the generated folder); else it generates its data in memory."""
        return DATA_SOURCES[self.source].root is not None

    def _check_root(self) -> None:
        """data.root: set for a source that reads files (or data.generate's own folder), unset for one that
        generates its data; each message says what it must name, from the registry."""
        v = DATA_SOURCES[self.source]
        if v.root is None:
            choices = ", ".join(f"data={n} ({w.root})" for n, w in DATA_SOURCES.items() if w.root is not None)
            _check(
                self.root is None,
                "data.root",
                f"is set but data={self.source} generates its data and would ignore it; choose {choices}; "
                f"data.source choices: {list(DATA_SOURCES)}",
                self.root,
            )
            return
        generates = "generate" in v.reads
        _check(
            bool(self.root) or (generates and self.generate),
            "data.root",
            f"must be set for data.source={self.source} ({v.root}" + (", or data.generate=true)" if generates else ")"),
            self.root,
        )
        _check(
            not (self.root and self.generate),
            "data.root",
            "must stay unset with data.generate=true (the folder is written to <output_dir>/docs)",
            self.root,
        )

    def _check_optional_keys(self) -> None:
        """A key only other sources read, set (not its default): it would do nothing here."""
        v = DATA_SOURCES[self.source]
        for key, default in OPTIONAL_KEYS.items():
            value = getattr(self, key)
            if key in v.reads or value == default:
                continue
            readers = " and ".join(f"data={n}" for n, w in DATA_SOURCES.items() if key in w.reads)
            raise ConfigError(f"data.{key} applies to {readers} only ({v.why}), got {value!r}")

    def _check_articles(self) -> None:
        """A split by article (squad): the evaluated split, and the dev / test articles named or counted."""
        _check(
            self.split in ("train", "dev", "test"),
            "data.split",
            f"must be one of ['train', 'dev', 'test'] with data={self.source} (its splits are sets of articles)",
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
