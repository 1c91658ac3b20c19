"""Comparison tables and plots: CSV + Markdown + PNG, written to the run folder (and logged by the caller)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

COLUMNS = [
    "strategy",
    "seed",  # compare.seeds: one row per variant and seed
    "ndcg@10",
    "recall@10",
    "recall@100",
    "comm/bytes_per_step",
    "bytes_ratio_vs_ddp",
    "comm/time_share",
    "train/samples_per_s",
    "drift/param_divergence_mean",
    "drift/replica_cosine_mean",
    "drift/replica_topk_jaccard_mean",
    # RAG variants (experiment=squad_rag): the generator's EM / F1 per mode, the retriever's answer recall
    "rag/em",
    "rag/f1",
    "closed_book/em",
    "closed_book/f1",
    "oracle/em",
    "oracle/f1",
    # the answer likelihood (nats per answer; its own, larger question set): RAG's marginal, the top passage, the gold
    "likelihood/rag_nll",
    "likelihood/rag_nll_top1",
    "likelihood/oracle_nll",
    "rag/gold_in_top_k",
    "answer_recall@5",
    "answer_recall@20",
    "answer_recall@100",
    "seconds",
]


def comparison_frame(rows: list[dict]) -> pd.DataFrame:
    """One row per strategy; bytes relative to ddp when ddp is among them."""
    df = pd.DataFrame(rows)
    if "ddp" in set(df["strategy"]):
        ddp_bytes = float(df.loc[df["strategy"] == "ddp", "comm/bytes_per_step"].iloc[0])
        df["bytes_ratio_vs_ddp"] = ddp_bytes / df["comm/bytes_per_step"].where(df["comm/bytes_per_step"] > 0)
    return df[[c for c in COLUMNS if c in df.columns]]


def write_comparison(df: pd.DataFrame, out_dir: str | Path, title: str, sections: Sequence[str] = ()) -> list[Path]:
    """Write comparison.csv, comparison.md (+ `sections`: Markdown appended, empty ones skipped) and comparison.png
    (nDCG@10 vs bytes/step, drift as marker size; RAG variants: EM per mode)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv, md, png = out / "comparison.csv", out / "comparison.md", out / "comparison.png"
    df.to_csv(csv, index=False)
    text = f"# {title}\n\n" + df.to_markdown(index=False, floatfmt=".4g") + "\n"
    if "seed" in df.columns:  # several seeds: each variant's mean and its spread over the seeds
        text += "\n## Mean over seeds [min, max]\n\n" + seed_summary(df).to_markdown(index=False) + "\n"
    text += "".join(f"\n{s.strip()}\n" for s in sections if s.strip())
    md.write_text(text)

    if "rag/em" in df.columns and "seed" in df.columns:  # RAG variants over seeds: EM per mode with the spread
        seed_bars(df, ["rag/em", "closed_book/em", "oracle/em"], png, title=title, ylabel="exact match")
        return [csv, md, png]
    if "rag/em" in df.columns:  # RAG variants: the generator's EM against the retriever's hit rate in its prompt
        x = "rag/gold_in_top_k"
        scatter_plot(df, x, "rag/em", png, label="strategy", title=title, log_x=False, ylabel="RAG EM")
        return [csv, md, png]
    if "ndcg@10" not in df.columns:  # no index was evaluated (stages=[retriever]): the table says all there is
        png.unlink(missing_ok=True)  # a plot from an earlier run of the folder would show other figures
        return [csv, md]
    scatter_plot(
        df,
        "comm/bytes_per_step",
        "ndcg@10",
        png,
        label="strategy",
        size="drift/replica_cosine_mean",
        title=f"{title}\nmarker size: mean replica drift (1 - cos)",
        xlabel="bytes sent per step per worker (log)",
        ylabel="nDCG@10",
        big=4000.0,
    )
    return [csv, md, png]


def seed_summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per variant (in the order first run): each numeric column as `mean [min, max]` over its seeds."""
    numeric = [c for c in df.columns if c not in ("strategy", "seed") and pd.api.types.is_numeric_dtype(df[c])]
    groups = df.groupby("strategy", sort=False)
    rows = []
    for name, g in groups:
        row = {"strategy": name, "seeds": len(g)}
        for c in numeric:
            v = g[c].dropna()
            row[c] = f"{v.mean():.4g} [{v.min():.4g}, {v.max():.4g}]" if len(v) else ""
        rows.append(row)
    return pd.DataFrame(rows)


def seed_bars(df: pd.DataFrame, metrics: list[str], path: str | Path, *, title: str, ylabel: str) -> Path:
    """Grouped bars: each variant's mean of each metric over seeds, the whiskers its min and max, dots each seed."""
    plt = _pyplot()
    metrics = [m for m in metrics if m in df.columns and df[m].notna().any()]
    names = list(dict.fromkeys(df["strategy"]))
    width = 0.8 / max(len(metrics), 1)
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(names), 4.2))
    for j, m in enumerate(metrics):
        xs, means, lo, hi = [], [], [], []
        for i, n in enumerate(names):
            v = df.loc[df["strategy"] == n, m].dropna()
            if v.empty:
                continue
            x = i + (j - (len(metrics) - 1) / 2) * width
            xs.append(x)
            means.append(v.mean())
            lo.append(v.mean() - v.min())
            hi.append(v.max() - v.mean())
            ax.scatter([x] * len(v), v, color="black", s=10, zorder=3)
        ax.bar(xs, means, width, yerr=[lo, hi], capsize=3, label=m)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\nbars: mean over seeds; whiskers: min and max; dots: each seed", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def _pyplot():
    import matplotlib  # lazy: matplotlib is heavy; only the plots need it

    matplotlib.use("Agg")  # files only: no display on workers or CI
    import matplotlib.pyplot as plt  # lazy: matplotlib is heavy; only the plots need it

    return plt


def marker_sizes(values: pd.Series, small: float = 40.0, big: float = 1200.0) -> pd.Series:
    """Marker areas proportional to `values` (all `small` when nothing is positive)."""
    v = pd.to_numeric(values, errors="coerce").fillna(0.0).clip(lower=0.0)
    top = float(v.max()) if len(v) else 0.0
    return small + big * v / top if top > 0 else pd.Series([small] * len(v), index=v.index)


def scatter_plot(
    df: pd.DataFrame,
    x: str,
    y: str,
    path: str | Path,
    *,
    label: str | None = None,
    color: str | None = None,
    size: str | None = None,
    title: str = "",
    xlabel: str | None = None,
    ylabel: str | None = None,
    big: float = 1200.0,
    log_x: bool | None = None,
) -> Path:
    """y vs x (log x when some x is positive), one colour per `color` value, marker area from `size`, annotated."""
    plt = _pyplot()
    d = df[pd.to_numeric(df[y], errors="coerce").notna()] if y in df else df.iloc[0:0]
    sizes = marker_sizes(d[size], big=big) if size and size in d else pd.Series([40.0] * len(d), index=d.index)
    xs = pd.to_numeric(d[x], errors="coerce") if x in d else pd.Series([float("nan")] * len(d), index=d.index)
    log_x = bool((xs > 0).any()) if log_x is None else log_x
    xs = xs.clip(lower=1.0) if log_x else xs  # on a log axis, runs that sent nothing (vector_avg) sit at 1 byte
    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = d.groupby(d[color].astype(str), sort=True) if color and color in d else [(None, d)]
    for name, g in groups:
        ax.scatter(xs[g.index], g[y], s=sizes[g.index], alpha=0.6, label=name)
    if label and label in d:
        for i, r in d.iterrows():
            ax.annotate(str(r[label]), (xs[i], r[y]), textcoords="offset points", xytext=(5, 5), fontsize=8)
    if log_x:
        ax.set_xscale("log")
    if color and color in d:
        legend = ax.legend(title=color, fontsize=8)
        for handle in legend.legend_handles:  # one small marker per colour, not the first point's area
            handle.set_sizes([40.0])
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def curves_plot(
    curves: dict[str, list[tuple[int, float]]],
    path: str | Path,
    *,
    groups: dict[str, str] | None = None,
    title: str = "",
    ylabel: str = "",
    xlabel: str = "step",
) -> Path:
    """One line per run (label -> [(step, value)]); runs of the same group share a colour, told apart by line style."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    names = sorted(set((groups or {}).values()))
    seen: dict[str | None, int] = {}  # group -> runs drawn so far
    for label, points in curves.items():
        if not points:
            continue
        g = (groups or {}).get(label)
        c = palette[names.index(g) % len(palette)] if g in names else None
        nth = seen[g] = seen.get(g, -1) + 1
        steps, values = zip(*points)
        ax.plot(
            steps,
            values,
            marker="o",
            markersize=3,
            label=label,
            color=c,
            linestyle=styles[nth % len(styles)] if g in names else "-",
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if curves:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
