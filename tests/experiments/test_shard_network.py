"""experiments/shard_network.py's figures from runs' metrics (no cluster: the runs are records here), its cluster
command and its one-line refusals."""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import pandas as pd

from tests.experiments import script


def _load():
    return script("shard_network")


sh = _load()


def _run(**metrics) -> SimpleNamespace:
    return SimpleNamespace(status="FINISHED", metrics=metrics)


def test_a_row_averages_the_rounds_and_prices_their_bytes_at_the_measured_rate() -> None:
    rounds = {"seconds": [10.0, 14.0], "rx_mb": [180.0, 182.0], "search_p50": [4.0, 6.0], "search_p95": [9.0, 30.0]}
    rounds["mixed_recall"] = [1.0, 0.9]
    run = _run(**{"run/index/snapshot_mb": 90.9, "run/index/refresh_throughput_ratio": 0.8, "trained/ndcg_at_10": 0.9})
    r = sh.row("100mbit", "global", run, rounds, 96e6)
    assert r["rounds"] == 2 and r["round_s"] == 12.0 and r["rx_mb"] == 181.0
    assert r["wire_s"] == 181.0 * 8e6 / 96e6  # the bytes at the link's measured rate
    assert r["search_p50"] == 5.0 and r["search_p95"] == 30.0  # the mean median, the worst 95th percentile
    assert r["mixed_recall"] == 0.95 and r["snapshot_mb"] == 90.9 and r["final_ndcg"] == 0.9
    empty = sh.row("1gbit", "eager", _run(), {}, math.nan)
    assert empty["rounds"] == 0 and math.isnan(empty["round_s"]) and math.isnan(empty["wire_s"])


def test_the_table_puts_the_faster_link_first_and_formats_every_column() -> None:
    rows = pd.DataFrame(
        [
            sh.row("100mbit", "eager", _run(), {"seconds": [3.0]}, 95e6),
            sh.row("1gbit", "global", _run(), {"seconds": [2.0]}, 940e6),
        ],
        columns=sh.COLUMNS,
    )
    lines = sh.markdown_table(rows).splitlines()
    assert len(lines) == 4 and lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 14
    assert lines[2].startswith("| 1gbit | 940.0 | global |") and lines[3].startswith("| 100mbit | 95.0 | eager |")


def test_the_cluster_puts_the_trainer_and_service_on_node_0_and_a_shard_on_each_other_node(tmp_path) -> None:
    args = argparse.Namespace(override=["seed=1"])
    argv = sh.cluster_argv(args, "100mbit", tmp_path, "shx")
    cut = argv.index("--")
    cluster, run = argv[:cut], argv[cut + 1 :]
    pairs = [cluster[i + 1] for i, a in enumerate(cluster) if a == "--node-resources"]
    assert pairs == ["0:trainer_slot=1,pool_node=1", "1:index_node=1", "2:index_node=1"]
    assert cluster[cluster.index("--nodes") + 1] == "3" and cluster[cluster.index("--bandwidth") + 1] == "100mbit"
    assert "experiment=shard_network" in run and run[-1] == "seed=1"
    assert "--bandwidth" not in sh.cluster_argv(args, "unshaped", tmp_path, "shx")


def test_a_bad_bandwidth_and_a_report_without_a_folder_are_one_line() -> None:
    assert "bandwidth 'fast'" in sh.refusal(sh.parse_args(["--bandwidths", "fast", "--report-only", "--out", "x"]))
    assert sh.refusal(sh.parse_args(["--report-only"])) == "--report-only reads an existing run: give its --out"
