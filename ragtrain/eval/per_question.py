"""A run's results per question, saved for pairing runs question by question: `<stage>/per_question.jsonl` in the
run folder (the generator stage's `generator/`, the joint stage's `joint/`), one JSON object per line:

    {"qid": ..., "rag/em": 1.0, "rag/f1": 1.0, "closed_book/em": ..., "oracle/f1": ...,
     "likelihood/rag_nll": 2.31, "likelihood/rag_nll_top1": 2.40, "likelihood/oracle_nll": 1.02}

EM / F1 with SQuAD v1.1's normalisation (best over the gold answers, as the run's own figures) on EM's questions
(generator.eval.max_questions); the answer likelihood's figures (ragtrain/eval/likelihood.py) on its larger set, so a
question outside EM's sample has those keys only. The file is written from the stage's predictions.json; a run
saved before it existed is read from its predictions.json (EM / F1 only).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ragtrain.eval.likelihood import LIKELIHOOD_METRICS
from ragtrain.eval.qa_metrics import best_over_golds, exact_match, f1_score

PER_QUESTION_FILE = "per_question.jsonl"
ANSWER_MODES = ("rag", "closed_book", "oracle")
# the joint stage's first: when a run has both stages, its reported figures are the joint stage's
STAGE_FOLDERS = ("joint", "generator")
NLL_METRICS = tuple(f"likelihood/{m}" for m in LIKELIHOOD_METRICS)  # lower is better


def per_question_rows(predictions: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """One row per question from a stage's predictions ({mode: [{qid, prediction, answers, ...}], "likelihood":
    [{qid, rag_nll, ...}]}), sorted by question id."""
    rows: dict[str, dict[str, Any]] = {}
    for mode in ANSWER_MODES:
        for r in predictions.get(mode, ()):
            row = rows.setdefault(r["qid"], {"qid": r["qid"]})
            row[f"{mode}/em"] = best_over_golds(exact_match, r["prediction"], r["answers"])
            row[f"{mode}/f1"] = best_over_golds(f1_score, r["prediction"], r["answers"])
    for r in predictions.get("likelihood", ()):
        row = rows.setdefault(r["qid"], {"qid": r["qid"]})
        row.update({f"likelihood/{m}": float(r[m]) for m in LIKELIHOOD_METRICS if r.get(m) is not None})
    return [rows[q] for q in sorted(rows)]


def write_per_question(folder: str | Path, predictions: Mapping[str, Sequence[Mapping[str, Any]]]) -> Path:
    """Write <folder>/per_question.jsonl from the stage's predictions; returns its path."""
    path = Path(folder) / PER_QUESTION_FILE
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in per_question_rows(predictions)))
    return path


def run_per_question(out: str | Path) -> dict[str, dict[str, Any]]:
    """The per-question results of the run in `out` by question id: its per_question.jsonl (the joint stage's when it
    ran), else what its predictions.json gives; {} for a run without a generator (retrieval only)."""
    for stage in STAGE_FOLDERS:
        path = Path(out, stage, PER_QUESTION_FILE)
        if path.is_file():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            return {r["qid"]: r for r in rows}
    for stage in STAGE_FOLDERS:
        path = Path(out, stage, "predictions.json")
        if path.is_file():
            return {r["qid"]: r for r in per_question_rows(json.loads(path.read_text()))}
    return {}


def metric_values(rows: Mapping[str, Mapping[str, Any]], metric: str) -> dict[str, float]:
    """`metric` (e.g. "rag/em", "likelihood/rag_nll") of every question that has it."""
    return {q: float(r[metric]) for q, r in rows.items() if r.get(metric) is not None}
