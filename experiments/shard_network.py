"""The live index across nodes: index shards on other nodes than the trainer, refreshed during training over shaped
links, per bandwidth and consistency policy.

    sudo python experiments/shard_network.py [--bandwidths 1gbit,100mbit] [--out DIR] [--override KEY=VALUE ...]

For each bandwidth, on a fresh 3-node emulated cluster (ragtrain/cluster/, docs/cluster.md) whose every link is shaped
to it: node 0 holds the driver, the trainer worker and the refresh service (`trainer_slot`, `pool_node`), nodes 1
and 2 one index shard each (`index_node`), and

    python -m ragtrain experiment=shard_network output_dir=DIR/B/run logger.tracking_uri=sqlite:///DIR/mlflow.db ...

trains MiniLM with the live index refreshed every 6 steps under each consistency policy of the experiment (global:
one barrier; eager: each shard's rows searchable as it lands). Then it reads every run back from MLflow and writes
DIR/table.md (and .csv) and the table into experiments/README.md between the `shard_network` marker comments.
`--report-only` reads an existing DIR again (no root needed).

Per bandwidth x policy: refresh rounds, the mean round seconds (snapshot fetched, rows re-encoded, landed as the
policy says, negatives mined), the MB the index nodes received per round (their interfaces' counters from the
moment a shard starts fetching the round's snapshot to the end of its encode) beside the snapshot's MB, the
seconds those bytes need at the measured rate, the single-query search latency p50 / p95 from the service's node
(a scatter to both shards and the merge, `refresh.search_probe` searches after each round), the mixed recall@10 of
the states searches saw, training samples/s while a round ran over while none did, and the final dev nDCG@10.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the checkout's ragtrain, whatever the cwd
    sys.path.insert(0, str(REPO))


def _sibling(name: str):
    """experiments/<name>.py as a module (the cluster runner, the machine and commit lines, the README block)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sn = _sibling("sync_network")

DEFAULT_BANDWIDTHS = "1gbit,100mbit"
BEGIN, END = sn.markers("shard_network")
README = REPO / "experiments" / "README.md"
NODE_RESOURCES = ("0:trainer_slot=1,pool_node=1", "1:index_node=1", "2:index_node=1")
RUN_TIMEOUT_S = 3600  # wall seconds a bandwidth's cluster may run both policies (a slow link's rounds included)
ROUND_METRICS = {  # column -> the metric each finished round logs (ragtrain/index/live_client.py, refresh_service.py)
    "seconds": "index/refresh_seconds",
    "rx_mb": "index/round_rx_mb",
    "tx_mb": "index/round_tx_mb",
    "search_p50": "index/search_ms_p50",
    "search_p95": "index/search_ms_p95",
    "mixed_recall": "index/mixed_recall_at_10",
}
COLUMNS = ["bandwidth", "policy", "status", "link_mbit", "rounds", "round_s", "rx_mb", "snapshot_mb", "wire_s"]
COLUMNS += ["search_p50", "search_p95", "mixed_recall", "throughput_ratio", "lag_wait_s", "final_ndcg"]


def cluster_argv(args: argparse.Namespace, bandwidth: str, out: Path, name: str) -> list[str]:
    """The emulated cluster at `bandwidth` around `python -m ragtrain experiment=shard_network`."""
    argv = [sys.executable, "-m", "ragtrain.cluster", "run", "--name", name, "--nodes", "3", "--cpus-per-node", "2"]
    argv += ["--storage", str(out / bandwidth / "cluster"), "--links-json", str(sn.links_file(out, bandwidth))]
    for r in NODE_RESOURCES:
        argv += ["--node-resources", r]
    if bandwidth != sn.UNSHAPED:
        argv += ["--bandwidth", bandwidth]
    run = [sys.executable, "-m", "ragtrain", "experiment=shard_network", f"output_dir={out / bandwidth / 'run'}"]
    run += [f"logger.tracking_uri=sqlite:///{out / 'mlflow.db'}", f"logger.experiment_name=shard_network_{bandwidth}"]
    return [*argv, "--", *run, *args.override]


def runs_of(uri: str, bandwidth: str) -> dict[str, object]:
    """The newest MLflow run of each policy at `bandwidth` ({} before any run)."""
    from ragtrain.track.mlflow import find_runs  # lazy: mlflow is heavy; the figures need none of it

    try:
        records = find_runs(uri, experiment=f"shard_network_{bandwidth}")
    except ValueError:
        return {}
    return {r.run_name.split("/", 1)[-1]: r for r in records if "/" in r.run_name and "comparison" not in r.run_name}


def row(bandwidth: str, policy: str, run, rounds: dict[str, list[float]], link_bits: float) -> dict[str, object]:
    """One table row from a run's summary metrics and its per-round histories (numbers, not text)."""
    m = run.metrics

    def mean(col: str) -> float:
        return float(sum(rounds[col]) / len(rounds[col])) if rounds.get(col) else math.nan

    rx = mean("rx_mb")
    return {
        "bandwidth": bandwidth,
        "policy": policy,
        "status": run.status.lower(),
        "link_mbit": link_bits / 1e6,
        "rounds": len(rounds.get("seconds", [])),
        "round_s": mean("seconds"),
        "rx_mb": rx,
        "snapshot_mb": m.get("run/index/snapshot_mb", math.nan),
        "wire_s": rx * 8e6 / link_bits if link_bits and not math.isnan(link_bits) else math.nan,
        "search_p50": mean("search_p50"),
        "search_p95": max(rounds["search_p95"]) if rounds.get("search_p95") else math.nan,
        "mixed_recall": mean("mixed_recall"),
        "throughput_ratio": m.get("run/index/refresh_throughput_ratio", math.nan),
        "lag_wait_s": m.get("run/index/lag_wait_seconds", math.nan),
        "final_ndcg": m.get("trained/ndcg_at_10", math.nan),
    }


def read_back(out: Path, bandwidths: Sequence[str]) -> pd.DataFrame:
    """Every policy x bandwidth's newest run as a row."""
    from ragtrain.track.mlflow import metric_history

    uri = f"sqlite:///{out / 'mlflow.db'}"
    rows = []
    for b in bandwidths:
        bits = sn.measured_bits(out, b)
        for policy, run in runs_of(uri, b).items():
            rounds = {c: [v for _, v in metric_history(uri, run.run_id, k)] for c, k in ROUND_METRICS.items()}
            rows.append(row(b, policy, run, rounds, bits))
    return pd.DataFrame(rows, columns=COLUMNS)


def markdown_table(rows: pd.DataFrame) -> str:
    f = sn._fmt
    head = (
        "| link | link Mb/s (measured) | consistency | status | rounds | round s | MB into the index nodes per round "
        "| snapshot MB | those MB at the link's rate, s | search p50 / p95 ms | mixed recall@10 "
        "| samples/s refreshing ÷ idle | dev nDCG@10 |"
    )
    lines = [head, "|" + "---|" * 13]
    order = {b: i for i, b in enumerate(sn.bandwidth_order(list(dict.fromkeys(rows["bandwidth"]))))}
    for _, r in rows.assign(_b=rows["bandwidth"].map(order)).sort_values(["_b", "policy"]).iterrows():
        cells = [r["bandwidth"], f(r["link_mbit"], ".1f"), r["policy"], r["status"], f(r["rounds"], ".0f")]
        cells += [f(r["round_s"], ".1f"), f(r["rx_mb"], ".1f"), f(r["snapshot_mb"], ".1f"), f(r["wire_s"], ".1f")]
        cells += [f"{f(r['search_p50'], '.1f')} / {f(r['search_p95'], '.1f')}", f(r["mixed_recall"], ".3f")]
        cells += [f(r["throughput_ratio"], ".2f"), f(r["final_ndcg"], ".4f")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def readme_block(table: str, about: dict[str, str]) -> str:
    return "\n".join(
        [
            BEGIN,
            f"## {about['date']}: `shard_network` — the live index on 2 nodes across shaped links",
            "",
            f"Machine: {about['machine']}. Commit: `{about['commit']}`. Command: `{about['command']}`.",
            "Each bandwidth ran on its own emulated 3-node cluster, every link shaped to it: the trainer (1 worker),",
            "the driver and the refresh service on node 0, one index shard on each of nodes 1 and 2. MB into the",
            "index nodes: their interfaces' received bytes from the moment a shard starts fetching the round's",
            "snapshot to the end of its encode, summed over the two nodes; search: single-query top-10 searches from",
            "node 0 (scatter to both shards, merge), 50 after each round, p50 the rounds' mean, p95 their worst.",
            "",
            table,
            END,
        ]
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="experiments/shard_network.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bandwidths", default=DEFAULT_BANDWIDTHS, help=f"comma-separated (default {DEFAULT_BANDWIDTHS})")
    ap.add_argument("--out", help="the run's folder (default outputs/shard_network/<date_time>)")
    ap.add_argument("--override", action="append", default=[], help="a ragtrain override KEY=VALUE (repeatable)")
    ap.add_argument("--readme", default=str(README), help="the README to write the block into ('' for none)")
    ap.add_argument("--report-only", action="store_true", help="read --out's runs again, run nothing")
    args = ap.parse_args(argv)
    args.bandwidths = [b.strip() for b in args.bandwidths.split(",") if b.strip()]
    return args


def refusal(args: argparse.Namespace) -> str | None:
    """Why the command cannot run, in one line; None if it can."""
    return sn.cluster_refusal(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    why = refusal(args)
    if why:
        print(f"experiments/shard_network.py: {why}", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = Path(args.out or REPO / "outputs" / "shard_network" / stamp).resolve()
    meta_path = out / "run.json"
    if args.report_only:
        meta = json.loads(meta_path.read_text())
    else:
        out.mkdir(parents=True, exist_ok=True)
        command = "python experiments/shard_network.py " + " ".join(sys.argv[1:] if argv is None else argv)
        about = {"date": stamp[:10], "machine": sn.machine(), "commit": sn.commit(), "command": command.strip()}
        meta = {"about": about, "bandwidths": [], "exit": {}}
        if meta_path.exists():  # more bandwidths into an earlier run's folder: its runs stay in the table
            meta = {**json.loads(meta_path.read_text()), "about": about}
        meta["bandwidths"] = list(dict.fromkeys([*meta["bandwidths"], *args.bandwidths]))
        for b in args.bandwidths:
            name = "sh" + secrets.token_hex(4)
            log = out / b / "cluster.log"
            rc, timed_out = sn.run_logged(cluster_argv(args, b, out, name), log, RUN_TIMEOUT_S, name, b)
            meta["exit"][b] = "timed out" if timed_out else rc
            meta_path.write_text(json.dumps(meta, indent=1))
    rows = read_back(out, meta["bandwidths"])
    table = markdown_table(rows)
    (out / "table.md").write_text(table + "\n")
    rows.to_csv(out / "table.csv", index=False)
    if args.readme:
        readme = Path(args.readme)
        readme.write_text(sn.replace_block(readme.read_text(), readme_block(table, meta["about"])))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
