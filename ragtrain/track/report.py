"""Comparison tables and plots: CSV + Markdown + PNG, written to the run folder (and logged by the caller)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

COLUMNS = [
    "strategy",
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
]


def comparison_frame(rows: list[dict]) -> pd.DataFrame:
    """One row per strategy; bytes relative to ddp when ddp is among them."""
    df = pd.DataFrame(rows)
    if "ddp" in set(df["strategy"]):
        ddp_bytes = float(df.loc[df["strategy"] == "ddp", "comm/bytes_per_step"].iloc[0])
        df["bytes_ratio_vs_ddp"] = ddp_bytes / df["comm/bytes_per_step"].where(df["comm/bytes_per_step"] > 0)
    return df[[c for c in COLUMNS if c in df.columns]]


def write_comparison(df: pd.DataFrame, out_dir: str | Path, title: str) -> list[Path]:
    """Write comparison.csv, comparison.md and comparison.png (nDCG@10 vs bytes/step, drift as marker size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv, md, png = out / "comparison.csv", out / "comparison.md", out / "comparison.png"
    df.to_csv(csv, index=False)
    md.write_text(f"# {title}\n\n" + df.to_markdown(index=False, floatfmt=".4g") + "\n")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    drift = df.get("drift/replica_cosine_mean", pd.Series([0.0] * len(df))).fillna(0.0)
    size = 40 + 4000 * drift / max(float(drift.max()), 1e-12) if float(drift.max()) > 0 else pd.Series([40] * len(df))
    x = df["comm/bytes_per_step"].clip(lower=1.0)
    ax.scatter(x, df["ndcg@10"], s=size, alpha=0.6)
    for (_, r), xi in zip(df.iterrows(), x):
        ax.annotate(r["strategy"], (xi, r["ndcg@10"]), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per step per worker (log)")
    ax.set_ylabel("nDCG@10")
    ax.set_title(f"{title}\nmarker size: mean replica drift (1 - cos)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return [csv, md, png]
