"""The partial-refresh curve of `experiment=shard_refresh`: fraction x priority -> dev nDCG@10 and encode seconds.

Reads one run of the experiment (its folder holds a sub-folder per variant, each with config.yaml, metrics.json
and refresh_history.json), prints a markdown table and writes a PNG beside it:

    python experiments/refresh_curve.py outputs/shard_refresh/<date_time> [--png experiments/refresh_curve.png]

Per variant: the share of rows each round re-encoded, the shards' encode seconds summed over every round, the mean
mixed recall@10 and mined-negative agreement of the states searches saw, and the trained index's dev nDCG@10.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import yaml


def variant_row(folder: Path) -> dict | None:
    """One variant's figures, or None for a folder that is not a finished variant."""
    paths = [folder / n for n in ("config.yaml", "metrics.json", "refresh_history.json")]
    if not all(p.is_file() for p in paths):
        return None
    cfg = yaml.safe_load(paths[0].read_text())
    metrics = json.loads(paths[1].read_text())
    rounds = [r for r in json.loads(paths[2].read_text())["history"] if r.get("ok")]
    states = [s for r in rounds for s in r.get("state_metrics", [])]

    def mean_of(key: str, rows: list[dict]) -> float:
        got = [m[key] for m in rows if key in m]
        return sum(got) / len(got) if got else float("nan")

    round_metrics = [r["metrics"] for r in rounds]
    encode_s = sum(v for m in round_metrics for k, v in m.items() if k.endswith("_encode_seconds"))
    return {
        "variant": folder.name,
        "consistency": cfg["refresh"]["consistency"],
        "fraction": float(cfg["refresh"]["fraction"]),
        "priority": cfg["refresh"]["priority"] if float(cfg["refresh"]["fraction"]) < 1 else "(all rows)",
        "rounds": len(rounds),
        "encoded_per_round": mean_of("index/encoded_fraction", round_metrics),
        "shard_encode_s": encode_s,
        "mixed_recall@10": mean_of("index/mixed_recall_at_10", states),
        "mined_agreement": mean_of("index/mined_agreement", states),
        "samples_per_s": metrics["train"].get("train/samples_per_s", float("nan")),
        "ndcg@10": metrics["trained"]["ndcg@10"],
    }


def plot(df: pd.DataFrame, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = df[df["fraction"] == 1.0]
    partial = df[df["fraction"] < 1.0]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    panels = (("fraction", "ndcg@10"), ("shard_encode_s", "ndcg@10"), ("fraction", "mined_agreement"))
    for ax, (x, y) in zip(axes, panels):
        for priority, g in partial.groupby("priority"):
            g = g.sort_values(x)
            ax.plot(g[x], g[y], marker="o", label=f"partial, {priority}")
        for _, r in full.iterrows():
            ax.axhline(r[y], color="grey", linestyle="--", linewidth=1)
            ax.scatter([r[x]], [r[y]], color="black", marker="s", zorder=3, label=f"full ({r['consistency']})")
        ax.set_xlabel({"fraction": "refresh.fraction (rows re-encoded per round)"}.get(x, "shard encode seconds"))
        ax.set_ylabel(y)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a shard_refresh run's folder (holds a folder per variant)")
    ap.add_argument("--png", type=Path, help="default: <run>/refresh_curve.png")
    args = ap.parse_args(argv)
    if not args.run.is_dir():
        print(f"error: {args.run} is not a folder", file=sys.stderr)
        return 2
    rows = [r for f in sorted(args.run.iterdir()) if f.is_dir() and (r := variant_row(f)) is not None]
    if not rows:
        print(
            f"error: no finished variant (config.yaml, metrics.json, refresh_history.json) in {args.run}",
            file=sys.stderr,
        )
        return 2
    df = pd.DataFrame(rows).sort_values(["fraction", "priority"], ascending=[False, True])
    print(df.to_markdown(index=False, floatfmt=".4g"))
    png = args.png or args.run / "refresh_curve.png"
    plot(df, png, f"shard_refresh, run {args.run.name}: partial refresh against the full one")
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
