"""`python -m ragtrain paired RUN_DIR RUN_DIR [...]`: are finished runs' scores different beyond the dev set's
noise?

A 100-query dev set moves nDCG@10 by 0.01 per query, so two recipes 0.01 apart may be one query apart. This
re-scores every run folder per query, on the same evaluated split, from its saved index and its query encoder (the
one that built the index, or a joint run's jointly trained one, as `python -m ragtrain search` does), and prints
each run's mean with a bootstrap 95 % interval and its paired difference to the first run: the same resampled
queries for both runs, so what the queries have in common cancels.
`p(≤0)` is the share of resamples where the run does not beat the first one (small: a real gain); `better / worse`
counts the queries on which the run scores above / below the first. Runs must evaluate the same queries (same data,
split and dev carve); anything else is refused in one line (exit 2).

`--metric rag/em` (or rag/f1, closed_book/em, oracle/f1, ...) compares the generator's answers instead: each
question's exact match or token F1 (SQuAD v1.1's normalisation, best over its gold answers) read from the run's
saved predictions (the joint stage's when it ran, else the generator stage's), the same figures as the run's own.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf
from tabulate import tabulate

from ragtrain.commands.search import SearchError, load_run_config, query_snapshots, require_index
from ragtrain.config import changed_keys, flatten
from ragtrain.corpus.load import load_data
from ragtrain.eval.metrics import per_query
from ragtrain.runtime.console import quiet_cli

RETRIEVAL_METRICS = ("ndcg@10", "mrr@10", "recall@1", "recall@5", "recall@10", "recall@100")
# the generator's answers per mode: each question's EM / F1 from the run's predictions.json
ANSWER_METRICS = tuple(f"{mode}/{kind}" for mode in ("rag", "closed_book", "oracle") for kind in ("em", "f1"))
METRICS = RETRIEVAL_METRICS + ANSWER_METRICS
# the joint stage's answers first: when a run has both stages, its reported EM / F1 are the joint stage's
PREDICTIONS = ("joint/predictions.json", "generator/predictions.json")


@dataclass
class Scored:
    """One run's per-query values of one metric, by query id."""

    name: str
    values: dict[str, float]


def run_per_query(out: str | Path, metric: str = "ndcg@10") -> dict[str, float]:
    """Per-query `metric` of the run in `out` on its evaluated split (its saved index, its trained encoder)."""
    # lazy: ragtrain.pipeline.retrieval imports torch; this module imports without it
    # lazy: ragtrain.index.faiss_index imports faiss; this module imports without it
    from ragtrain.index.faiss_index import IndexMismatchError

    # lazy: ragtrain.index.sharded imports faiss/ray; this module imports without them
    from ragtrain.index.sharded import open_saved
    from ragtrain.pipeline.retrieval import BuiltIndex, Retrieval

    out = require_index(Path(out), "compare run folders")
    cfg = load_run_config(out)
    with tempfile.TemporaryDirectory(prefix="ragtrain-paired-") as tmp:  # the corpus as a store, not in memory
        data = load_data(cfg.data, cfg.retriever, Path(tmp))
        try:
            index = open_saved(out / "index", expect_corpus=data.fingerprint())  # its shards, in this process
        except (FileNotFoundError, IndexMismatchError) as e:
            raise SearchError(str(e)) from None
        index.set_search_params(cfg.index.nprobe, cfg.index.ef_search)
        retrieval = Retrieval(cfg, data)  # the pipeline's own ranking (MaxP on chunks), searched in-process
        built = BuiltIndex("saved", index, query_snapshots(cfg, index.meta.encoder, out), retrieval.doc_ids, {})
        scores = per_query(retrieval.ranked(built), data.eval_qrels)
    if metric not in next(iter(scores.values())):
        raise SearchError(f"--metric {metric!r} is not a metric; valid choices: {list(next(iter(scores.values())))}")
    return {q: s[metric] for q, s in scores.items()}


def predictions_file(out: str | Path) -> Path | None:
    """The answers file of the run in `out` (the joint stage's when it ran, else the generator stage's), or None."""
    return next((Path(out, p) for p in PREDICTIONS if Path(out, p).is_file()), None)


def saved_answers(out: str | Path, mode: str = "rag") -> list[dict]:
    """The answers the run in `out` saved for one eval mode: {qid, question, prediction, answers, passages} each."""
    path = predictions_file(out)
    if path is None:
        raise SearchError(
            f"{out} holds no generator answers ({' or '.join(PREDICTIONS)}): compare run folders whose stages "
            "included 'generator' or 'joint'"
        )
    answers = json.loads(path.read_text())
    if mode not in answers:
        raise SearchError(f"{path} has no {mode!r} answers: its evaluated modes are {sorted(answers)}")
    return answers[mode]


def answer_scores(out: str | Path, metric: str = "rag/em") -> dict[str, float]:
    """Per-question EM or F1 (`metric` = <mode>/<em|f1>) of the answers the run in `out` saved, by question id."""
    from ragtrain.eval.qa_metrics import best_over_golds, exact_match, f1_score  # lazy: only this metric

    mode, kind = metric.split("/")
    fn = exact_match if kind == "em" else f1_score
    return {r["qid"]: best_over_golds(fn, r["prediction"], r["answers"]) for r in saved_answers(out, mode)}


def per_question(out: str | Path, metric: str) -> dict[str, float]:
    """The run's per-query `metric`: re-scored retrieval, or its saved answers' EM / F1."""
    return answer_scores(out, metric) if metric in ANSWER_METRICS else run_per_query(out, metric)


NOT_A_RECIPE = ("output_dir", "logger", "resume", "resume_allow_changes", "experiment_name", "tune", "index.cache_dir")


def labels(runs: Sequence[str | Path]) -> list[str]:
    """A name per run: the first run's folder name, then what each other run's config changes (`key=value`)."""
    for r in runs:
        if not (Path(r) / "config.yaml").is_file():
            raise SearchError(f"{Path(r) / 'config.yaml'} is missing: {r} is not a ragtrain run folder")
    flat = [flatten(OmegaConf.to_container(OmegaConf.load(Path(r) / "config.yaml"))) for r in runs]
    out = [Path(runs[0]).name]
    for r, f in zip(runs[1:], flat[1:]):
        keys = changed_keys(flat[0], f, NOT_A_RECIPE)
        # the key's last two parts: short, and still saying which `enabled` or `rank` it is (chunk.enabled, lora.rank)
        out.append(
            " ".join(f"{'.'.join(k.split('.')[-2:])}={f.get(k, '<unset>')}" for k in keys) or f"{Path(r).name} (same)"
        )
    return out


def bootstrap(runs: Sequence[Scored], resamples: int = 10_000, seed: int = 0) -> list[dict[str, Any]]:
    """Mean, 95 % interval, and the paired difference to runs[0] (interval and p(diff ≤ 0)) for each run."""
    qids = sorted(runs[0].values)
    for r in runs[1:]:
        if sorted(r.values) != qids:
            missing = sorted(set(qids) ^ set(r.values))
            raise ValueError(
                f"{r.name} evaluates other queries than {runs[0].name} ({len(missing)} differ, e.g. "
                f"{missing[:3]}): compare runs of the same data, split and dev carve"
            )
    x = np.array([[r.values[q] for q in qids] for r in runs])  # runs x queries
    picks = np.random.default_rng(seed).integers(0, len(qids), size=(resamples, len(qids)))
    means = x[:, picks].mean(axis=2)  # runs x resamples
    diffs = means - means[0]
    out: list[dict[str, Any]] = []  # one row per run: its name, then its figures
    for i, r in enumerate(runs):
        row = {
            "run": r.name,
            "queries": float(len(qids)),
            "mean": float(x[i].mean()),
            "ci_low": float(np.percentile(means[i], 2.5)),
            "ci_high": float(np.percentile(means[i], 97.5)),
        }
        if i:
            row.update(
                diff=float(x[i].mean() - x[0].mean()),
                diff_low=float(np.percentile(diffs[i], 2.5)),
                diff_high=float(np.percentile(diffs[i], 97.5)),
                p_not_better=float((diffs[i] <= 0).mean()),
                better=float((x[i] > x[0]).sum()),
                worse=float((x[i] < x[0]).sum()),
            )
        out.append(row)
    return out


def seed_runs(folder: str | Path) -> dict[int, Path]:
    """The run folders of one variant run at several seeds: <folder>/seed<k>/ (compare.seeds), by seed."""
    found = {int(p.name[4:]): p for p in Path(folder).glob("seed*") if p.name[4:].isdigit() and p.is_dir()}
    if not found:
        raise SearchError(f"{folder} holds no seed<k>/ run folders: --over-seeds takes a variant's folder of a run "
                          "with compare.seeds")  # fmt: skip
    return dict(sorted(found.items()))


def paired_over_seeds(
    runs: dict[str, dict[int, Path]], metric: str = "rag/em", resamples: int = 10_000, seed: int = 0
) -> list[dict[str, Any]]:
    """`bootstrap` of variants run at several seeds (`runs`: name -> {seed: run folder}): each variant's per-question
    `metric` pooled over its seeds, every (seed, question) paired with the first variant's at the same seed."""
    scored = [
        Scored(name, {f"{s}/{q}": v for s, out in by_seed.items() for q, v in per_question(out, metric).items()})
        for name, by_seed in runs.items()
    ]
    return bootstrap(scored, resamples, seed)


def format_table(rows: Sequence[dict[str, Any]], metric: str, tablefmt: str = "simple") -> str:
    """The comparison as a text table (differences against the first run)."""
    body = [
        [
            r["run"],
            f"{r['mean']:.4f}",
            f"[{r['ci_low']:.4f}, {r['ci_high']:.4f}]",
            f"{r['diff']:+.4f}" if "diff" in r else "–",
            f"[{r['diff_low']:+.4f}, {r['diff_high']:+.4f}]" if "diff" in r else "–",
            f"{r['p_not_better']:.3f}" if "diff" in r else "–",
            f"{r['better']:.0f} / {r['worse']:.0f}" if "diff" in r else "–",
        ]
        for r in rows
    ]
    head = ["run", metric, "95% interval", "Δ vs first", "Δ 95% interval", "p(Δ ≤ 0)", "better / worse"]
    units = "questions" if metric in ANSWER_METRICS else "queries"
    return (
        tabulate(body, headers=head, tablefmt=tablefmt) + f"\n\n({int(rows[0]['queries'])} {units}, paired bootstrap)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    quiet_cli()
    p = argparse.ArgumentParser(prog="python -m ragtrain paired", description=__doc__.splitlines()[0])
    p.add_argument(
        "runs",
        nargs="+",
        help="finished run folders (output_dir); differences are against the first, "
        "and each other run is named by the config keys it changes",
    )
    p.add_argument("--metric", default="ndcg@10", help=f"one of {list(METRICS)}")
    p.add_argument("--resamples", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument(
        "--over-seeds",
        action="store_true",
        help="each folder is a variant of a compare.seeds experiment (<out>/<variant>) holding seed<k>/ runs: its "
        "queries at every seed, each paired with the first variant's at the same seed",
    )
    args = p.parse_args(argv)
    if len(args.runs) < 2:
        print("error: give at least two run folders to compare", file=sys.stderr)
        return 2
    if args.metric not in METRICS:
        print(f"error: --metric {args.metric!r} is not a metric; valid choices: {list(METRICS)}", file=sys.stderr)
        return 2
    if args.resamples < 100:
        print(f"error: --resamples must be >= 100, got {args.resamples}", file=sys.stderr)
        return 2
    try:
        if args.over_seeds:
            runs = {Path(r).name: seed_runs(r) for r in args.runs}
            rows = paired_over_seeds(runs, args.metric, args.resamples, args.seed)
        else:
            names = labels(args.runs)  # every folder's config.yaml read before any scoring
            scored = [Scored(n, per_question(r, args.metric)) for n, r in zip(names, args.runs)]
            rows = bootstrap(scored, args.resamples, args.seed)
    except (SearchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=2) if args.json else format_table(rows, args.metric))
    return 0
