"""experiments/sync_network.py: time to a target, the step split, the ring bound, the comm ratio, the table, the
crossover sentences and the README block, on small hand-made frames; the command's refusals and the cluster command
it builds."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import REPO
from tests.experiments import script


def _script():
    return script("sync_network")


sn = _script()
MBIT = 1e6


def _windows(bandwidth: str, strategy: str, seconds: list[float], ndcg: list[float], share: float, mb: float) -> list:
    """Windows of 5 steps each, cumulative seconds as given, one nDCG per window."""
    return [
        {"bandwidth": bandwidth, "strategy": strategy, "step": 5 * (i + 1), "seconds": s, "ndcg": n,
         "time_share": share, "bytes_per_step": mb * 1e6}
        for i, (s, n) in enumerate(zip(seconds, ndcg))
    ]  # fmt: skip


def _frames() -> tuple[pd.DataFrame, pd.DataFrame]:
    """ddp and topk on an unshaped link (10,000 Mb/s) and at 100 Mb/s: ddp reaches 0.97 on both, topk reaches 0.96
    at most (sooner than ddp at 100 Mb/s only); fp16 failed at 100 Mb/s after one window, and was not run unshaped."""
    w = _windows("unshaped", "ddp", [10, 20, 30], [0.90, 0.95, 0.97], 0.2, 90)
    w += _windows("unshaped", "topk", [11, 22, 33], [0.90, 0.93, 0.96], 0.1, 1.8)
    w += _windows("100mbit", "ddp", [50, 100, 150], [0.90, 0.95, 0.97], 0.8, 90)
    w += _windows("100mbit", "topk", [12, 24, 36], [0.90, 0.93, 0.96], 0.25, 1.8)
    w += _windows("100mbit", "fp16", [30], [0.91], 0.6, 45)
    runs = pd.DataFrame(
        [
            ["unshaped", "ddp", "finished", 0.975, 10_000 * MBIT, ""],
            ["unshaped", "topk", "finished", 0.965, 10_000 * MBIT, ""],
            ["unshaped", "fp16", "not run", math.nan, 10_000 * MBIT, "not started: exit 1"],
            ["100mbit", "ddp", "finished", 0.975, 95 * MBIT, ""],
            ["100mbit", "topk", "finished", 0.965, 95 * MBIT, ""],
            ["100mbit", "fp16", "failed", math.nan, 95 * MBIT, "exit 1, 100mbit/cluster-1.log"],
        ],
        columns=sn.RUN_COLUMNS,
    )
    return runs, pd.DataFrame(w, columns=sn.WINDOW_COLUMNS)


def test_the_time_to_target_is_the_first_window_at_or_above_it_never_interpolated() -> None:
    _, w = _frames()
    ddp = w[(w["bandwidth"] == "100mbit") & (w["strategy"] == "ddp")]
    assert sn.time_to_target(ddp, 0.95) == 100  # at the target counts: 0.95 at 100 s
    assert sn.time_to_target(ddp, 0.94) == 100  # not 75 s: nothing between windows is guessed
    assert sn.time_to_target(ddp, 0.90) == 50
    assert sn.time_to_target(ddp, 0.98) is None
    shuffled = ddp.sample(frac=1.0, random_state=1)
    assert sn.time_to_target(shuffled, 0.95) == 100  # by step, not by row order
    gaps = ddp.assign(ndcg=[math.nan, 0.96, 0.97])  # a window without validation is never the one
    assert sn.time_to_target(gaps, 0.9) == 100


def test_the_step_splits_into_exposed_comm_and_compute_weighted_by_each_windows_seconds() -> None:
    w = pd.DataFrame(
        {"step": [5, 10], "seconds": [10.0, 30.0], "time_share": [0.5, 0.25], "bytes_per_step": [4e6, 1e6]}
    )
    got = sn.step_split(w)
    assert got["steps"] == 10 and got["step_s"] == pytest.approx(3.0)
    assert got["comm_s"] == pytest.approx((0.5 * 10 + 0.25 * 20) / 10)  # each window's share of its own seconds
    assert got["compute_s"] == pytest.approx(3.0 - 1.0)
    assert got["bytes_per_step"] == pytest.approx((4e6 * 5 + 1e6 * 5) / 10)


def test_the_ring_bound_and_the_comm_ratio() -> None:
    # 8.22 MB per step at 100 Mb/s is 0.6576 s on the wire; on top of 0.3 s of compute
    assert sn.lower_bound(0.3, 8.22e6, 100 * MBIT) == pytest.approx(0.3 + 0.6576)
    assert sn.comm_ratio(0.77, 8.22e6, 100 * MBIT) == pytest.approx(0.77 / 0.6576)
    assert math.isnan(sn.comm_ratio(0.0, 0.0, 100 * MBIT))  # nothing sent: no ratio


def test_the_table_rows_hold_the_figures_and_keep_failed_and_missing_runs() -> None:
    runs, w = _frames()
    rows = sn.table_rows(runs, w, 0.95).set_index(["strategy", "bandwidth"])
    ddp = rows.loc[("ddp", "100mbit")]
    assert ddp["reached"] and ddp["seconds_to_target"] == 100
    assert ddp["step_s"] == pytest.approx(10.0) and ddp["comm_s"] == pytest.approx(8.0)
    assert ddp["compute_s"] == pytest.approx(2.0)
    # the bound takes the compute of ddp's unshaped run (10 s / 5 steps x 0.8) and the link's measured rate
    unshaped_compute = 2.0 * (1 - 0.2)
    assert ddp["bound_s"] == pytest.approx(unshaped_compute + 90e6 * 8 / (95 * MBIT))
    assert ddp["ratio"] == pytest.approx(8.0 / (90e6 * 8 / (95 * MBIT)))
    topk = rows.loc[("topk", "100mbit")]
    assert topk["reached"] and topk["seconds_to_target"] == 36
    missed = sn.table_rows(runs, w, 0.97).set_index(["strategy", "bandwidth"]).loc[("topk", "100mbit")]
    assert not missed["reached"] and missed["trained_s"] == 36 and math.isnan(missed["seconds_to_target"])
    fp16 = rows.loc[("fp16", "100mbit")]
    assert fp16["status"] == "failed" and fp16["trained_s"] == 30 and math.isnan(fp16["bound_s"])  # no unshaped run
    missing = rows.loc[("fp16", "unshaped")]
    assert missing["status"] == "not run" and math.isnan(missing["step_s"]) and not missing["reached"]


def test_the_markdown_table_shows_not_reached_as_more_than_the_seconds_trained() -> None:
    runs, w = _frames()
    table = sn.markdown_table(sn.table_rows(runs, w, 0.97), 0.97)
    lines = table.splitlines()
    assert "s to val nDCG@10 ≥ 0.97" in lines[0]
    assert len(lines) == 2 + 6
    row = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in lines[2:]}
    assert "| > 36 |" in row[("topk", "100mbit")]
    assert "| 150.0 |" in row[("ddp", "100mbit")]
    assert "failed (exit 1, 100mbit/cluster-1.log)" in row[("fp16", "100mbit")]
    assert "| not run |" in row[("fp16", "unshaped")]
    # fastest link first within a strategy, strategies in their order
    assert [r.split("|")[2].strip() for r in lines[2:4]] == ["unshaped", "100mbit"]


def test_a_crossover_is_the_highest_bandwidth_at_which_a_strategy_is_sooner_than_ddp() -> None:
    runs, w = _frames()
    # at 0.93: topk at 24 s against ddp's 100 s at 100 Mb/s, 22 s against 20 s unshaped
    sentences = sn.crossover_sentences(sn.table_rows(runs, w, 0.93), 0.93)
    topk = next(s for s in sentences if s.startswith("topk"))
    assert "overtakes ddp at 100mbit" in topk and "24.0 s against ddp's 100.0 s" in topk
    assert "at unshaped: 22.0 s against ddp's 20.0 s" in topk
    fp16 = next(s for s in sentences if s.startswith("fp16"))
    assert "at none of the links measured (unshaped, 100mbit)" in fp16
    # at 0.96 topk reaches it (36 s) where ddp needs 150 s, and unshaped (33 s vs 30 s) it does not
    at96 = sn.crossover_sentences(sn.table_rows(runs, w, 0.96), 0.96)
    assert any("overtakes ddp at 100mbit" in s and "36.0 s against ddp's 150.0 s" in s for s in at96)
    # a strategy sooner on the fastest link: said so
    faster = w.assign(seconds=w["seconds"].where(w["strategy"] != "topk", w["seconds"] / 10))
    first = sn.crossover_sentences(sn.table_rows(runs, faster, 0.93), 0.93)
    assert any(s.startswith("topk") and "already on the fastest link measured, unshaped" in s for s in first)
    assert sn.crossover_sentences(sn.table_rows(runs[runs["strategy"] != "ddp"], w, 0.9), 0.9) == [
        "No ddp run to compare against."
    ]


def test_the_readme_block_is_replaced_on_a_rerun_and_appended_the_first_time(tmp_path: Path) -> None:
    about = {"date": "2026-12-07", "machine": "a CPU", "commit": "abc1234", "command": "python x"}
    first = sn.readme_block("| table 1 |", ["one."], sn.PNG, about)
    text = sn.replace_block("# Write-ups\n\nearlier\n", first)
    assert text.startswith("# Write-ups\n\nearlier\n\n" + sn.BEGIN) and "| table 1 |" in text
    assert "![time to target vs bandwidth](sync_network.png)" in text and "`abc1234`" in text
    second = sn.replace_block(text + "\nlater\n", sn.readme_block("| table 2 |", ["two."], sn.PNG, about))
    assert "| table 1 |" not in second and "| table 2 |" in second and second.count(sn.BEGIN) == 1
    # another grid's block (--label) sits beside this one: neither replaces the other
    other = sn.replace_block(second, sn.readme_block("| hybrid |", ["h."], sn.PNG, {**about, "label": "sync_hybrid"}))
    assert "| table 2 |" in other and "| hybrid |" in other and other.count("<!-- sync_hybrid:begin -->") == 1
    again = sn.replace_block(other, sn.readme_block("| hybrid 2 |", [], sn.PNG, {**about, "label": "sync_hybrid"}))
    assert "| table 2 |" in again and "| hybrid |" not in again and "| hybrid 2 |" in again
    assert second.endswith("\nlater\n")


def test_the_figures_plot(tmp_path: Path) -> None:
    runs, w = _frames()
    png = sn.plot(sn.table_rows(runs, w, 0.95), tmp_path / "p.png", 0.95)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_strategies_are_the_presets_and_an_unknown_one_is_refused_in_one_line() -> None:
    presets = sn.sync_presets()
    assert {"ddp", "topk", "hierarchical"} <= set(presets)
    default = sn.default_strategies(presets)
    assert default[:5] == ["ddp", "fp16", "powersgd", "topk", "local_sgd"] and "hierarchical" not in default
    # the network-aware presets join where conf/sync/ has them
    assert sn.default_strategies(["ddp", "topk", "hierarchical"]) == ["ddp", "topk"]
    assert sn.default_strategies(["ddp", "diloco", "topk"]) == ["ddp", "topk", "diloco"]
    assert sn.unknown_strategies(["ddp"], presets) is None
    why = sn.unknown_strategies(["ddp", "nope"], presets)
    assert why.startswith("unknown sync strategies nope: the presets in conf/sync/ are ") and "\n" not in why
    assert "topk" in why


def test_the_command_refuses_in_one_line_with_exit_2(monkeypatch, capsys) -> None:
    assert sn.main(["--strategies", "ddp,nope"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert sn.main(["--bandwidths", "unshaped,fast"]) == 2
    assert "bandwidth 'fast'" in capsys.readouterr().err
    monkeypatch.setattr(sn.os, "geteuid", lambda: 1000)
    assert sn.main(["--strategies", "ddp"]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and err.count("\n") == 1


def test_the_cluster_command_per_bandwidth(tmp_path: Path) -> None:
    args = argparse.Namespace(nodes=2, cpus_per_node=1, time_cap=600.0, max_steps=10, override=["seed=1"])
    argv = sn.cluster_argv(args, "100mbit", ["ddp", "topk"], tmp_path, 1, "snx")
    head, cmd = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    assert head[1:4] == ["-m", "ragtrain.cluster", "run"] and "--bandwidth" in head
    assert head[head.index("--bandwidth") + 1] == "100mbit" and head[head.index("--cpus-per-node") + 1] == "1"
    assert head[head.index("--links-json") + 1] == str(tmp_path / "100mbit" / "links.json")
    assert cmd[1:4] == ["-m", "ragtrain", "experiment=sync_network"]
    assert "compare.strategies=[ddp,topk]" in cmd and f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db" in cmd
    assert "retriever.train.max_train_seconds=600" in cmd and "retriever.train.max_steps=10" in cmd
    assert "resources.trainer.num_workers=2" in cmd and cmd[-1] == "seed=1"
    assert "--bandwidth" not in sn.cluster_argv(args, "unshaped", ["ddp"], tmp_path, 1, "snx")
    assert sn.bandwidth_order(["10mbit", "unshaped", "1gbit", "100mbit"]) == ["unshaped", "1gbit", "100mbit", "10mbit"]


def test_a_failed_strategy_keeps_its_run_and_the_ones_after_it_run_on_a_new_cluster(tmp_path, monkeypatch) -> None:
    """The first cluster's command runs ddp, then topk fails (exit 1) before fp16 starts: fp16 runs on a second
    cluster; the note names topk's failure and its log. A command that starts nothing is not tried again."""
    args = argparse.Namespace(nodes=2, cpus_per_node=1, time_cap=600.0, max_steps=0, override=[], timeout=100.0)
    runs: dict[str, list] = {}
    plans = [(["ddp", "topk"], 1), (["fp16"], 0)]  # per invocation: the strategies that start, the exit code
    asked = []

    def fake_run(argv, log, timeout, name, prefix):
        asked.append((argv[argv.index("--") + 1 :], timeout))
        started, rc = plans.pop(0)
        for s in started:
            runs.setdefault(s, []).append(argparse.Namespace(run_id=f"{s}-{len(asked)}"))
        return rc, False

    monkeypatch.setattr(sn, "run_logged", fake_run)
    monkeypatch.setattr(sn, "runs_by_strategy", lambda uri, b: {k: list(v) for k, v in runs.items()})
    notes = sn.run_bandwidth(args, "100mbit", ["ddp", "topk", "fp16"], tmp_path)
    assert [a[0][4] for a in asked] == ["compare.strategies=[ddp,topk,fp16]", "compare.strategies=[fp16]"]
    assert [a[1] for a in asked] == [3 * 100 + sn.CLUSTER_S, 100 + sn.CLUSTER_S]  # the limit grows with the work
    assert notes == {"topk": "exit 1, 100mbit/cluster-1.log"}
    plans[:] = [([], 2)]  # the cluster itself fails: every strategy is noted, once
    asked.clear()
    notes = sn.run_bandwidth(args, "10mbit", ["ddp", "topk"], tmp_path)
    assert len(asked) == 1 and set(notes) == {"ddp", "topk"}
    assert notes["ddp"] == "not started: the cluster command ended (exit 2), 10mbit/cluster-1.log"


def test_workers_per_node_size_the_cluster_and_the_trainer_for_hierarchical(tmp_path: Path) -> None:
    args = sn.parse_args(["--nodes", "2", "--workers-per-node", "2", "--strategies", "hierarchical,ddp"])
    assert args.cpus_per_node == 2 and sn.unknown_strategies(args.strategies, args.presets) is None
    argv = sn.cluster_argv(args, "100mbit", args.strategies, tmp_path, 1, "snx")
    assert argv[argv.index("--cpus-per-node") + 1] == "2" and "resources.trainer.num_workers=4" in argv


def test_a_git_archive_copy_names_the_commit_it_was_made_from(tmp_path: Path) -> None:
    """Experiments run from a `git archive` copy (no .git): git stamps the commit into experiments/ARCHIVED_COMMIT."""
    import subprocess
    import tarfile

    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    tar = tmp_path / "a.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(tar), "HEAD", "experiments"], check=True)
    with tarfile.open(tar) as t:
        stamped = t.extractfile("experiments/ARCHIVED_COMMIT").read().decode().strip()
    assert stamped == head.stdout.strip()
    assert sn.commit().split(" ")[0] == head.stdout.strip()  # in the checkout: git itself
