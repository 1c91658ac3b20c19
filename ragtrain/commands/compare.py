"""`python -m ragtrain compare`: compare MLflow runs of an experiment, or the trials of a sweep (its parent run).

Prints a table and writes comparison.csv / comparison.md, comparison.png (a metric vs a cost, coloured by sync
option, drift as marker size) and learning_curves.png (a training metric vs step). Works on the runs of plain
experiments (`python -m ragtrain experiment=...`, `experiment=sync_compare`) and of sweeps alike: everything is
read back from MLflow, nothing from the run folders.

    python -m ragtrain compare --experiment ragtrain
    python -m ragtrain compare --parent-run-id <sweep parent run id> --out outputs/report
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from ragtrain.config.logger import LoggerConfig
from ragtrain.runtime.errors import ConfigError
from ragtrain.track.mlflow import RunRecord, check_tracking_uri, find_runs, metric_history, sqlite_file, tracking_uri
from ragtrain.track.report import curves_plot, scatter_plot

DEFAULT_METRIC = "trained/ndcg_at_10"
DEFAULT_COST = "run/comm/bytes_per_step"
DEFAULT_SIZE = "run/drift/replica_cosine_mean"
DEFAULT_CURVE = "train/loss"
# Params that differ between any two runs without saying anything about them.
# (Not experiment_name: one MLflow experiment may hold runs of several ragtrain experiments, and that must show.)
NOISE = ("output_dir", "logger.run_name", "logger.tracking_uri", "resume")
MAX_TABLE_PARAMS = 6


def sync_label(params: dict[str, str], tags: dict[str, str]) -> str:
    """The conf/sync option a run used: the sweep's tag, else inferred from its sync.* params."""
    if tags.get("ragtrain.sync"):
        return tags["ragtrain.sync"]
    if params.get("sync.label"):  # ragtrain.config.to_flat_dict logs it (SyncConfig.label)
        return params["sync.label"]
    s = params.get("sync.strategy", "")  # runs logged before the composed sync config
    if s == "compressed":
        return params.get("sync.compression", s)
    if s == "local_sgd" and params.get("sync.adaptive") == "True":
        return "local_sgd_adaptive"
    return s or "?"


def run_label(r: RunRecord) -> str:
    """A short name for plots: the run name without its experiment prefix."""
    return r.run_name.split("/", 1)[-1] if "/" in r.run_name else (r.run_name or r.run_id[:8])


def runs_frame(records: Sequence[RunRecord]) -> pd.DataFrame:
    """One row per run that logged metrics (sweep parents and metric-less summary runs are left out).

    Columns: run_id, run, status, sync, then the params that differ between the runs, then every metric's
    latest value under its MLflow name.
    """
    keep = [r for r in records if r.metrics and r.tags.get("ragtrain.role") != "sweep"]
    keys = sorted({k for r in keep for k in r.params})
    varying = [k for k in keys if k not in NOISE and len({r.params.get(k) for r in keep}) > 1]
    metrics = sorted({k for r in keep for k in r.metrics})
    rows = []
    for r in keep:
        row: dict[str, object] = {
            "run_id": r.run_id,
            "run": run_label(r),
            "status": r.status,
            "sync": sync_label(r.params, r.tags),
        }
        row.update({k: r.params.get(k) for k in varying})
        row.update({k: r.metrics.get(k, float("nan")) for k in metrics})
        rows.append(row)
    df = pd.DataFrame(rows, columns=["run_id", "run", "status", "sync", *varying, *metrics])
    dup = df["run"].duplicated(keep=False)  # plain runs of one experiment share a name: add the id
    df.loc[dup, "run"] = df.loc[dup, "run"] + " (" + df.loc[dup, "run_id"].str[:6] + ")"
    return df


def table_columns(df: pd.DataFrame, metric: str, cost: str, size: str) -> list[str]:
    """The printed subset: identity, the varying params (a few), the plotted figures."""
    fixed = ["run_id", "run", "status", "sync"]
    figures = [c for c in (metric, cost, size, "run/train/samples_per_s") if c in df]
    params = [c for c in df.columns if c not in fixed and "/" not in c][:MAX_TABLE_PARAMS]
    return ["run", "status", "sync", *params, *figures]


def compare_runs(
    uri: str,
    *,
    experiment: str | None = None,
    parent_run_id: str | None = None,
    out_dir: str | Path,
    metric: str = DEFAULT_METRIC,
    cost: str = DEFAULT_COST,
    size: str = DEFAULT_SIZE,
    curve: str = DEFAULT_CURVE,
    required: Sequence[str] = (),
    title: str | None = None,
) -> tuple[pd.DataFrame, list[Path]]:
    """Read the runs, write comparison.csv/.md/.png and learning_curves.png to out_dir; returns (table, files).
    `required`: metrics that must exist under the source (ValueError naming those that do, before writing)."""
    if bool(experiment) == bool(parent_run_id):
        raise ValueError("give exactly one of an experiment name or a parent run id")
    records = find_runs(uri, experiment=experiment, parent_run_id=parent_run_id)
    df = runs_frame(records)
    source = f"experiment {experiment!r}" if experiment else f"parent run {parent_run_id}"
    if df.empty:
        raise ValueError(f"no runs with metrics under {source} in {uri}")
    logged = [c for c in df.columns if "/" in c]
    missing = [m for m in required if m not in df]
    if missing:  # a misspelled metric asked for by name: an empty plot and exit 0 would hide it
        raise ValueError(f"no run under {source} logged {missing}; metrics there: {logged}")
    for name in (metric, cost):
        if name not in df:
            print(
                f"warning: no run under {source} logged {name!r}; metrics there: {[c for c in df.columns if '/' in c]}",
                file=sys.stderr,
            )
    title = title or source
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv, md = out / "comparison.csv", out / "comparison.md"
    df.to_csv(csv, index=False)
    shown = df[table_columns(df, metric, cost, size)]
    md.write_text(f"# {title}\n\n{shown.to_markdown(index=False, floatfmt='.4g')}\n")
    png = scatter_plot(
        df,
        cost,
        metric,
        out / "comparison.png",
        label="run",
        color="sync",
        size=size,
        title=f"{title}\nmarker size: {size}",
        xlabel=cost,
        ylabel=metric,
    )
    curves = {r: metric_history(uri, i, curve) for r, i in zip(df["run"], df["run_id"])}
    groups = dict(zip(df["run"], df["sync"]))
    lc = curves_plot(curves, out / "learning_curves.png", groups=groups, title=f"{title}: {curve}", ylabel=curve)
    return df, [csv, md, png, lc]


def folder_name(name: str) -> str:
    """A name (an MLflow experiment's, a run id) as one safe folder name: never a path that leaves its parent
    (`../../tmp/x` wrote reports outside outputs/compare), nor hidden or empty."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")
    return safe or "experiment"


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for bad input)."""
    ap = argparse.ArgumentParser(prog="python -m ragtrain compare", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--experiment", help="MLflow experiment name (logger.experiment_name; default of runs: ragtrain)")
    src.add_argument("--parent-run-id", help="a sweep's parent run id: compare its trials")
    ap.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else sqlite:///./mlruns/mlflow.db")
    ap.add_argument("--out", help="output folder (default: outputs/compare/<experiment or run id>)")
    # No argparse defaults: a metric given by name must exist (exit 2), a default one may be missing (a warning)
    ap.add_argument("--metric", help=f"y axis (default {DEFAULT_METRIC})")
    ap.add_argument("--cost", help=f"x axis (default {DEFAULT_COST})")
    ap.add_argument("--size", help=f"marker size (default {DEFAULT_SIZE})")
    ap.add_argument("--curve", help=f"learning-curve metric (default {DEFAULT_CURVE})")
    args = ap.parse_args(argv)
    norm = lambda m: m.replace("@", "_at_")  # noqa: E731 - accept pipeline spelling (ndcg@10)
    required = [norm(m) for m in (args.metric, args.cost, args.size, args.curve) if m]
    args.metric, args.cost = args.metric or DEFAULT_METRIC, args.cost or DEFAULT_COST
    args.size, args.curve = args.size or DEFAULT_SIZE, args.curve or DEFAULT_CURVE
    uri = args.tracking_uri or tracking_uri(LoggerConfig())
    out = args.out or str(Path("outputs", "compare", folder_name(args.experiment or args.parent_run_id)))
    db = sqlite_file(uri)
    if db is not None and not db.is_file():  # MLflow would create an empty one
        print(f"error: no MLflow store at {uri} (run an experiment first, or pass --tracking-uri)", file=sys.stderr)
        return 2
    from mlflow.exceptions import MlflowException  # lazy: mlflow is heavy (~1 s); this module imports without it

    try:
        check_tracking_uri(uri)  # an unknown scheme or an unreachable server: one line, in seconds
        df, files = compare_runs(
            uri,
            experiment=args.experiment,
            parent_run_id=args.parent_run_id,
            out_dir=out,
            metric=norm(args.metric),
            cost=norm(args.cost),
            size=norm(args.size),
            curve=norm(args.curve),
            required=required,
        )
    except (ValueError, ConfigError, MlflowException) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(
        df[table_columns(df, norm(args.metric), norm(args.cost), norm(args.size))].to_markdown(
            index=False, floatfmt=".4g"
        )
    )
    print(f"report: {', '.join(str(f) for f in files)}")
    return 0
