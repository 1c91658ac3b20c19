"""`python -m ragtrain search <output_dir> "a question" [-k 5] [--json]`: query a finished run.

Top-k passages (rank, score, id, text) from the run's saved index (`<output_dir>/index`; a sharded one is searched
shard by shard and merged), with the query encoded by the encoder that built it (named in `index_meta.json`,
rebuilt from the run's `config.yaml`), or for a run with a joint stage by the jointly trained encoder
(`<output_dir>/joint`). `python -m ragtrain ask` answers with the run's generator on top of this search. Bad input:
one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the Hub when querying a run
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from omegaconf import DictConfig, OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from ragtrain.config import Config, to_typed  # noqa: E402
from ragtrain.config.joint import PassageEncoder  # noqa: E402
from ragtrain.corpus.load import load_data  # noqa: E402
from ragtrain.data.store import PassageStore  # noqa: E402
from ragtrain.embed.encoders import QueryEncoder  # noqa: E402
from ragtrain.runtime.console import quiet_cli  # noqa: E402
from ragtrain.runtime.errors import ConfigError  # noqa: E402

VERIFIED_FILE = "index_verified.json"  # the index files whose checksums matched, with their size / mtime / inode


class SearchError(ValueError):
    """The folder or the request cannot be served; the message names the file or the option."""


def require_index(out: Path, use: str) -> Path:
    """`out`, a run folder holding a saved index; else a SearchError saying what to `use` instead."""
    meta = out / "index" / "index_meta.json"
    if not meta.exists():
        raise SearchError(f"{out} holds no index ({meta} is missing): {use} whose stages included 'index'")
    return out


def load_run_config(out: Path) -> Config:
    """The run's resolved, typed config (`<out>/config.yaml`, written by the pipeline before any work)."""
    path = out / "config.yaml"
    if not path.exists():
        raise SearchError(f"{path} is missing: {out} is not a ragtrain run folder")
    try:
        # merged into the structured root: a DictConfig (OmegaConf.merge is annotated with ListConfig too)
        return to_typed(cast(DictConfig, OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))))
    except (ConfigError, ValueError, OmegaConfBaseException) as e:  # e.g. written by an older ragtrain's schema
        raise SearchError(
            f"{path}: not a config this ragtrain can read ({str(e).splitlines()[0]}); the "
            "sentence-transformers export in export/retriever still loads on its own"
        ) from None


def encoder_weights(cfg: Config, encoder: str, out: Path) -> list:
    """The weights named by the index's metadata; a relative path that moved with the run folder is found in
    `<out>/encoder` (the pipeline records the path as given, relative to the cwd it ran in)."""
    # lazy: ragtrain.generator.retriever_client imports ray/torch; this module imports without them
    from ragtrain.generator.retriever_client import load_snapshots

    model, sep, where = encoder.partition("@")
    if sep and where != "init" and not Path(where).exists() and (out / "encoder" / Path(where).name).exists():
        encoder = f"{model}@{out / 'encoder' / Path(where).name}"
    if encoder.startswith("vector_avg of ") and " in " in encoder and not Path(encoder.rsplit(" in ", 1)[1]).exists():
        encoder = f"{encoder.rsplit(' in ', 1)[0]} in {out / 'encoder'}"
    try:
        return load_snapshots(cfg.retriever, cfg.seed, encoder)
    except (FileNotFoundError, ValueError) as e:
        raise SearchError(f"{out / 'index' / 'index_meta.json'}: {e}") from None


def query_snapshots(cfg: Config, encoder: str, out: Path) -> list:
    """The query encoder's weights: the index's own encoder (`encoder`, from its metadata), or for a run with a joint
    stage the jointly trained one, whose queries the index served during joint training (frozen passages: the
    index of the encoder it started from; trained passages: the index the joint stage re-encoded with it)."""
    # lazy: ragtrain.embed.weights and ragtrain.pipeline.export import torch; this module imports without it
    from ragtrain.embed.weights import load_weights
    from ragtrain.pipeline.export import served_encoder

    joint = served_encoder(cfg, out)
    if joint is None:
        return encoder_weights(cfg, encoder, out)
    if not joint.exists():
        raise SearchError(
            f"{joint} is missing: the run's joint stage (stages={list(cfg.stages)}) did not finish; search a run "
            "folder whose joint stage completed"
        )
    where = Path(encoder.partition("@")[2])
    if PassageEncoder(cfg.joint.passage_encoder) == PassageEncoder.trained and where.parts[-2:] != joint.parts[-2:]:
        raise SearchError(
            f"{out / 'index'}: built by {encoder!r}, not by the jointly trained encoder ({joint}) that "
            "joint.passage_encoder=trained re-encodes it with: the folder holds the index from before joint "
            "training (a run of an older ragtrain); run it again to save the final index"
        )
    return [load_weights(joint.parent, joint.stem)]


def passage_texts(cfg: Config, out: Path) -> Mapping[str, Any]:
    """Passages by id: the run's passage store (`<out>/corpus/passages.arrow`, read on demand), or for a run
    folder without one, reloaded the way the run loaded them ({} with a note on stderr when that fails)."""
    store = out / "corpus" / "passages.arrow"
    if store.is_file():
        try:
            passages = PassageStore(store)
            len(passages)  # the Arrow file is opened (memory-mapped) on first use
            return passages
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError: truncated, not Arrow
            raise SearchError(
                f"{store}: not a readable passage store, the file is corrupt or truncated "
                f"({str(e).splitlines()[0][:160]})"
            ) from None
    try:
        return load_data(cfg.data, cfg.retriever, out, store=False).corpus
    except Exception as e:  # the data moved or changed: scores and ids are still right, texts are not available
        print(f"note: passage texts unavailable ({type(e).__name__}: {str(e).splitlines()[0]})", file=sys.stderr)
        return {}


def warn_unfinished(out: Path) -> None:
    """One line on stderr when the run did not finish (status.json says running or failed): its index may be a
    zero-shot one, or the run may still be writing."""
    # lazy: ragtrain.pipeline.stages imports torch and the stages; this module's argument checks run without them
    from ragtrain.pipeline.stages import STATUS_FILE, read_status

    path, status = out / STATUS_FILE, read_status(out)
    if status in (None, "unknown"):
        return  # folders written before status.json existed, or a status file that cannot be read
    if status != "complete":
        why = "it failed" if status == "failed" else "it is still running or was stopped before it finished"
        print(
            f"warning: {path} says the run is {status!r}: {why}, so its index may not be the trained one",
            file=sys.stderr,
        )


def search(out: str | Path, question: str, k: int = 5) -> tuple[Config, list[dict[str, Any]]]:
    """Top-k hits for `question` from the run in `out`: [{rank, score, id, title, text}]."""
    # lazy: ragtrain.index.faiss_index imports faiss; this module imports without it
    from ragtrain.index.faiss_index import IndexMismatchError

    # lazy: ragtrain.index.sharded imports faiss/ray; this module imports without them
    from ragtrain.index.integrity import verified_stamps
    from ragtrain.index.sharded import open_saved

    out = require_index(Path(out), "search a run folder")
    cfg = load_run_config(out)
    warn_unfinished(out)
    try:
        # every shard checked, a bad one named; a file verified by an earlier call and unchanged since is not read
        with verified_stamps(out / VERIFIED_FILE):
            index = open_saved(out / "index")
    except (FileNotFoundError, IndexMismatchError) as e:
        raise SearchError(str(e)) from None
    if not 0 < k <= len(index.doc_ids):
        raise SearchError(f"-k must be between 1 and {len(index.doc_ids)} (the index's passages), got {k}")
    # vector_avg: the index holds the replicas' re-normalised mean vectors, and queries are averaged the same way
    snapshots = query_snapshots(cfg, index.meta.encoder, out)
    encoder = QueryEncoder(cfg.retriever, snapshots, precision=cfg.index.precision.value)
    if index.meta.dim != encoder.dim:  # e.g. a run folder whose config was edited after the index was built
        raise SearchError(
            f"{out / 'index'}: the index holds {index.meta.dim}-dim vectors but the run's encoder "
            f"({cfg.retriever.model}) produces {encoder.dim}-dim ones: search the folder the index was "
            "built in, with its config"
        )
    qv = encoder.encode([question], role="query")
    index.set_search_params(cfg.index.nprobe, cfg.index.ef_search)
    scores, rows = index.search(qv, k)
    passages = passage_texts(cfg, out)
    hits = []
    for rank, (score, row) in enumerate(zip(scores[0], rows[0]), start=1):
        if row < 0:  # FAISS pads with -1 when fewer than k vectors are reachable (IVF with a small nprobe)
            continue
        pid = index.doc_ids[row]
        p = passages.get(pid)
        hits.append(
            {
                "rank": rank,
                "score": float(score),
                "id": pid,
                "title": getattr(p, "title", "") if p else "",
                "text": getattr(p, "text", "") if p else "",
            }
        )
    return cfg, hits


def hit_line(h: dict[str, Any], width: int = 160) -> str:
    """One table line per hit: a chunk's line breaks become spaces, and a text cut at `width` ends in '...'."""
    text = " ".join((f"{h['title']}: {h['text']}" if h["title"] else h["text"]).split())
    return f"{h['rank']:>3}  {h['score']:.4f}  {h['id']}  {text if len(text) <= width else text[: width - 3] + '...'}"


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry; returns the exit code (2 on bad input)."""
    quiet_cli()  # no Hugging Face loading bars around the answer
    ap = argparse.ArgumentParser(prog="python -m ragtrain search", description=__doc__.splitlines()[0])
    ap.add_argument("output_dir", help="a finished run's folder (holds config.yaml and index/)")
    ap.add_argument("question")
    ap.add_argument("-k", type=int, default=5, help="passages to return (default 5)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    out = Path(args.output_dir)
    try:
        if args.k <= 0:
            raise SearchError(f"-k must be > 0, got {args.k}")
        if not args.question.strip():
            raise SearchError("the question is empty")
        _, hits = search(out, args.question, args.k)
    except SearchError as e:
        print(f"search error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"question": args.question, "k": args.k, "hits": hits}, indent=2, ensure_ascii=False))
        return 0
    for h in hits:
        print(hit_line(h))
    return 0
