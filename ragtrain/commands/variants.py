"""Run a set of variants of one config on the same data, one after another, then compare them side by side.

The variants are conf/sync options (compare.strategies, experiment=sync_compare) and named override sets
(compare.variants, experiment=scifact_refresh); ragtrain/__main__.py builds them, this module runs them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd

from ragtrain.commands.paired import format_table, paired_over_seeds, predictions_file, saved_answers
from ragtrain.commands.search import SearchError
from ragtrain.config import Config
from ragtrain.config.variants import SEED_MARK
from ragtrain.pipeline.stages import completed, run
from ragtrain.runtime.console import get_logger
from ragtrain.track.mlflow import RunLogger
from ragtrain.track.report import comparison_frame, write_comparison

log = get_logger(__name__)


def run_variants(variants: dict[str, Config], out_dir: str | Path) -> pd.DataFrame:
    """Run the pipeline once per variant (one MLflow run each), then write the comparison table (one row per
    variant, its name in the `strategy` column)."""
    # resume=true after every variant finished: the same table again, and no second comparison run in MLflow
    finished = all(cfg.resume and completed(Path(cfg.output_dir)) for cfg in variants.values())
    rows = []
    for label, cfg in variants.items():
        log.info(f"\n######## variant: {label} ########")
        results = run(cfg)
        name, seeded, _ = label.partition(SEED_MARK)  # compare.seeds: one row per variant and seed
        rows.append(variant_row(name, results) | ({"seed": cfg.seed} if seeded else {}))
    df = comparison_frame(rows)
    first = next(iter(variants.values()))
    paired = paired_answers(variants)
    files = write_comparison(
        df, out_dir, f"{first.experiment_name}: {first.data.source} split={first.data.split}", [paired]
    )
    if not finished:
        _log_comparison(first, files)
    log.info("\n" + df.to_markdown(index=False, floatfmt=".4g") + (f"\n\n{paired}" if paired else ""))
    log.info(f"comparison: {', '.join(str(f) for f in files)}")
    return df


def paired_answers(variants: dict[str, Config], metric: str = "rag/em") -> str:
    """A Markdown section: each variant's `metric` per question, pooled over its seeds and paired with the first
    answering variant's at the same seed ("" when fewer than two variants saved answers)."""
    runs: dict[str, dict[int, Path]] = {}
    for label, cfg in variants.items():
        out = Path(cfg.output_dir)
        if predictions_file(out):  # a retrieval-only variant has none
            runs.setdefault(label.partition(SEED_MARK)[0], {})[cfg.seed] = out
    if len(runs) < 2:
        return ""
    try:
        rows = paired_over_seeds(runs, metric)
    except (SearchError, ValueError) as e:  # e.g. a variant that evaluates other questions: the table stays valid
        log.warning(f"comparison: no paired {metric} section: {e}")
        return ""
    base, seeds = next(iter(runs)), len(next(iter(runs.values())))
    return (
        f"## {metric} paired against {base}, per question over {seeds} seed(s)\n\n"
        f"Each (seed, question) of a variant against {base}'s answer at the same seed: the difference with its "
        f"bootstrap 95 % interval, and the questions answered better / worse (counted over seeds x "
        f"questions).\n\n"
        + format_table(rows, metric, tablefmt="pipe")
        + "\n\n"
        + other_passages(runs, metric.split("/")[0])
    )


def other_passages(runs: dict[str, dict[int, Path]], mode: str = "rag") -> str:
    """One line: per variant, how many (seed, question) prompts hold other passages than the first variant's at the
    same seed (only those answers can differ through the retriever)."""
    names, base = list(runs), next(iter(runs.values()))
    counts = []
    for name in names[1:]:
        changed = total = 0
        for s, out in runs[name].items():
            first = {r["qid"]: r["passages"] for r in saved_answers(base[s], mode)}
            for r in saved_answers(out, mode):
                changed += r["passages"] != first.get(r["qid"])
                total += 1
        counts.append(f"{name} {changed} of {total}")
    return f"Prompts ({mode}) holding other passages than {names[0]}'s: {', '.join(counts)}."


def variant_row(name: str, results: dict[str, dict[str, float]]) -> dict[str, float | str]:
    """One variant's row: its index's retrieval figures (the trained index, or the shipped encoder's), its training
    summary, and with a generator or joint stage the EM / F1 per mode and the stage's wall seconds."""
    row: dict[str, float | str] = {"strategy": name, **results.get("trained", results.get("zeroshot", {}))}
    row.update(results.get("train", {}))
    for mode in ("rag", "closed_book", "oracle"):  # the joint stage's scores when it ran, else the generator's
        scores = results.get(f"joint_{mode}") or results.get(f"gen_{mode}") or {}
        row.update({f"{mode}/{k}": v for k, v in scores.items() if k in ("em", "f1", "gold_in_top_k")})
    stage = results.get("joint") or results.get("gen_train")
    if stage:
        row["seconds"] = stage["wall_seconds"]
    return row


def _log_comparison(cfg: Config, files: list[Path]) -> None:
    """Attach the table and plot to a summary MLflow run next to the per-variant runs."""
    logger = RunLogger(replace(cfg.logger, run_name=f"{cfg.experiment_name}/comparison"), cfg.experiment_name)
    status = "FAILED"
    try:
        for f in files:
            logger.log_artifact(f)
        status = "FINISHED"
    finally:
        logger.end(status)
