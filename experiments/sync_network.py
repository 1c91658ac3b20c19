"""Every sync strategy on an emulated network, judged by the training seconds it needs to reach a dev nDCG@10 target.

    sudo python experiments/sync_network.py [--bandwidths unshaped,1gbit,100mbit,10mbit] [--strategies ddp,topk,...]
        [--target 0.97] [--out DIR] [--max-steps N] [--time-cap SECONDS] [--nodes 2 --workers-per-node 1]

For each bandwidth it runs, on a fresh emulated cluster (ragtrain/cluster/, docs/cluster.md),

    python -m ragtrain.cluster run --nodes 2 --cpus-per-node 1 [--bandwidth B] --links-json DIR/B/links.json --
        python -m ragtrain experiment=sync_network compare.strategies=[...] output_dir=DIR/B/run
        logger.tracking_uri=sqlite:///DIR/mlflow.db logger.experiment_name=sync_network_B ...

then reads every run back from MLflow and writes DIR/table.md (and .csv), the time-to-target plot (--png, default
experiments/sync_network.png) and the table with the plot's link into experiments/README.md between the
`sync_network` marker comments (the block is replaced on a rerun). A strategy that fails takes nothing else with it:
the strategies after it run again on a new cluster, and the table shows what failed and where its log is.
`--report-only` reads an existing DIR again (no root needed).

Per strategy x bandwidth the table holds: the training seconds to the first logged window whose val/ndcg@10 is at or
above the target (the run's cumulative `train/seconds` at that window: nothing is interpolated; "> S" when the run
trained S seconds without reaching it, stopped by `--time-cap` or its last step), the final dev nDCG@10
(trained/ndcg_at_10), the seconds of a step split into exposed communication (comm/time_share x step seconds) and
compute (the rest), bytes per step, the ring's lower bound for the step (compute s/step of the strategy's unshaped
run + bytes per step / the measured link rate) and the ratio of the measured communication seconds to bytes / rate.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the checkout's ragtrain, whatever the cwd
    sys.path.insert(0, str(REPO))

from ragtrain.cluster.netns import parse_rate  # noqa: I001 - after the path set-up above

UNSHAPED = "unshaped"
DEFAULT_BANDWIDTHS = "unshaped,1gbit,100mbit,10mbit"
# the default set: the plain baseline, the compressing reducers and local SGD; the two network-aware presets join
# where conf/sync/ has them; hierarchical is left out (it needs 2 workers per node: --workers-per-node 2)
DEFAULT_STRATEGIES = ("ddp", "fp16", "powersgd", "topk", "local_sgd", "diloco", "local_sgd_network")
BASELINE = "ddp"
# on this KB ddp at lr 2e-4 passed 0.97 by step 10 and ended near 0.985 (experiments/README.md, 2026-12-01 sync_sweep):
# a figure every strategy can reach, late enough to separate them
DEFAULT_TARGET = 0.97
LABEL = "sync_network"  # the README block's name (--label): a second grid (e.g. 2 machines x 2 workers) gets its own


def markers(label: str = LABEL) -> tuple[str, str]:
    """The comments around the README block of `label`."""
    return f"<!-- {label}:begin -->", f"<!-- {label}:end -->"


BEGIN, END = markers()
README = REPO / "experiments" / "README.md"
CLUSTER_S = 600  # wall seconds a cluster's bring-up and teardown may take on a loaded machine, beside its command
PNG = REPO / "experiments" / "sync_network.png"
WINDOW_METRICS = {  # column -> the MLflow metric of each log window (ragtrain/retriever/train.py, LogWindow)
    "seconds": "train/seconds",
    "ndcg": "val/ndcg_at_10",
    "time_share": "comm/time_share",
    "bytes_per_step": "comm/bytes_per_step",
}
RUN_COLUMNS = ["bandwidth", "strategy", "status", "final_ndcg", "link_bits", "note"]
WINDOW_COLUMNS = ["bandwidth", "strategy", "step", *WINDOW_METRICS]


# ---------------------------------------------------------------- arguments


def sync_presets(conf_dir: Path = REPO / "conf" / "sync") -> list[str]:
    """The conf/sync presets, by name."""
    return sorted(p.stem for p in conf_dir.glob("*.yaml"))


def default_strategies(presets: Sequence[str]) -> list[str]:
    """DEFAULT_STRATEGIES that exist as presets, in that order."""
    return [s for s in DEFAULT_STRATEGIES if s in presets]


def unknown_strategies(names: Sequence[str], presets: Sequence[str]) -> str | None:
    """One line naming the strategies that are no conf/sync preset and listing those that are; None if all are."""
    bad = [n for n in names if n not in presets]
    if not bad:
        return None
    return f"unknown sync strategies {', '.join(bad)}: the presets in conf/sync/ are {', '.join(presets)}"


def asked_bits(bandwidth: str) -> int | None:
    """The rate a bandwidth label asks for (bits/s), None for an unshaped link; ValueError for a bad label."""
    return None if bandwidth == UNSHAPED else parse_rate(bandwidth)


def bandwidth_order(bandwidths: Sequence[str]) -> list[str]:
    """Fastest first: unshaped, then by the asked rate."""
    return sorted(bandwidths, key=lambda b: -(asked_bits(b) or math.inf))


# ---------------------------------------------------------------- figures (pure: a runs frame and a windows frame)


def time_to_target(windows: pd.DataFrame, target: float) -> float | None:
    """The training seconds at the first logged window (by step) whose val nDCG@10 is at or above `target`; None if
    none is. Nothing is interpolated: the time is the window's own."""
    hit = windows[windows["ndcg"] >= target].sort_values("step")
    return None if hit.empty else float(hit["seconds"].iloc[0])


def step_split(windows: pd.DataFrame) -> dict[str, float]:
    """Per step over the run's windows: seconds, exposed communication (each window's time share x its seconds),
    compute (the rest) and bytes (each window's per-step bytes weighted by its steps), and the last step."""
    w = windows.sort_values("step")
    steps = w["step"].to_numpy(dtype=float)
    seconds = w["seconds"].to_numpy(dtype=float)
    n = steps - [0.0, *steps[:-1]]  # steps in each window
    window_s = seconds - [0.0, *seconds[:-1]]  # training seconds of each window (the metric is cumulative)
    last = float(steps[-1])
    step_s = float(seconds[-1]) / last
    exposed = float((w["time_share"].to_numpy(dtype=float) * window_s).sum()) / last
    return {
        "steps": last,
        "step_s": step_s,
        "comm_s": exposed,
        "compute_s": step_s - exposed,
        "bytes_per_step": float((w["bytes_per_step"].to_numpy(dtype=float) * n).sum()) / last,
    }


def lower_bound(compute_s: float, bytes_per_step: float, link_bits: float) -> float:
    """The fastest a step can be on a link of `link_bits` b/s: the compute of the unshaped run plus the ring's bytes
    at the link's rate (2(W-1)/W·P per worker for an all-reduce, ragtrain/sync/comm.py: what each worker sends)."""
    return compute_s + bytes_per_step * 8 / link_bits


def comm_ratio(comm_s: float, bytes_per_step: float, link_bits: float) -> float:
    """Measured communication seconds per step over the seconds the bytes need at the link's rate (NaN when nothing
    is sent): 1 = the collectives ran at the link's rate; above 1, they waited for more than the link."""
    wire = bytes_per_step * 8 / link_bits
    return comm_s / wire if wire > 0 else math.nan


def table_rows(runs: pd.DataFrame, windows: pd.DataFrame, target: float) -> pd.DataFrame:
    """One row per strategy x bandwidth of `runs` (numbers, not text: `markdown_table` formats them)."""
    rows = []
    for r in runs.itertuples(index=False):
        w = windows[(windows["bandwidth"] == r.bandwidth) & (windows["strategy"] == r.strategy)]
        row: dict[str, object] = {"strategy": r.strategy, "bandwidth": r.bandwidth, "status": r.status}
        row.update(link_mbit=r.link_bits / 1e6, final_ndcg=r.final_ndcg, note=r.note)
        if not w.empty and w["seconds"].notna().any():
            w = w[w["seconds"].notna()]
            tta = time_to_target(w, target)
            row.update(step_split(w), reached=tta is not None, seconds_to_target=tta, trained_s=w["seconds"].max())
        rows.append(row)
    out = pd.DataFrame(rows)
    for col in ("steps", "step_s", "comm_s", "compute_s", "bytes_per_step", "seconds_to_target", "trained_s"):
        if col not in out:
            out[col] = math.nan
    if "reached" not in out:
        out["reached"] = False
    out["reached"] = out["reached"].fillna(False).astype(bool)
    out["seconds_to_target"] = pd.to_numeric(out["seconds_to_target"], errors="coerce")
    unshaped = out[out["bandwidth"] == UNSHAPED].set_index("strategy")["compute_s"]
    base = out["strategy"].map(unshaped)
    out["bound_s"] = [lower_bound(c, b, k * 1e6) for c, b, k in zip(base, out["bytes_per_step"], out["link_mbit"])]
    out["ratio"] = [
        comm_ratio(c, b, k * 1e6) for c, b, k in zip(out["comm_s"], out["bytes_per_step"], out["link_mbit"])
    ]
    return out


def _fmt(x: object, spec: str) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def target_cell(row: pd.Series) -> str:
    """Seconds to the target; "> S" when the run trained S seconds without reaching it; the status otherwise."""
    if row["reached"]:
        return _fmt(row["seconds_to_target"], ".1f")
    if isinstance(row["trained_s"], float) and not math.isnan(row["trained_s"]):
        return f"> {row['trained_s']:.0f}"
    return str(row["status"])


def markdown_table(rows: pd.DataFrame, target: float) -> str:
    """The table as Markdown, strategies in their order, bandwidths fastest first within each."""
    head = (
        f"| strategy | link | link Mb/s (measured) | status | steps | s to val nDCG@10 ≥ {target:g} "
        "| final dev nDCG@10 | step s | compute s/step | exposed comm s/step | MB/step | ring bound s/step "
        "| comm s / (bytes / rate) |"
    )
    lines = [head, "|" + "---|" * 13]
    order = {b: i for i, b in enumerate(bandwidth_order(list(dict.fromkeys(rows["bandwidth"]))))}
    strategies = list(dict.fromkeys(rows["strategy"]))
    ranked = rows.assign(_s=rows["strategy"].map(strategies.index), _b=rows["bandwidth"].map(order))
    for _, r in ranked.sort_values(["_s", "_b"]).iterrows():
        status = r["status"] + (f" ({r['note']})" if r["note"] else "")
        cells = [r["strategy"], r["bandwidth"], _fmt(r["link_mbit"], ".1f"), status, _fmt(r["steps"], ".0f")]
        cells += [target_cell(r), _fmt(r["final_ndcg"], ".4f"), _fmt(r["step_s"], ".2f"), _fmt(r["compute_s"], ".2f")]
        cells += [_fmt(r["comm_s"], ".2f"), _fmt(r["bytes_per_step"] / 1e6, ".2f"), _fmt(r["bound_s"], ".2f")]
        cells += [_fmt(r["ratio"], ".2f")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _sooner(row: pd.Series, ddp: pd.Series | None) -> bool:
    """The row reached the target, and sooner than ddp at its bandwidth (or ddp did not reach it)."""
    if not row["reached"]:
        return False
    return ddp is None or not ddp["reached"] or row["seconds_to_target"] < ddp["seconds_to_target"]


def _versus(row: pd.Series | None, ddp: pd.Series | None) -> str:
    def t(r: pd.Series | None) -> str:
        return "no run" if r is None else (f"{r['seconds_to_target']:.1f} s" if r["reached"] else target_cell(r))

    return f"{t(row)} against ddp's {t(ddp)}"


def crossover_sentences(rows: pd.DataFrame, target: float) -> list[str]:
    """Per strategy other than ddp, one sentence: the highest bandwidth at which it reaches the target sooner than
    ddp, with the figures there and at the next faster link, or that it does so at none."""
    if BASELINE not in set(rows["strategy"]):
        return [f"No {BASELINE} run to compare against."]
    bws = bandwidth_order(list(dict.fromkeys(rows["bandwidth"])))
    cell = {(r["strategy"], r["bandwidth"]): r for _, r in rows.iterrows()}
    out = []
    for s in dict.fromkeys(rows["strategy"]):
        if s == BASELINE:
            continue
        wins = [b for b in bws if (s, b) in cell and _sooner(cell[(s, b)], cell.get((BASELINE, b)))]
        reach = f"val nDCG@10 ≥ {target:g}"
        if not wins:
            out.append(f"{s} reaches {reach} sooner than ddp at none of the links measured ({', '.join(bws)}).")
            continue
        top = wins[0]
        here = _versus(cell[(s, top)], cell.get((BASELINE, top)))
        if top == bws[0]:
            sentence = f"{s} reaches {reach} sooner than ddp already on the fastest link measured, {top} ({here})"
        else:
            above = bws[bws.index(top) - 1]
            there = _versus(cell.get((s, above)), cell.get((BASELINE, above)))
            sentence = f"{s} overtakes ddp at {top}: the highest bandwidth at which it reaches {reach} sooner ({here}; "
            sentence += f"at {above}: {there})"
        others = [b for b in wins[1:]]
        lower = [b for b in bws[bws.index(top) + 1 :] if (s, b) in cell and b not in others]
        tail = f"; also sooner at {', '.join(others)}" if others else ""
        tail += f"; not sooner at {', '.join(lower)}" if lower else ""
        out.append(sentence + tail + ".")
    return out


# ---------------------------------------------------------------- outputs


def plot(rows: pd.DataFrame, path: Path, target: float) -> Path:
    """Seconds to the target against the measured link rate (log x), one line per strategy; a run that did not
    reach it is an open marker at the seconds it trained, labelled "> S"."""
    import matplotlib  # lazy: only the report draws (the figures and their tests need no matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, ScalarFormatter

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, s in enumerate(dict.fromkeys(rows["strategy"])):
        r = rows[(rows["strategy"] == s) & rows["link_mbit"].notna()].sort_values("link_mbit")
        color = f"C{i % 10}"
        hit = r[r["reached"]]
        ax.plot(hit["link_mbit"], hit["seconds_to_target"], "o-", color=color, label=s)
        miss = r[~r["reached"] & r["trained_s"].notna()]
        ax.plot(miss["link_mbit"], miss["trained_s"], "o", mfc="none", color=color, ms=9)
        for _, m in miss.iterrows():
            ax.annotate(f"> {m['trained_s']:.0f}", (m["link_mbit"], m["trained_s"]), fontsize=7, color=color,
                        xytext=(4, 4), textcoords="offset points")  # fmt: skip
    links = rows.groupby("bandwidth")["link_mbit"].median().dropna()
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(list(links.values), [f"{b}\n{v:.0f} Mb/s" for b, v in links.items()], fontsize=8)
    ax.minorticks_off()
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # seconds span a decade or two: label 1-2-5
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("link (measured rate)")
    ax.set_ylabel(f"training seconds to val nDCG@10 ≥ {target:g}")
    ax.set_title("time to target vs bandwidth (open marker: not reached, at the seconds trained)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def machine() -> str:
    """The CPU's model and cores, and whether it has the units that decide CPU training speed."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    found = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    flags = set(found.group(1).split()) if found else set()
    units = [f"{u} {'yes' if any(f.startswith(u) for f in flags) else 'no'}" for u in ("avx2", "avx512_bf16", "amx")]
    return f"{model.group(1).strip() if model else 'unknown CPU'}, {os.cpu_count()} cores ({', '.join(units)})"


def commit() -> str:
    """The checkout's short commit, marked when the tree had changes not committed."""
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if not head:  # a `git archive` copy (experiments run from one): git wrote the commit into ARCHIVED_COMMIT
        stamped = (REPO / "experiments" / "ARCHIVED_COMMIT").read_text().strip()
        return "unknown" if stamped.startswith("$Format") else f"{stamped} (a git archive of it)"
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return head + (" (with changes not committed)" if dirty.stdout.strip() else "")


def readme_block(table: str, sentences: Sequence[str], png: Path, about: dict[str, str]) -> str:
    """The README's section: when, where, the command, the table, the crossovers and the plot."""
    rel = os.path.relpath(png, README.parent)
    begin, end = markers(about.get("label", LABEL))
    nodes, per_node = about.get("nodes", "2"), about.get("workers_per_node", "1")
    lines = [
        begin,
        f"## {about['date']}: `{about.get('label', LABEL)}` — time to a dev nDCG@10 target per sync strategy and link",
        "",
        f"Machine: {about['machine']}. Commit: `{about['commit']}`. Command: `{about['command']}`.",
        f"Each bandwidth ran on its own emulated {nodes}-node cluster ({per_node} trainer worker(s) per node: inside a",
        "node they talk over its loopback, at full speed; between nodes over the shaped link); the link rate is the",
        "slower direction the cluster measured. Seconds are training seconds (`train/seconds`: validation, drift",
        "probes and logging excluded); exposed comm = `comm/time_share` × step seconds; ring bound = compute s/step of",
        "the strategy's unshaped run + bytes per step / link rate; the last column is the measured comm seconds over",
        "bytes / link rate. An unshaped link's rate is what the probe's sender could push on this loaded CPU",
        "(the two directions differ several-fold), so its bound and ratio say little; a blocking collective's",
        "seconds include waiting for the slower rank.",
        "",
        table,
        "",
        *[f"- {s}" for s in sentences],
        "",
        f"![time to target vs bandwidth]({rel})",
        end,
    ]
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """`text` with the block of the same label as `block` replaced by it, or `block` appended when there is none."""
    begin = block.splitlines()[0]
    end = begin.replace(":begin -->", ":end -->")
    if begin in text and end in text:
        start, stop = text.index(begin), text.index(end) + len(end)
        return text[:start] + block + text[stop:]
    return text.rstrip("\n") + "\n\n" + block + "\n"


# ---------------------------------------------------------------- running (on the emulated cluster) and reading back


def experiment_name(bandwidth: str) -> str:
    """The MLflow experiment of one bandwidth's runs."""
    return f"sync_network_{bandwidth}"


def links_file(out: Path, bandwidth: str) -> Path:
    return out / bandwidth / "links.json"


def ragtrain_argv(args: argparse.Namespace, bandwidth: str, strategies: Sequence[str], out: Path, n: int) -> list[str]:
    """`python -m ragtrain experiment=sync_network ...` for one bandwidth (its n-th attempt: a folder of its own)."""
    argv = [sys.executable, "-m", "ragtrain", "experiment=sync_network", f"compare.strategies=[{','.join(strategies)}]"]
    argv += [f"output_dir={out / bandwidth / f'run-{n}'}", f"logger.tracking_uri=sqlite:///{out / 'mlflow.db'}"]
    argv += [f"logger.experiment_name={experiment_name(bandwidth)}"]
    argv += [f"resources.trainer.num_workers={args.nodes * args.cpus_per_node}"]  # one worker per CPU of the cluster
    argv += [f"retriever.train.max_train_seconds={args.time_cap:g}"]
    if args.max_steps:
        argv.append(f"retriever.train.max_steps={args.max_steps}")
    return argv + list(args.override)


def cluster_argv(
    args: argparse.Namespace, bandwidth: str, strategies: Sequence[str], out: Path, n: int, name: str
) -> list[str]:
    """The emulated cluster at `bandwidth` around the ragtrain command."""
    argv = [sys.executable, "-m", "ragtrain.cluster", "run", "--name", name, "--nodes", str(args.nodes)]
    argv += ["--cpus-per-node", str(args.cpus_per_node), "--storage", str(out / bandwidth / "cluster")]
    argv += ["--links-json", str(links_file(out, bandwidth))]
    if bandwidth != UNSHAPED:
        argv += ["--bandwidth", bandwidth]
    return [*argv, "--", *ragtrain_argv(args, bandwidth, strategies, out, n)]


def _copy(stream, log: Path, prefix: str) -> None:
    """Every line of the command's output to its log file and, prefixed, to this terminal."""
    with log.open("a") as f:
        for line in stream:
            f.write(line)
            f.flush()
            sys.stderr.write(f"[{prefix}] {line}")


def run_logged(argv: list[str], log: Path, timeout: float, name: str, prefix: str) -> tuple[int, bool]:
    """Run the cluster command, its output to `log`; past `timeout` seconds it gets SIGTERM (its own teardown), then
    SIGKILL. Returns (exit code, timed out). Whatever happens, the cluster `name` is gone afterwards."""
    from ragtrain.cluster import emulated  # lazy: only a real run needs it (the report and its tests do not)

    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("$ " + " ".join(argv) + "\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # a pipe would hold the run's lines back in blocks
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    copier = threading.Thread(target=_copy, args=(p.stdout, log, prefix), daemon=True)
    copier.start()
    timed_out = False
    try:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            p.send_signal(signal.SIGTERM)  # the cluster tool tears down on SIGTERM
            p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        emulated.down(name)  # idempotent: after a SIGKILL (or none needed) nothing of the cluster is left
        copier.join(timeout=10)
    return p.returncode, timed_out


def runs_by_strategy(uri: str, bandwidth: str) -> dict[str, list]:
    """The bandwidth's MLflow runs per sync preset, oldest first ({} before any run)."""
    # lazy: mlflow is heavy (~1 s); argument checks and the figures need none of it
    from ragtrain.commands.compare import sync_label
    from ragtrain.track.mlflow import find_runs

    try:
        records = find_runs(uri, experiment=experiment_name(bandwidth))
    except ValueError:  # no experiment yet: nothing ran
        return {}
    out: dict[str, list] = {}
    for r in records:
        out.setdefault(sync_label(r.params, r.tags), []).append(r)
    return out


def run_bandwidth(args: argparse.Namespace, bandwidth: str, strategies: Sequence[str], out: Path) -> dict[str, str]:
    """Run the strategies at one bandwidth. A failure ends its cluster's command: the strategies it had not started
    run again on a new cluster; the one that failed keeps its (failed) run. Returns a note per strategy that ended
    otherwise than finished."""
    notes: dict[str, str] = {}
    pending, n = list(strategies), 0
    uri = f"sqlite:///{out / 'mlflow.db'}"
    while pending:
        n += 1
        before = {s: {r.run_id for r in rs} for s, rs in runs_by_strategy(uri, bandwidth).items()}
        log = out / bandwidth / f"cluster-{n}.log"
        name = "sn" + secrets.token_hex(4)
        argv = cluster_argv(args, bandwidth, pending, out, n, name)
        limit = args.timeout * len(pending) + CLUSTER_S
        print(f"[{bandwidth}] {', '.join(pending)} (log {log})", file=sys.stderr)
        rc, timed_out = run_logged(argv, log, limit, name, bandwidth)
        if rc == 0 and not timed_out:
            break
        after = runs_by_strategy(uri, bandwidth)
        started = [s for s in pending if {r.run_id for r in after.get(s, [])} - before.get(s, set())]
        why = f"stopped after {limit:.0f} s (--timeout)" if timed_out else f"exit {rc}"
        if not started:  # nothing began: another try would end the same way
            for s in pending:
                notes[s] = f"not started: the cluster command ended ({why}), {log.relative_to(out)}"
            break
        notes[started[-1]] = f"{why}, {log.relative_to(out)}"
        pending = [s for s in pending if s not in started]
    return notes


def measured_bits(out: Path, bandwidth: str) -> float:
    """The slower direction the cluster measured (the ring waits for the slower link); NaN without a measurement."""
    path = links_file(out, bandwidth)
    links = json.loads(path.read_text()) if path.exists() else []
    return float(min(m["achieved_bits"] for m in links)) if links else math.nan


def window_records(uri: str, run_id: str, bandwidth: str, strategy: str) -> list[dict]:
    """One record per logged window of a run (every window logs train/seconds; validation the same windows)."""
    from ragtrain.track.mlflow import metric_history  # lazy: mlflow is heavy (~1 s)

    cols = {c: dict(metric_history(uri, run_id, m)) for c, m in WINDOW_METRICS.items()}
    return [
        {"bandwidth": bandwidth, "strategy": strategy, "step": step, **{c: cols[c].get(step, math.nan) for c in cols}}
        for step in sorted(cols["seconds"])
    ]


def read_back(out: Path, bandwidths: Sequence[str], strategies: Sequence[str], notes: dict) -> tuple:
    """(runs, windows) frames of every strategy x bandwidth: each pair's newest MLflow run, or a "not run" row."""
    uri = f"sqlite:///{out / 'mlflow.db'}"
    runs, windows = [], []
    for b in bandwidths:
        found = runs_by_strategy(uri, b) if (out / "mlflow.db").exists() else {}
        bits = measured_bits(out, b)
        for s in strategies:
            note = notes.get(b, {}).get(s, "")
            if s not in found:
                runs.append(dict(zip(RUN_COLUMNS, [b, s, "not run", math.nan, bits, note])))
                continue
            r = found[s][-1]  # the newest
            w = window_records(uri, r.run_id, b, s)
            cap = float(r.params.get("retriever.train.max_train_seconds", 0) or 0)
            if cap and w and w[-1]["seconds"] >= cap:
                note = "; ".join(x for x in (f"stopped at the {cap:g} s cap", note) if x)
            status = r.status.lower()
            # the trained index's dev nDCG@10; a run without the index stage (stages=[retriever]): its last
            # validation, which is that figure when the validation sample holds every dev query and passage
            final = r.metrics.get("trained/ndcg_at_10", w[-1]["ndcg"] if w else math.nan)
            runs.append(dict(zip(RUN_COLUMNS, [b, s, status, final, bits, note])))
            windows += w
    return pd.DataFrame(runs, columns=RUN_COLUMNS), pd.DataFrame(windows, columns=WINDOW_COLUMNS)


def report(args: argparse.Namespace, out: Path, about: dict[str, str], notes: dict) -> str:
    """Read every run back; write DIR/table.md, .csv, windows.csv, the PNG and the README block; returns the text."""
    runs, windows = read_back(out, args.bandwidths, args.strategies, notes)
    rows = table_rows(runs, windows, args.target)
    table, sentences = markdown_table(rows, args.target), crossover_sentences(rows, args.target)
    text = table + "\n\n" + "\n".join(f"- {s}" for s in sentences) + "\n"
    (out / "table.md").write_text(text)
    rows.to_csv(out / "table.csv", index=False)
    windows.to_csv(out / "windows.csv", index=False)
    png = plot(rows, Path(args.png).resolve(), args.target)
    if args.readme:
        readme = Path(args.readme)
        block = readme_block(table, sentences, png, about)
        readme.write_text(replace_block(readme.read_text() if readme.exists() else "", block))
    return text


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    presets = sync_presets()
    ap = argparse.ArgumentParser(prog="experiments/sync_network.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bandwidths", default=DEFAULT_BANDWIDTHS, help=f"comma-separated (default {DEFAULT_BANDWIDTHS})")
    ap.add_argument(
        "--strategies", help=f"comma-separated conf/sync presets (default {','.join(default_strategies(presets))})"
    )
    ap.add_argument("--target", type=float, help=f"the val nDCG@10 to reach (default {DEFAULT_TARGET}; --report-only: "
                    "the run's)")  # fmt: skip
    ap.add_argument("--out", help="the run's folder (default outputs/sync_network/<date_time>)")
    ap.add_argument("--max-steps", type=int, default=0, help="retriever.train.max_steps (default: the experiment's)")
    ap.add_argument("--time-cap", type=float, default=600.0, help="training seconds per run (default 600)")
    ap.add_argument("--timeout", type=float, help="wall seconds per strategy (validation, indexing and start-up "
                    "included) before its cluster is stopped (default 3 x the time cap + 900)")  # fmt: skip
    ap.add_argument("--nodes", type=int, default=2, help="Ray nodes (default 2)")
    ap.add_argument(
        "--workers-per-node",
        "--cpus-per-node",
        dest="cpus_per_node",
        type=int,
        default=1,
        help="trainer workers per Ray node, one CPU each (default 1); hierarchical groups by node: --nodes 2 "
        "--workers-per-node 2",
    )
    ap.add_argument("--override", action="append", default=[], help="a ragtrain override KEY=VALUE (repeatable)")
    ap.add_argument("--png", default=str(PNG), help=f"the plot (default {PNG.relative_to(REPO)})")
    ap.add_argument("--readme", default=str(README), help="the README to write the block into ('' for none)")
    ap.add_argument("--report-only", action="store_true", help="read --out's runs again, run nothing")
    ap.add_argument("--label", default=LABEL, help=f"the README block's name (default {LABEL}; another grid: another)")
    args = ap.parse_args(argv)
    args.strategies = args.strategies.split(",") if args.strategies else default_strategies(presets)
    args.bandwidths = [b.strip() for b in args.bandwidths.split(",") if b.strip()]
    args.timeout = args.timeout or 3 * args.time_cap + 900
    args.presets = presets
    return args


def refusal(args: argparse.Namespace) -> str | None:
    """Why the command cannot run, in one line; None if it can."""
    return unknown_strategies(args.strategies, args.presets) or cluster_refusal(args)


def cluster_refusal(args: argparse.Namespace) -> str | None:
    """Why a grid on emulated clusters cannot run (a bad bandwidth, a report without its folder, no root), in one
    line; None if it can. Shared by every experiment that brings up one cluster per bandwidth."""
    for b in args.bandwidths:
        try:
            asked_bits(b)
        except ValueError as e:
            return f"bandwidth {b!r}: {e} (or {UNSHAPED})"
    if args.report_only and not args.out:
        return "--report-only reads an existing run: give its --out"
    if not args.report_only and os.geteuid() != 0:
        return "needs root: the emulated cluster makes network namespaces (run it with sudo)"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    why = refusal(args)
    if why:
        print(f"experiments/sync_network.py: {why}", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = Path(args.out or REPO / "outputs" / "sync_network" / stamp).resolve()
    meta_path = out / "run.json"
    if args.report_only:  # what ran, and how it ended, as the run recorded it; the target may differ
        meta = json.loads(meta_path.read_text())
        args.bandwidths, args.strategies = meta["bandwidths"], meta["strategies"]
        args.target = meta.get("target", DEFAULT_TARGET) if args.target is None else args.target
    else:
        out.mkdir(parents=True, exist_ok=True)
        command = "python experiments/sync_network.py " + " ".join(sys.argv[1:] if argv is None else argv)
        about = {"date": stamp[:10], "machine": machine(), "commit": commit(), "command": command.strip()}
        about.update(label=args.label, nodes=str(args.nodes), workers_per_node=str(args.cpus_per_node))
        args.target = DEFAULT_TARGET if args.target is None else args.target
        meta = {"about": about, "bandwidths": args.bandwidths, "strategies": args.strategies, "target": args.target}
        meta["notes"] = {}
        for b in args.bandwidths:
            meta_path.write_text(json.dumps(meta, indent=1))
            meta["notes"][b] = run_bandwidth(args, b, args.strategies, out)
        meta_path.write_text(json.dumps(meta, indent=1))
    print(report(args, out, meta["about"], meta["notes"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
