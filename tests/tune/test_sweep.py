"""Sweeps end to end on a real local Ray cluster and a real MLflow store (a tracking server, or SQLite).

The tiny encoder keeps each trial to a few steps; trials run one at a time so ASHA's decision is deterministic
(the bad trial reaches its first rung after the good one has set the bar).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from ray.tune import Callback

from ragtrain.cluster.resources import InfeasibleResourcesError
from ragtrain.config import Config, to_typed
from ragtrain.runtime.errors import ConfigError
from ragtrain.tune.sweep import run_sweep
from tests.conftest import CONF_DIR, REPO, compose, tiny_overrides

GOOD_LR, BAD_LR = 1e-3, 1e3


def sweep_cfg(tmp: Path, uri: str, *extra: str, lrs: tuple = (GOOD_LR, BAD_LR), space: dict | None = None) -> Config:
    """A 2-trial sweep (good lr, absurd lr; sync drawn from ddp/local_sgd), 6 steps, a log window every 2, one
    trainer worker and one pool actor."""
    cfg = to_typed(
        compose(
            [
                "experiment=quickstart",
                *tiny_overrides(tmp),
                f"logger.tracking_uri={uri}",
                "logger.experiment_name=sweep-test",
                "tune=sync_sweep",
                "zeroshot_eval=false",
                "retriever.train.max_steps=6",
                "retriever.train.log_every=2",
                "tune.max_concurrent_trials=1",
                "tune.grace_period=2",
                "tune.seed=0",
                "resources.trainer.num_workers=1",
                "resources.pool.num_actors=1",  # fewer processes: 2 cores
                "export=false",
                *extra,  # a trial's export is tested with the shared quickstart run (tests/pipeline/test_export.py)
            ]
        )
    )
    # Set on the typed config: a Hydra override of tune.space would merge into conf/tune/sync_sweep.yaml's space.
    cfg.tune.space = {
        "sync": {"choice": ["ddp", "local_sgd"]},
        "retriever.train.lr": {"grid": list(lrs)},
        **(space or {}),
    }
    return cfg


@pytest.fixture(scope="module")
def server_sweep(ray_session, mlflow_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    cfg = sweep_cfg(tmp, mlflow_server)
    start = time.perf_counter()
    result = run_sweep(cfg, CONF_DIR)
    print(f"sweep: {time.perf_counter() - start:.1f}s")
    return cfg, result, mlflow_server, tmp


def _children(uri: str, parent: str) -> list:
    client = MlflowClient(uri)
    exp = client.get_experiment(client.get_run(parent).info.experiment_id)
    return client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'")


def test_parent_and_one_child_per_trial(server_sweep) -> None:
    cfg, result, uri, _ = server_sweep
    client = MlflowClient(uri)
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["ragtrain.role"] == "sweep"
    assert parent.data.params["tune.scheduler"] == "asha" and "tune.space.sync.choice" in parent.data.params
    children = _children(uri, result.parent_run_id)
    assert len(children) == len(result.trials) == 2
    trials = result.trials.set_index("trial_id")
    for run in children:
        tid = run.data.tags["ragtrain.tune.trial_id"]
        p, row = run.data.params, trials.loc[tid]
        # the trial's full resolved config as params, its sampled values included
        assert float(p["retriever.train.lr"]) == row["retriever.train.lr"]
        assert p["sync.strategy"] == row["sync"] == run.data.tags["ragtrain.sync"]
        assert p["sync.mixer.period"] == ("8" if row["sync"] == "local_sgd" else "None")  # local_sgd.yaml merged
        assert p["retriever.model"] == "tiny" and p["tune"] == "None"
        assert p["output_dir"].endswith(f"trials/{tid}")
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
        assert steps[0] == 2 and steps == sorted(steps)  # metrics over time, one point per log window


def test_asha_stops_the_absurd_lr_early(server_sweep) -> None:
    _, result, uri, _ = server_sweep
    trials = result.trials.set_index("retriever.train.lr")
    bad, good = trials.loc[BAD_LR], trials.loc[GOOD_LR]
    assert bool(bad["stopped_early"]) and bad["last_step"] < 6 and pd.isna(bad["trained/ndcg@10"])
    assert not bool(good["stopped_early"]) and good["last_step"] == 6 and 0 <= good["trained/ndcg@10"] <= 1
    runs = {r.data.tags["ragtrain.tune.trial_id"]: r for r in _children(uri, result.parent_run_id)}
    bad_run, good_run = runs[bad["trial_id"]], runs[good["trial_id"]]
    assert bad_run.info.status == "KILLED" and bad_run.data.tags["ragtrain.tune.stopped_early"] == "true"
    assert "trained/ndcg_at_10" not in bad_run.data.metrics
    assert good_run.info.status == "FINISHED"
    assert good_run.data.metrics["trained/ndcg_at_10"] == pytest.approx(good["trained/ndcg@10"])


def test_stopped_trial_leaves_no_placement_group(server_sweep) -> None:
    """ASHA's stop kills the trial actor, but its groups belong to the sweep's job: the sweep removes them."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table

    cfg, result, _, _ = server_sweep
    for trial_id in result.trials["trial_id"]:
        ids = set((Path(cfg.output_dir) / "trials" / trial_id / "placement_groups.txt").read_text().split())
        # Ray Train's worker group (indexes encode on Ray Data actors, which hold no placement group; the encoder
        # pool's group exists only with refresh.enabled)
        assert len(ids) >= 1, (trial_id, ids)
        states = {placement_group_table(PlacementGroup(PlacementGroupID(bytes.fromhex(i))))["state"] for i in ids}
        assert states == {"REMOVED"}, (trial_id, states)


def test_best_config_is_ready_to_run(server_sweep) -> None:
    cfg, result, uri, tmp = server_sweep
    assert result.best is not None and result.best["values"]["retriever.train.lr"] == GOOD_LR
    text = result.best_config.read_text()
    assert text.startswith("# @package _global_")
    best = to_typed(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(text)))
    assert best.retriever.train.lr == GOOD_LR and best.sync.strategy == result.best["values"]["sync"]
    assert best.tune is None and best.experiment_name == "quickstart_best"
    # Hydra takes it as an experiment: compose only (--cfg job), nothing runs.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ragtrain",
            "--config-dir",
            str(Path(cfg.output_dir) / "conf"),
            "experiment=best",
            "--cfg",
            "job",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    job = OmegaConf.create(proc.stdout)
    assert job.retriever.train.lr == GOOD_LR and job.experiment_name == "quickstart_best"
    client = MlflowClient(uri)
    parent = client.get_run(result.parent_run_id)
    assert parent.data.metrics["best/trained/ndcg@10".replace("@", "_at_")] == pytest.approx(result.best["metric"])
    arts = {a.path for a in client.list_artifacts(result.parent_run_id)}
    assert {"best_config.yaml", "trials.csv", "report"} <= arts
    report = {a.path for a in client.list_artifacts(result.parent_run_id, "report")}
    assert {"report/comparison.csv", "report/comparison.png", "report/learning_curves.png"} <= report


def test_report_matches_the_runs(server_sweep) -> None:
    cfg, result, uri, _ = server_sweep
    out = Path(cfg.output_dir) / "report"
    csv = pd.read_csv(out / "comparison.csv").set_index("run_id")
    client = MlflowClient(uri)
    assert len(csv) == 2
    for run_id, row in csv.iterrows():
        logged = client.get_run(run_id).data.metrics
        for key in ("trained/ndcg_at_10", "run/comm/bytes_per_step", "train/loss"):
            if key in logged:
                assert row[key] == pytest.approx(logged[key], nan_ok=True)  # a diverged loss is NaN in both
            else:
                assert pd.isna(row[key])  # the stopped trial never got its final evaluation
    for png in ("comparison.png", "learning_curves.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_resume_of_a_finished_sweep_repeats_nothing(server_sweep) -> None:
    cfg, result, uri, _ = server_sweep
    before = {r.info.run_id for r in _children(uri, result.parent_run_id)}
    again = run_sweep(to_typed(OmegaConf.merge(OmegaConf.structured(cfg), {"resume": True})), CONF_DIR)
    assert {r.info.run_id for r in _children(uri, result.parent_run_id)} == before
    assert again.parent_run_id == result.parent_run_id and not again.interrupted
    assert sorted(again.trials["trial_id"]) == sorted(result.trials["trial_id"])
    with pytest.raises(ConfigError, match="already holds a sweep: continue it with resume=true"):
        run_sweep(cfg, CONF_DIR)


def test_resume_without_a_sweep_fails(ray_session, tmp_path: Path) -> None:
    cfg = sweep_cfg(tmp_path, f"sqlite:///{tmp_path / 'm.db'}", "resume=true")
    with pytest.raises(ConfigError, match="holds no sweep to resume"):
        run_sweep(cfg, CONF_DIR)


def test_trial_bigger_than_the_cluster_fails_before_the_sweep(ray_session, tmp_path: Path) -> None:
    cfg = sweep_cfg(
        tmp_path, f"sqlite:///{tmp_path / 'm.db'}", space={"resources.trainer.num_workers": {"choice": [1, 64]}}
    )
    start = time.perf_counter()
    with pytest.raises(InfeasibleResourcesError, match=r"resources.trainer.num_workers at their maximum.*64 x"):
        run_sweep(cfg, CONF_DIR)
    assert time.perf_counter() - start < 30
    assert not (tmp_path / "out" / "tune").exists() and not (tmp_path / "m.db").exists()  # no parent run either


@pytest.mark.slow(
    reason="25 s quiet (51 s beside another job): a trial starts and is stopped; the guard is tested below"
)
def test_a_misspelled_asha_metric_stops_the_sweep_at_the_first_window(ray_session, tmp_path: Path) -> None:
    """Tune would let ASHA ignore a metric no result carries (early stopping silently off): the first training
    window stops the sweep with one line naming the key and what the window did report."""
    cfg = sweep_cfg(tmp_path, f"sqlite:///{tmp_path / 'm.db'}", "tune.asha_metric=train/los")
    with pytest.raises(
        ConfigError,
        match=r"tune.asha_metric='train/los' is not among a training window's metrics "
        r"\(trial \w+\): \[.*'train/loss'",
    ):
        run_sweep(cfg, CONF_DIR)
    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    parent = client.search_runs(
        [client.get_experiment_by_name("sweep-test").experiment_id], filter_string="tags.`ragtrain.role` = 'sweep'"
    )[0]
    assert parent.info.status == "FAILED"
    assert len(list((tmp_path / "out" / "trials").iterdir())) == 1  # the second trial never started


def test_the_guard_names_a_final_metric_no_trial_reports() -> None:
    from ragtrain.tune.guard import MetricGuard
    from ragtrain.tune.sweep import DONE_KEY

    guard = MetricGuard("trained/ndcg@11", None, DONE_KEY)
    assert not guard("t1", {"train/loss": 1.0, "step": 2}) and not guard.stop_all()  # windows: no ASHA metric to check
    assert guard("t1", {DONE_KEY: 1, "trained/ndcg@10": 0.5, "run/train/seconds": 3.0}) and guard.stop_all()
    assert guard.error == (
        "tune.metric='trained/ndcg@11' is not among its final metrics (trial t1): "
        "['run/train/seconds', 'trained/ndcg@10']"
    )
    ok = MetricGuard("trained/ndcg@10", "val/ndcg@10", DONE_KEY)
    assert not ok("t", {"train/loss": 1.0, "val/ndcg@10": 0.3}) and not ok("t", {DONE_KEY: 1, "trained/ndcg@10": 0.5})
    assert not ok.stop_all() and ok.error is None


def test_the_guard_a_resumed_sweep_restores_reports_through_its_file(tmp_path: Path) -> None:
    """Tune restores a pickled copy of the stopper on resume: the driver reads what that copy found from its file."""
    import pickle

    from ragtrain.tune.guard import MetricGuard, recorded_error
    from ragtrain.tune.sweep import DONE_KEY

    record = tmp_path / "guard.txt"
    restored = pickle.loads(pickle.dumps(MetricGuard("trained/ndcg@10", "val/ndcg@1O", DONE_KEY, record=str(record))))
    assert recorded_error(record) is None
    assert not restored("t", {"step": 1})  # no window yet: nothing to check
    assert restored("t", {"train/loss": 1.0, "val/ndcg@10": 0.3}) and restored.stop_all()
    assert recorded_error(record) == restored.error
    assert recorded_error(record).startswith("tune.asha_metric='val/ndcg@1O' is not among a training window's")


class InterruptOnce(Callback):
    """Tune callback: Ctrl+C (SIGINT to this process) when the first trial completes, once per marker file
    (a resumed sweep restores its callbacks too)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        if not self.marker.exists():
            self.marker.write_text(trial.trial_id)
            os.kill(os.getpid(), signal.SIGINT)  # Tune's handler: stop, save the experiment state


@pytest.mark.slow(
    reason="a sweep of its own, interrupted and resumed; resuming a finished sweep runs by default "
    "(test_resume_of_a_finished_sweep_repeats_nothing)"
)
def test_interrupted_sweep_resumes_without_repeating_finished_trials(ray_session, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = sweep_cfg(tmp_path, uri, "tune.scheduler=fifo", lrs=(0.001, 0.002))
    first = run_sweep(cfg, CONF_DIR, callbacks=[InterruptOnce(tmp_path / "interrupted")])
    assert first.interrupted
    done = (tmp_path / "interrupted").read_text()
    assert first.trials.set_index("trial_id").loc[done, "status"] == "TERMINATED"
    assert MlflowClient(uri).get_run(first.parent_run_id).info.status == "KILLED"

    second = run_sweep(to_typed(OmegaConf.merge(OmegaConf.structured(cfg), {"resume": True})), CONF_DIR)
    assert not second.interrupted and (second.trials["status"] == "TERMINATED").all() and len(second.trials) == 2
    runs = _children(uri, first.parent_run_id)
    per_trial: dict[str, list] = {}
    for r in runs:
        per_trial.setdefault(r.info.run_name.split("/", 1)[1].split(" ")[0], []).append(r)
    assert len(per_trial[done]) == 1  # the finished trial was not run again
    for tid, rs in per_trial.items():
        assert [r.info.status for r in rs].count("FINISHED") == 1, (tid, [r.info.status for r in rs])
        assert all(r.info.status in ("FINISHED", "KILLED") for r in rs)  # a cut-off attempt is closed, not RUNNING
    assert MlflowClient(uri).get_run(first.parent_run_id).info.status == "FINISHED"
