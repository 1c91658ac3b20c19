"""The partial-refresh curve of `experiment=shard_refresh`: fraction x priority -> dev nDCG@10 and encode seconds.

Reads one run of the experiment (its folder holds a sub-folder per variant, each with config.yaml, metrics.json
and refresh_history.json), prints a markdown table and writes a PNG beside it:

    python experiments/refresh_curve.py outputs/shard_refresh/<date_time> [--png experiments/refresh_curve.png]
        [--rounds-png experiments/refresh_rounds.png]

Per variant: the share of rows each round re-encoded, the shards' encode seconds summed over every round, the mean
mixed recall@10 and mined-negative agreement of the states searches saw, and the trained index's dev nDCG@10.
`--rounds-png` also draws each variant round by round (the worst state's mixed recall@10 and mined agreement against
the training step) beside its dev nDCG@10 and training samples/s: the view that compares consistency policies.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import yaml


class VariantError(ValueError):
    """A variant's file cannot be read (truncated, damaged, or not what a run writes); the message names it."""


DAMAGED = "the file is truncated or damaged: rerun the variant, or move its folder out of the run's"


def read_file(path: Path) -> dict:
    """A variant's JSON or YAML file as a mapping; VariantError names the file when it cannot be."""
    kind = "YAML" if path.suffix == ".yaml" else "JSON"
    try:
        doc = yaml.safe_load(path.read_text()) if kind == "YAML" else json.loads(path.read_text())
    except (ValueError, yaml.YAMLError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise VariantError(f"{path}: not readable {kind} ({str(e).splitlines()[0][:120]}): {DAMAGED}") from None
    if not isinstance(doc, dict):
        raise VariantError(f"{path}: not a mapping ({type(doc).__name__}): {DAMAGED}")
    return doc


def section(path: Path, doc: dict, *keys: str) -> dict:
    """doc[keys[0]][keys[1]]...: a VariantError names the file and the missing key."""
    for i, key in enumerate(keys):
        got = doc.get(key) if isinstance(doc, dict) else None
        if got is None:
            raise VariantError(f"{path}: no {'.'.join(keys[: i + 1])!r} figures ({sorted(doc)[:6]} there): {DAMAGED}")
        doc = got
    return doc


def variant_row(folder: Path) -> dict | None:
    """One variant's figures, or None for a folder that is not a finished variant."""
    paths = [folder / n for n in ("config.yaml", "metrics.json", "refresh_history.json")]
    if not all(p.is_file() for p in paths):
        return None
    cfg, metrics, history = (read_file(p) for p in paths)
    refresh = section(paths[0], cfg, "refresh")
    ndcg, train = section(paths[1], metrics, "trained", "ndcg@10"), section(paths[1], metrics, "train")
    rounds = [r for r in section(paths[2], history, "history") if isinstance(r, dict) and r.get("ok")]
    states = [s for r in rounds for s in r.get("state_metrics", [])]

    def mean_of(key: str, rows: list[dict]) -> float:
        got = [m[key] for m in rows if key in m]
        return sum(got) / len(got) if got else float("nan")

    round_metrics = [r.get("metrics", {}) for r in rounds]
    encode_s = sum(v for m in round_metrics for k, v in m.items() if k.endswith("_encode_seconds"))
    return {
        "variant": folder.name,
        "consistency": refresh.get("consistency"),
        "fraction": float(refresh.get("fraction", 1.0)),
        "priority": refresh.get("priority") if float(refresh.get("fraction", 1.0)) < 1 else "(all rows)",
        "rounds": len(rounds),
        "encoded_per_round": mean_of("index/encoded_fraction", round_metrics),
        "shard_encode_s": encode_s,
        "mixed_recall@10": mean_of("index/mixed_recall_at_10", states),
        "mined_agreement": mean_of("index/mined_agreement", states),
        "samples_per_s": train.get("train/samples_per_s", float("nan")),
        "ndcg@10": ndcg,
    }


def round_rows(folder: Path) -> list[dict]:
    """Per successful round of one variant: its step and the worst state searches saw during it."""
    path = folder / "refresh_history.json"
    rounds = section(path, read_file(path), "history")
    out = []
    for r in (r for r in rounds if r.get("ok") and r.get("state_metrics")):
        states = r["state_metrics"]
        worst = {k: min(s[k] for s in states if k in s) for k in ("index/mixed_recall_at_10", "index/mined_agreement")}
        out.append({"step": r["step"], **worst})
    return out


def plot_rounds(df: pd.DataFrame, rounds: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    for name, rows in rounds.items():
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["index/mixed_recall_at_10"] for r in rows], marker="o", label=name)
        axes[1].plot(steps, [r["index/mined_agreement"] for r in rows], marker="o", label=name)
    for ax, label in zip(axes[:2], ("mixed recall@10 (worst state of the round)", "mined agreement (worst state)")):
        ax.set_xlabel("training step of the round")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    bars = axes[2].bar(df["variant"], df["ndcg@10"], color="tab:blue")
    for bar, sps in zip(bars, df["samples_per_s"]):
        axes[2].annotate(f"{sps:.2f}/s", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                         va="bottom", fontsize=8)  # fmt: skip
    low = df["ndcg@10"].min()
    axes[2].set_ylim(low - 0.05, df["ndcg@10"].max() + 0.02)
    axes[2].set_ylabel("dev nDCG@10 (label: training samples/s)")
    axes[2].tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    ap.add_argument("--rounds-png", type=Path, help="also draw the variants round by round into this PNG")
    args = ap.parse_args(argv)
    if not args.run.is_dir():
        print(f"error: {args.run} is not a folder", file=sys.stderr)
        return 2
    try:
        rows = [r for f in sorted(args.run.iterdir()) if f.is_dir() and (r := variant_row(f)) is not None]
    except VariantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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
    if args.rounds_png:
        rounds = {name: round_rows(args.run / name) for name in df["variant"]}
        plot_rounds(df, rounds, args.rounds_png, f"{args.run.name}: each variant round by round")
        print(f"wrote {args.rounds_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
