"""A run folder belongs to one live process: a second run there is refused while the owner lives, taken over after."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ragtrain.config import to_typed
from ragtrain.runtime import run_lock
from ragtrain.runtime.errors import ConfigError
from tests.conftest import compose, tiny_overrides


def _cfg(tmp: Path, *extra: str):
    # a factory no 24-entity corpus can train: a run that gets past the folder's checks fails there, in seconds
    return to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp), "index.factory='IVF4096,Flat'", *extra]))


def _lock(folder: Path, pid: int, host: str | None = None, start: str | None = None) -> Path:
    path = folder / run_lock.LOCK_FILE
    owner = {
        "pid": pid,
        "host": host or socket.gethostname(),
        "process_start": run_lock.process_start(pid) if start is None else start,
        "started": "2026-01-01T00:00:00+0000",
        "token": "theirs",
    }
    path.write_text(json.dumps(owner))
    return path


@pytest.fixture
def live_pid():
    """A process that runs for the test's length (the other run's driver)."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _running_run(cfg, pid: int) -> tuple[Path, dict]:
    """The folder of a run started with `cfg` that is running (status.json, config.yaml, its lock)."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    (out / "status.json").write_text(json.dumps({"status": "running"}))
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "meta.json").write_text("{}")
    _lock(out, pid)
    return out, {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}


def _unchanged(out: Path, before: dict) -> None:
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("how", ["resume", "overwrite", "new"])
def test_a_run_into_the_folder_of_a_live_run_is_refused(tmp_path, live_pid, how: str) -> None:
    """resume=true into a running run's folder went on and destroyed that run; the refusal of a new run there
    suggested exactly that command (and overwrite=true, which destroys it too)."""
    from ragtrain.pipeline.stages import run

    cfg = _cfg(tmp_path)
    out, before = _running_run(cfg, live_pid)
    second = replace(cfg, resume=how == "resume", overwrite=how == "overwrite")
    with pytest.raises(ConfigError, match=r"belongs to a run that is still running \(pid \d+ on host") as e:
        run(second)
    assert f"pid {live_pid} on host {socket.gethostname()}" in str(e.value)
    assert "resume=true" not in str(e.value) and "overwrite=true" not in str(e.value)
    _unchanged(out, before)


def test_a_dead_owners_lock_is_taken_over(tmp_path) -> None:
    """The run was killed (SIGKILL, a crash): its lock names a pid that is gone; resume=true goes on."""
    from ragtrain.pipeline.stages import check_fresh_output, run

    cfg = _cfg(tmp_path)
    out, _ = _running_run(cfg, _dead_pid())
    with pytest.raises(ConfigError, match="holds a running run .* continue it with resume=true"):
        check_fresh_output(cfg)  # with no live owner, resume=true is the advice
    with pytest.raises(ConfigError, match="4096 IVF lists"):  # past the folder's checks, to the next one
        run(replace(cfg, resume=True))
    assert not (out / run_lock.LOCK_FILE).exists()  # the failed attempt let go of the folder


def test_a_reused_pid_is_not_the_owner(tmp_path, live_pid) -> None:
    """The pid is alive but belongs to a process started after the lock's owner (a pid reused after a reboot)."""
    if not run_lock.process_start(live_pid):
        pytest.skip("no /proc: the start time of a process is not known here")
    _lock(tmp_path, live_pid, start="1")
    lock = run_lock.acquire(tmp_path)
    assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    lock.release()
    assert not lock.path.exists()


def test_a_lock_from_another_host_counts_until_its_heartbeat_is_stale(tmp_path) -> None:
    path = _lock(tmp_path, 1, host="another-host.example")
    with pytest.raises(ConfigError, match=r"pid 1 on host another-host.example.*counts as stopped after 600s"):
        run_lock.acquire(tmp_path)
    old = time.time() - run_lock.STALE_AFTER_S - 5
    os.utime(path, (old, old))
    lock = run_lock.acquire(tmp_path)
    assert json.loads(path.read_text())["host"] == socket.gethostname()
    lock.release()


def test_release_never_removes_another_owners_lock(tmp_path, live_pid) -> None:
    lock = run_lock.acquire(tmp_path)
    _lock(tmp_path, live_pid)  # taken over meanwhile (e.g. after a heartbeat gap)
    lock.release()
    assert json.loads(lock.path.read_text())["pid"] == live_pid


def test_a_finished_run_leaves_no_lock(quickstart_run) -> None:
    cfg, _, _ = quickstart_run
    assert json.loads((Path(cfg.output_dir) / "status.json").read_text())["status"] == "complete"
    assert not (Path(cfg.output_dir) / run_lock.LOCK_FILE).exists()


def test_cli_resume_into_a_live_runs_folder_is_one_line_and_exit_2(tmp_path, live_pid) -> None:
    import sys

    from tests.conftest import REPO

    cfg = _cfg(tmp_path)
    out, before = _running_run(cfg, live_pid)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    args = [sys.executable, "-m", "ragtrain", "experiment=quickstart", *tiny_overrides(tmp_path), "resume=true"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        f"config error: output_dir={str(out)!r} belongs to a run that is still running (pid {live_pid} on host "
        f"{socket.gethostname()}, started 2026-01-01T00:00:00+0000; {out / run_lock.LOCK_FILE}): wait for it to "
        "finish or stop it, or choose another output_dir"
    ]
    _unchanged(out, before)
