"""The training loop's log window (ragtrain/retriever/train.py, LogWindow): the cumulative training seconds it logs
(train/seconds, the clock of a time to a target) and the time budget (retriever.train.max_train_seconds) it stops
every rank at; on a stand-in replica, then once through a real 2-worker fit."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mlflow.tracking import MlflowClient

from ragtrain.config import to_typed
from ragtrain.pipeline.stages import run
from ragtrain.retriever.train import LogWindow
from ragtrain.sync.comm import STATS
from tests.conftest import compose, tiny_overrides


class StandInWorker:
    """Window seconds as given, one after another; what is logged, kept."""

    def __init__(self, windows: list[float], world: int = 1) -> None:
        self.windows, self.world, self.rank, self.device = list(windows), world, 0, torch.device("cpu")
        self.logged: list[tuple[int, dict]] = []

    def window_seconds(self) -> float:
        return self.windows.pop(0)

    def log(self, metrics: dict, step: int, steps: int, report: bool = False) -> None:
        self.logged.append((step, metrics))

    @contextmanager
    def not_training(self) -> Iterator[None]:
        yield


def _replica(tmp_path: Path, windows: list[float], cap: float, world: int = 1) -> SimpleNamespace:
    cfg = to_typed(compose(tiny_overrides(tmp_path) + [f"retriever.train.max_train_seconds={cap}"]))
    return SimpleNamespace(
        cfg=cfg,
        w=StandInWorker(windows, world),
        global_batch=8,
        steps=100,
        val=None,
        sched=SimpleNamespace(get_last_lr=lambda: [1e-3]),
        strategy=SimpleNamespace(state=lambda: {}),
        distill=SimpleNamespace(window_metrics=lambda n: {}),
    )


def _window(r: SimpleNamespace, steps: int, loss: float = 1.0) -> LogWindow:
    window = LogWindow(r)  # type: ignore[arg-type]  # a stand-in with the attributes the window reads
    for _ in range(steps):
        window.add(loss)
    return window


def test_train_seconds_add_up_the_windows_and_the_budget_stops_at_the_window_that_reaches_it(tmp_path) -> None:
    STATS.reset()
    r = _replica(tmp_path, [2.0, 2.5, 1.5, 3.0], cap=6.0)
    window = LogWindow(r)  # type: ignore[arg-type]
    stops = []
    for done in (5, 10, 15, 20):
        for _ in range(5):
            window.add(1.0)
        window.log(done)
        stops.append(window.stop)
    seconds = [m["train/seconds"] for _, m in r.w.logged]
    assert seconds == [2.0, 4.5, 6.0, 9.0]  # cumulative: the clock a time to a target is read from
    assert stops == [False, False, True, True]  # 6.0 reaches the 6 s budget: that window is the last
    assert r.w.logged[0][1]["train/samples_per_s"] == pytest.approx(5 * 8 / 2.0)  # per window, as before


def test_without_a_budget_training_never_stops_early(tmp_path) -> None:
    STATS.reset()
    r = _replica(tmp_path, [1e6], cap=0)
    window = _window(r, 5)
    window.log(5)
    assert not window.stop and r.w.logged[0][1]["train/seconds"] == 1e6


def test_another_ranks_spent_budget_stops_this_rank_in_the_loss_collective(tmp_path, monkeypatch) -> None:
    """Every rank stops at the same window: the decision travels with the global loss, one all-reduce."""
    STATS.reset()
    calls = []

    def other_rank_spent(t: torch.Tensor) -> None:  # the sum with a rank whose loss is 3 and whose budget is spent
        calls.append(t.clone())
        t += torch.tensor([3.0, 1.0])

    monkeypatch.setattr(torch.distributed, "all_reduce", other_rank_spent)
    r = _replica(tmp_path, [1.0], cap=100.0, world=2)
    window = _window(r, 5, loss=1.0)
    window.log(5)
    assert len(calls) == 1 and calls[0].tolist() == [5.0, 0.0]  # this rank: its loss sum, budget not spent
    assert window.stop
    assert r.w.logged[0][1]["train/loss"] == pytest.approx((5.0 + 3.0) / 2 / 5)


@pytest.mark.integration
def test_a_fit_stops_at_its_time_budget_and_reports_the_step_it_stopped_at(ray_session, tmp_path) -> None:
    """A budget every window exceeds: 2 workers train to the first window (step 2 of 6), validate there, and the
    run's summary, the trained model's step and MLflow all say step 2."""
    overrides = [
        "experiment=quickstart",
        *tiny_overrides(tmp_path),
        "stages=[retriever]",
        "export=false",
        "zeroshot_eval=false",
        "retriever.train.max_steps=6",
        "retriever.train.log_every=2",
        "retriever.train.val_every=2",
        "retriever.train.max_train_seconds=1e-9",
        "logger.experiment_name=budget",
    ]
    cfg = to_typed(compose(overrides))
    results = run(cfg)
    assert results["train"]["steps"] == 2
    client = MlflowClient(cfg.logger.tracking_uri)
    exp = client.get_experiment_by_name("budget")
    run_id = client.search_runs([exp.experiment_id])[0].info.run_id
    assert [m.step for m in client.get_metric_history(run_id, "train/seconds")] == [2]
    assert [m.step for m in client.get_metric_history(run_id, "val/ndcg_at_10")] == [2]  # validated where it stopped
    seconds = client.get_metric_history(run_id, "train/seconds")[0].value
    assert 0 < seconds <= results["train"]["train/seconds"]  # the summary's clock covers the window's
