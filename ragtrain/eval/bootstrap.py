"""Paired comparisons of runs question by question: the mean difference of a per-question figure between two runs
with a paired bootstrap interval, and whether it is significant (the interval excludes 0).

Pairing: each question of a variant against the same question in the base run at the same training seed
(`compare.seeds`), so what the questions have in common (hard or easy ones) cancels; the (seed, question) pairs of
every seed are resampled together. The interval is the percentile interval of the resampled mean difference
(numpy's seeded generator: the same figures on every rerun).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from tabulate import tabulate

from ragtrain.eval.per_question import metric_values

RESAMPLES = 10_000  # the default: a percentile interval reads its ends from the 250 resamples in each tail
MIN_RESAMPLES = 1000  # fewer leave the interval's 2.5 % tails a couple of dozen resamples
CHUNK = 2_000_000  # resampled entries held at once (float64): ~16 MB whatever the question count


@dataclass
class PairedDifference:
    """`other` - `base` over `n` pairs: the means, the difference with its interval, and the pairs on which
    `other` is better / worse (by the metric's direction)."""

    n: int
    base_mean: float
    mean: float
    diff: float
    low: float
    high: float
    significant: bool  # the interval excludes 0
    better: int
    worse: int


def paired_bootstrap(
    base: Sequence[float] | np.ndarray,
    other: Sequence[float] | np.ndarray,
    resamples: int = RESAMPLES,
    seed: int = 0,
    higher_is_better: bool = True,
    level: float = 0.95,
) -> PairedDifference:
    """The paired bootstrap of mean(other - base): `resamples` draws of the pairs with replacement."""
    b, o = np.asarray(base, dtype=np.float64), np.asarray(other, dtype=np.float64)
    if b.ndim != 1 or b.shape != o.shape or not len(b):
        raise ValueError(f"paired values need two 1-D arrays of one non-zero length, got {b.shape} and {o.shape}")
    if resamples < MIN_RESAMPLES:
        raise ValueError(f"resamples must be >= {MIN_RESAMPLES}, got {resamples}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    d = o - b
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    rows = max(1, CHUNK // len(d))
    for start in range(0, resamples, rows):
        m = min(rows, resamples - start)
        means[start : start + m] = d[rng.integers(0, len(d), size=(m, len(d)))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = (float(x) for x in np.percentile(means, [tail, 100 - tail]))
    up, down = int((d > 0).sum()), int((d < 0).sum())
    return PairedDifference(
        n=len(d),
        base_mean=float(b.mean()),
        mean=float(o.mean()),
        diff=float(d.mean()),
        low=low,
        high=high,
        significant=low > 0 or high < 0,
        better=up if higher_is_better else down,
        worse=down if higher_is_better else up,
    )


def paired_arrays(
    base: Mapping[int, Mapping[str, float]], other: Mapping[int, Mapping[str, float]], name: str = "the run"
) -> tuple[np.ndarray, np.ndarray]:
    """Two runs' values ({seed: {question id: value}}) as aligned arrays over the (seed, question) pairs. Both must
    hold the same seeds and, at each seed, the same questions (ValueError naming the difference)."""
    if sorted(base) != sorted(other):
        raise ValueError(f"{name} ran at seeds {sorted(other)}, the base at {sorted(base)}: pairs need the same seeds")
    xs, ys = [], []
    for s in sorted(base):
        if set(base[s]) != set(other[s]):
            differ = sorted(set(base[s]) ^ set(other[s]))
            raise ValueError(
                f"{name} evaluates other questions than the base at seed {s} ({len(differ)} differ, e.g. "
                f"{differ[:3]}): compare runs of the same data, split and evaluated questions"
            )
        qids = sorted(base[s])
        xs += [base[s][q] for q in qids]
        ys += [other[s][q] for q in qids]
    return np.array(xs), np.array(ys)


def paired_row(variant: str, metric: str, diff: PairedDifference) -> dict[str, Any]:
    """One row of a paired table (CSV / Markdown): the variant, the metric, then the difference's figures."""
    return {"variant": variant, "metric": metric, **asdict(diff)}


def paired_table(
    runs: Mapping[str, Mapping[int, Mapping[str, Mapping[str, Any]]]],
    base: str,
    metrics: Sequence[str],
    lower_is_better: Sequence[str] = (),
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Every other variant against `base`, per metric: `runs` is {variant: {seed: {question id: {metric: value}}}}
    (ragtrain/eval/per_question.py's rows). A metric that a variant or the base has on no question (a run saved
    before it existed) gets no row; other questions or seeds than the base's raise ValueError."""
    rows = []
    for name, by_seed in runs.items():
        if name == base:
            continue
        for metric in metrics:
            x = {s: metric_values(r, metric) for s, r in runs[base].items()}
            y = {s: metric_values(r, metric) for s, r in by_seed.items()}
            if not any(x.values()) or not any(y.values()):
                continue
            b, o = paired_arrays(x, y, name)
            diff = paired_bootstrap(b, o, resamples, seed, higher_is_better=metric not in lower_is_better)
            rows.append(paired_row(name, metric, diff))
    return rows


def paired_markdown(rows: Sequence[Mapping[str, Any]], base: str) -> str:
    """The paired rows as a Markdown table (differences against `base`)."""
    body = [
        [r["variant"], r["metric"], r["n"], f"{r['base_mean']:.4f}", f"{r['mean']:.4f}", f"{r['diff']:+.4f}",
         f"[{r['low']:+.4f}, {r['high']:+.4f}]", "yes" if r["significant"] else "no", f"{r['better']} / {r['worse']}"]
        for r in rows
    ]  # fmt: skip
    head = ["variant", "metric", "pairs", base, "variant's", "Δ", "95 % interval", "significant", "better / worse"]
    return tabulate(body, headers=head, tablefmt="pipe", disable_numparse=True)
