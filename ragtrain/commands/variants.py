"""Run a set of variants of one config on the same data, one after another, then compare them side by side.

The variants are conf/sync options (compare.strategies, experiment=sync_compare) and named override sets
(compare.variants, experiment=scifact_refresh); ragtrain/__main__.py builds them, this module runs them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd

from ragtrain.commands.paired import saved_answers
from ragtrain.commands.search import SearchError
from ragtrain.config import Config
from ragtrain.config.variants import SEED_MARK
from ragtrain.eval.bootstrap import RESAMPLES, paired_markdown, paired_table
from ragtrain.eval.likelihood import LIKELIHOOD_METRICS
from ragtrain.eval.per_question import NLL_METRICS, run_per_question
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
    pairs, paired = paired_answers(variants)
    files = write_comparison(
        df, out_dir, f"{first.experiment_name}: {first.data.source} split={first.data.split}", [paired]
    )
    files += write_paired(pairs, out_dir)
    if not finished:
        _log_comparison(first, files)
    log.info("\n" + df.to_markdown(index=False, floatfmt=".4g") + (f"\n\n{paired}" if paired else ""))
    log.info(f"comparison: {', '.join(str(f) for f in files)}")
    return df


PAIRED_METRICS = ("rag/em", "rag/f1", *NLL_METRICS)  # what the comparison pairs per question
PAIRED_FILE = "paired.csv"
BASE = "frozen"  # each variant is paired with it (else with the first variant that answered)


def paired_answers(variants: dict[str, Config]) -> tuple[list[dict], str]:
    """Each variant against `frozen` per question at the same seed, pooled over seeds (PAIRED_METRICS, read from
    each run's per_question.jsonl): the rows (variant, metric, pairs, means, difference, 95 % interval,
    significant, better / worse) and their Markdown section; ([], "") when fewer than two variants answered."""
    runs: dict[str, dict[int, Path]] = {}
    loaded: dict[str, dict[int, dict]] = {}
    for label, cfg in variants.items():
        rows = run_per_question(cfg.output_dir)
        if rows:  # a retrieval-only variant has none
            name = label.partition(SEED_MARK)[0]
            runs.setdefault(name, {})[cfg.seed] = Path(cfg.output_dir)
            loaded.setdefault(name, {})[cfg.seed] = rows
    if len(runs) < 2:
        return [], ""
    base = BASE if BASE in runs else next(iter(runs))
    try:
        table = paired_table(loaded, base, PAIRED_METRICS, lower_is_better=NLL_METRICS)
        passages = other_passages({base: runs[base], **{n: r for n, r in runs.items() if n != base}})
    except (SearchError, ValueError) as e:  # e.g. a variant that evaluates other questions: the table stays valid
        log.warning(f"comparison: no paired section: {e}")
        return [], ""
    seeds = len(runs[base])
    return table, (
        f"## Paired against {base}, per question and seed\n\n"
        f"Each variant's figure on a question against {base}'s on the same question at the same seed ({seeds} "
        f"seed(s), pooled): the mean difference Δ = variant - {base} with its paired bootstrap 95 % interval "
        f"({RESAMPLES:,} resamples of the pairs, seeded), significant when the interval excludes 0; better / worse "
        f"count the pairs. EM and F1 on the questions of generator.eval.max_questions; the answer likelihood "
        f"({', '.join(LIKELIHOOD_METRICS)}: nats per answer, lower is better) on its own, larger set "
        f"(generator.eval.likelihood_questions).\n\n" + paired_markdown(table, base) + "\n\n" + passages
    )


def write_paired(pairs: list[dict], out_dir: str | Path) -> list[Path]:
    """The paired differences as a table of their own, <out_dir>/paired.csv (one row per variant and metric:
    variant, metric, n, base_mean, mean, diff, low, high, significant, better, worse); [] without pairs."""
    if not pairs:
        return []
    path = Path(out_dir, PAIRED_FILE)
    pd.DataFrame(pairs).to_csv(path, index=False)
    return [path]


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
    likelihood = results.get("joint_likelihood") or results.get("gen_likelihood") or {}
    row.update({f"likelihood/{k}": v for k, v in likelihood.items() if k in LIKELIHOOD_METRICS})
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
