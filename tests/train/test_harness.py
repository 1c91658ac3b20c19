"""The training harness's pure parts: step counting shared by both recipes, and typed worker arguments."""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path

import pytest

from ragtrain.config import to_typed
from ragtrain.retriever.train import RetrieverInputs
from ragtrain.train.harness import WorkerArgs, storage_dir, total_steps
from tests.conftest import compose, tiny_overrides


def test_max_steps_wins() -> None:
    assert total_steps(7, 3.0, 10, 4) == 7


@pytest.mark.parametrize(
    "epochs,n,batch,expected",
    [
        (1.0, 10, 4, 2),  # 2 full batches; the last partial one (2 examples) is dropped
        (1.5, 10, 4, 3),  # 1.5 x 2 = 3
        (0.4, 10, 4, 1),  # rounded up: never 0 steps
        (2.0, 8, 4, 4),
    ],
)
def test_epochs_count_full_global_batches(epochs: float, n: int, batch: int, expected: int) -> None:
    assert total_steps(0, epochs, n, batch) == expected


def test_too_small_data_names_the_batch() -> None:
    with pytest.raises(ValueError, match="global batch of 8"):
        total_steps(0, 1.0, 5, 8)


def test_worker_args_are_typed_and_picklable(tmp_path) -> None:
    """Workers get the resolved, typed Config (no Hydra node, no interpolation left) through pickling."""
    cfg = to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp_path)]))
    args = WorkerArgs(cfg, "retriever", cpus_per_worker=1.0, inputs=RetrieverInputs(data=None, weights=None))
    back = pickle.loads(pickle.dumps(args))
    assert back.cfg == cfg and type(back.cfg).__name__ == "Config"
    assert back.fit_id == args.fit_id and len(args.fit_id) == 32
    assert WorkerArgs(cfg, "retriever", 1.0).fit_id != args.fit_id  # one id per fit
    assert back.storage() == storage_dir(cfg, "retriever") == tmp_path / "out" / "ray" / "retriever"


def test_rank0_bar_follows_the_steps_and_step_lines_go_to_the_run_log_only(tmp_path, capsys, monkeypatch) -> None:
    """Quiet console on a terminal: rank 0's bar (Ray's tqdm_ray; in a driver process it draws itself) starts at a
    restarted
    attempt's first step and closes at the last; the step line is in ragtrain.log, not on stdout."""
    from ragtrain.runtime.console import attach_run_log, detach_run_log
    from ragtrain.train.harness import Worker

    monkeypatch.setenv("RAGTRAIN_QUIET", "1")
    monkeypatch.setenv("RAGTRAIN_PROGRESS", "1")  # console.configure: the quiet console on a terminal
    cfg = to_typed(compose(tiny_overrides(tmp_path)))
    w = object.__new__(Worker)  # the step-end and log parts only: no Ray Train context needed
    w.rank, w.stage, w.cfg, w.sink, w._bar, w.measure_s = 0, "retriever", cfg, None, None, 0.0
    w.args = WorkerArgs(cfg=cfg, stage="retriever", cpus_per_worker=1.0)
    w._window_start = 0.0
    handler = attach_run_log(tmp_path, who="retriever rank 0")
    try:
        w.end_step(3, 6)  # a restart from the step-2 checkpoint: the first step it runs is the third
        assert w._bar.n == 3 and w._bar.total == 6
        w.log({"train/loss": 0.25}, 4, 6)
        for done in (4, 5, 6):
            w.end_step(done, 6)
    finally:
        detach_run_log(handler)
    assert w._bar.n == 6 and w._bar._closed
    out = capsys.readouterr()
    assert "step 4/6" not in out.out
    assert "[retriever] step 4/6 train/loss=0.25" in (tmp_path / "ragtrain.log").read_text()
    assert "[retriever] loss 0.2500" in out.err  # the bar's description carries the last window's loss


def test_without_a_terminal_the_step_lines_print_and_no_bar_is_drawn(tmp_path, capsys, monkeypatch) -> None:
    """The quiet console writing to a file or pipe (RAGTRAIN_PROGRESS=0): a bar would be one line per redraw."""
    from ragtrain.train.harness import Worker

    monkeypatch.setenv("RAGTRAIN_QUIET", "1")
    monkeypatch.setenv("RAGTRAIN_PROGRESS", "0")
    cfg = to_typed(compose(tiny_overrides(tmp_path)))
    w = object.__new__(Worker)
    w.rank, w.stage, w.cfg, w.sink, w._bar, w.measure_s, w._window_start = 0, "retriever", cfg, None, None, 0.0, 0.0
    w.args = WorkerArgs(cfg=cfg, stage="retriever", cpus_per_worker=1.0)
    w.end_step(1, 2)
    w.log({"train/loss": 0.5}, 2, 2)
    w.end_step(2, 2)
    out = capsys.readouterr()
    assert w._bar is None and "training" not in out.err
    assert "[retriever] step 2/2 train/loss=0.5" in out.out


def _loop_that_fails(args) -> None:
    """A training loop that notes where its process group's rendezvous file is, then fails (a crash mid-fit)."""
    import os
    from pathlib import Path

    out = Path(args.cfg.output_dir)
    stores = sorted(str(p) for p in (out.parent / "tmp").glob("ragtrain-pg-*/*"))
    (out / f"stores-{os.getpid()}.txt").write_text("\n".join(stores))
    raise RuntimeError("this fit fails on purpose")


def test_a_fit_removes_its_rendezvous_files_also_when_it_fails(ray_session, tmp_path, monkeypatch) -> None:
    """Two gloo workers on a local Ray rendezvous through a FileStore; `ragtrain-pg-*` files were left in the temp
    folder after runs. The fit's files now live in a folder of its own, removed when the fit ends, failed or not."""
    import tempfile

    from ragtrain.train.harness import fit

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the driver's temp folder
    cfg = to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp_path), "resources.trainer.num_workers=2"]))
    (tmp_path / "out").mkdir()
    with pytest.raises(Exception, match="this fit fails on purpose"):
        fit(_loop_that_fails, WorkerArgs(cfg, "retriever", cpus_per_worker=1.0), num_workers=2)
    seen = [p.read_text() for p in sorted((tmp_path / "out").glob("stores-*.txt"))]
    assert len(seen) == 2 and all(s.strip() for s in seen), seen  # each rank saw its group's file in the run's folder
    assert list((tmp_path / "tmp").glob("ragtrain-pg-*")) == []


def _loop_that_is_interrupted(args) -> None:
    out = Path(args.cfg.output_dir)
    os.kill(int((out / "driver.pid").read_text()), signal.SIGINT)  # Ctrl+C at the driver, as a user presses it
    time.sleep(120)  # the controller aborts the group long before


def test_ctrl_c_during_a_fit_is_a_keyboard_interrupt_and_the_drivers_handler_comes_back(ray_session, tmp_path) -> None:
    """Ray Train's fit answers Ctrl+C by aborting its controller and exiting through sys.exit, and leaves its own
    SIGINT handler behind: the run ended as a bare SystemExit. It ends as KeyboardInterrupt with the resume hint
    (the CLI then exits 130), and the driver's handler is back."""
    from ragtrain.train.harness import fit

    before = signal.getsignal(signal.SIGINT)
    cfg = to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp_path), "resources.trainer.num_workers=1"]))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "driver.pid").write_text(str(os.getpid()))
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match=r"interrupted \(Ctrl\+C\).*resume=true"):
        fit(_loop_that_is_interrupted, WorkerArgs(cfg, "retriever", cpus_per_worker=1.0), num_workers=1)
    assert time.monotonic() - start < 100  # aborted, not waited out
    assert signal.getsignal(signal.SIGINT) is before
