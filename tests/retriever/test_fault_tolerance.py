"""A worker killed mid-training restarts from its checkpoint; an interrupted run resumes; both equal a clean run.

Runs train only (stages=[retriever]): "equal" is checked on every step's loss and on the final weights, which is
stronger than comparing retrieval metrics and needs no index builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from ray.train import TrainingFailedError

from ragtrain.config import to_typed
from ragtrain.pipeline.stages import run
from ragtrain.track.mlflow import find_runs
from ragtrain.train.checkpoint import CheckpointError, latest_checkpoint, load_train_state, read_meta
from tests.conftest import compose, tiny_overrides

STEPS, EVERY, KILL_AT = 12, 4, 6


def _cfg(tmp: Path, name: str, *extra: str):
    overrides = [
        "experiment=quickstart",
        *tiny_overrides(tmp),
        f"output_dir={tmp / name}",
        "stages=[retriever]",
        "export=false",
        f"retriever.train.max_steps={STEPS}",
        "retriever.train.log_every=1",
        "retriever.train.lr=1e-3",
        "sync=local_sgd",
        "sync.mixer.period=3",  # per-replica state and a sync schedule that must survive the restart
        f"checkpoint.every_steps={EVERY}",
        f"logger.experiment_name={name}",
        *extra,
    ]
    return to_typed(compose(overrides))


def _assert_same_weights(cfg, other) -> None:
    """The saved encoders of two runs agree (float noise of a restart's reload only)."""
    from safetensors.torch import load_file

    a, b = (load_file(str(Path(c.output_dir) / "encoder" / "encoder.safetensors")) for c in (cfg, other))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


def _history(cfg, key: str = "train/loss", run_id: str | None = None) -> list[tuple[int, float]]:
    """The run's history of `key`: the one current run of the experiment (a run a resumed run took over is not)."""
    client = MlflowClient(cfg.logger.tracking_uri)
    if run_id is None:
        runs = find_runs(cfg.logger.tracking_uri, experiment=cfg.logger.experiment_name)
        assert len(runs) == 1, [r.run_name for r in runs]
        run_id = runs[0].run_id
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.fixture(scope="module")
def clean(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    cfg = _cfg(tmp, "clean")
    return cfg, run(cfg)


@pytest.mark.slow(
    reason="two training runs (~80 s); the async server's restart from a checkpoint stays in the default suite"
)
def test_killed_worker_restarts_from_checkpoint_and_matches_a_clean_run(clean, tmp_path) -> None:
    clean_cfg, clean_results = clean
    cfg = _cfg(tmp_path, "killed", "fault.max_failures=1", f"fault.kill_worker_at_step={KILL_AT}", "fault.kill_rank=1")
    results = run(cfg)
    assert (Path(cfg.output_dir) / "ray" / f".fault_injected_retriever_rank1_step{KILL_AT}").exists()  # it really died
    steps = [s for s, _ in _history(cfg)]
    assert steps == list(range(1, STEPS + 1))  # no gap, no repeat across the restart
    for (s, a), (_, b) in zip(_history(cfg), _history(clean_cfg)):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5), f"train/loss at step {s}"
    assert results["train"]["steps"] == clean_results["train"]["steps"] == STEPS
    _assert_same_weights(cfg, clean_cfg)


@pytest.mark.slow(reason="an end-to-end run of its own, beyond the default suite's budget (make test-slow)")
def test_interrupted_run_resumes_to_the_same_result(clean, tmp_path) -> None:
    clean_cfg, clean_results = clean
    cfg = _cfg(tmp_path, "resumed", f"fault.kill_worker_at_step={KILL_AT}", "fault.max_failures=0")
    with pytest.raises(TrainingFailedError):  # no restarts allowed: the run stops at the kill
        run(cfg)
    assert latest_checkpoint(Path(cfg.output_dir) / "ray" / "retriever") is not None
    resumed = _cfg(tmp_path, "resumed", f"fault.kill_worker_at_step={KILL_AT}", "resume=true")
    results = run(resumed)
    assert [s for s, _ in _history(resumed)] == list(range(1, STEPS + 1))
    assert results["train"]["steps"] == STEPS
    _assert_same_weights(resumed, clean_cfg)
    client = MlflowClient(resumed.logger.tracking_uri)
    run_id = (Path(resumed.output_dir) / "mlflow_run_id").read_text()
    assert client.get_run(run_id).info.status == "FINISHED"  # the same MLflow run, continued and closed


def test_corrupt_checkpoint_is_named(tmp_path) -> None:
    """A checkpoint written by the workers' own save_train_state, then truncated: the load names the folder."""
    from ragtrain.embed.model import build_encoder
    from ragtrain.train.checkpoint import save_train_state

    cfg = _cfg(tmp_path, "unit")
    enc = build_encoder(cfg.retriever)
    opt = torch.optim.AdamW(enc.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    good = tmp_path / "checkpoint_000001"
    good.mkdir()
    save_train_state(good, 0, 2, 4, enc, opt, sched, extra={"sync": {}}, info={"live_version": 3})
    assert load_train_state(good, 0, 2, enc, opt, sched)[0] == 4  # the intact one loads
    assert read_meta(good)["live_version"] == 3  # what a resumed run's live index numbers on from
    from ragtrain.retriever.train import checkpoint_weights

    got = checkpoint_weights(cfg, good)  # the weights a resumed run's live index starts from
    assert got.keys() == enc.state_dict().keys() and all(torch.equal(got[k], v) for k, v in enc.state_dict().items())
    weights = good / "rank0.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointError, match=f"checkpoint {good} is corrupt or incompatible"):
        load_train_state(good, 0, 2, enc, opt, sched)
    with pytest.raises(CheckpointError, match="written by 2 workers, this run has 3"):
        load_train_state(good, 0, 3, enc, opt, sched)


@pytest.mark.slow(reason="two runs with a live index (~170 s on 2 shared cores); the parts: test_live_client.py, below")
def test_a_resumed_run_continues_its_live_index_from_the_checkpoint(ray_session, tmp_path) -> None:
    """Stopped at step 5 (checkpoint at 4), then resume=true: the live index restarts from the checkpoint's encoder
    (not the untrained one: index/lag_steps counted from step 4) and numbers its versions on (index/version never
    repeats). The resumed MLflow run holds the stopped run's points up to step 4, then its own."""
    import json
    from dataclasses import replace

    over = [
        "retriever.train.max_steps=8",
        "checkpoint.every_steps=2",
        "resources.trainer.num_workers=1",
        "retriever.train.hard_negatives=1",
        "refresh.enabled=true",
        "refresh.every_steps=2",
        "refresh.check_every=1",
    ]
    cfg = _cfg(tmp_path, "live", *over, "fault.kill_worker_at_step=5", "fault.max_failures=0")
    with pytest.raises(TrainingFailedError):
        run(cfg)
    ckpt = latest_checkpoint(Path(cfg.output_dir) / "ray" / "retriever")
    meta = read_meta(ckpt)
    assert meta["step"] == 4 and meta["live_version"] >= 0
    stopped = (Path(cfg.output_dir) / "mlflow_run_id").read_text().strip()
    logged_before = _history(cfg, "index/version")
    resumed = replace(cfg, resume=True)  # the kill does not repeat: its marker is there (train/checkpoint.py)
    run(resumed)
    history = json.loads((Path(resumed.output_dir) / "refresh_history.json").read_text())["history"]
    # The resumed live index starts as version live_version + 1 (the checkpoint's weights, at its step 4);
    # refresh_history.json lists the rounds after it, so the first round is numbered on from there
    assert history[0]["version"] == meta["live_version"] + 2 and history[0]["step"] > 4, history[0]
    assert [h["version"] for h in history] == list(
        range(meta["live_version"] + 2, meta["live_version"] + 2 + len(history))
    )
    versions = _history(resumed, "index/version")
    assert [v for _, v in versions] == sorted(v for _, v in versions), versions  # numbers never go back
    assert [(s, v) for s, v in versions if s <= 4] == [(s, v) for s, v in logged_before if s <= 4], versions
    assert all(v > max((b for _, b in logged_before if s <= 4), default=-1) for s, v in versions if s > 4), versions
    lag = [(s, v) for s, v in _history(resumed, "index/lag_steps") if s > 4]  # logged by the resumed run
    assert lag and all(v <= s - 4 for s, v in lag), lag  # its live index is never older than the checkpoint
    loss = _history(resumed)  # the stopped run's steps up to the checkpoint, then the resumed run's own
    assert [s for s, _ in loss] == list(range(1, 9)), loss
    assert loss[:4] == _history(cfg, run_id=stopped)[:4]
    client = MlflowClient(cfg.logger.tracking_uri)
    new_id = (Path(cfg.output_dir) / "mlflow_run_id").read_text().strip()
    assert client.get_run(new_id).data.tags["ragtrain.resumed_from"] == stopped
    old_run = client.get_run(stopped)
    assert old_run.info.status == "KILLED" and old_run.data.tags["ragtrain.resumed_as"] == new_id
