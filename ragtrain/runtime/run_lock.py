"""A run folder belongs to one live process: `<output_dir>/.ragtrain.lock` names it (pid, host, start time).

A second run into the folder (a new one, overwrite=true or resume=true) is refused while the owner lives: on the same
host, while its pid is alive (and is the same process: the pid's start time is recorded where the system says it);
on another host, where its pid cannot be asked, while the owner's heartbeat (the lock file's mtime, renewed every
HEARTBEAT_S seconds) is younger than STALE_AFTER_S. A lock whose owner is gone (a crash, SIGKILL, a reboot) is
taken over.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ragtrain.runtime.console import get_logger
from ragtrain.runtime.errors import ConfigError

log = get_logger(__name__)

LOCK_FILE = ".ragtrain.lock"
HEARTBEAT_S = 30.0  # the owner renews the lock file's mtime this often
STALE_AFTER_S = 600.0  # a lock from another host with no heartbeat for this long is taken to be dead


def process_start(pid: int) -> str:
    """The process's start time as the system records it (Linux: clock ticks since boot, field 22 of
    /proc/<pid>/stat), so a pid reused by another process is not taken for the owner; "" where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[19]  # after the command name, which may hold spaces and ')'


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_alive(owner: dict[str, Any], lock_age_s: float) -> bool:
    """Whether the process a lock names still runs (see the module's docstring for the rule)."""
    if owner.get("host") != socket.gethostname():
        return lock_age_s < STALE_AFTER_S
    pid = int(owner.get("pid", -1))
    if pid <= 0 or not pid_alive(pid):
        return False
    recorded = owner.get("process_start", "")
    return not recorded or recorded == process_start(pid)


def read_owner(path: Path) -> tuple[dict[str, Any], float] | None:
    """The lock's owner and the seconds since its last heartbeat; None when there is no lock. An unreadable lock
    (a crash while it was written) names no one."""
    try:
        text, age = path.read_text(), time.time() - path.stat().st_mtime
    except (FileNotFoundError, NotADirectoryError):  # no lock; or no folder yet (prepare_output_dir says why)
        return None
    try:
        owner = json.loads(text)
    except ValueError:
        owner = {}
    return (owner if isinstance(owner, dict) else {}), age


def describe(owner: dict[str, Any]) -> str:
    return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, started {owner.get('started', '?')}"


def check_owner(folder: str | Path) -> None:
    """Raise ConfigError if a live process owns `folder`; the message suggests nothing that would touch it."""
    path = Path(folder) / LOCK_FILE
    found = read_owner(path)
    if found is None:
        return
    owner, age = found
    if owner_alive(owner, age):
        other_host = owner.get("host") != socket.gethostname()
        bound = (
            f" (its heartbeat is {age:.0f}s old; it counts as stopped after {STALE_AFTER_S:.0f}s)" if other_host else ""
        )
        raise ConfigError(
            f"output_dir={str(folder)!r} belongs to a run that is still running ({describe(owner)}{bound}; "
            f"{path}): wait for it to finish or stop it, or choose another output_dir"
        )


@dataclass
class RunLock:
    """This process's hold on a run folder: the heartbeat renews it, `release` removes it."""

    path: Path
    token: str
    _stop: threading.Event = field(default_factory=threading.Event)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):  # the folder may be gone (a test's tmp); the lock then means nothing
                os.utime(self.path)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this process's (never another's)."""
        self._stop.set()
        found = read_owner(self.path)
        if found is not None and found[0].get("token") == self.token:
            self.path.unlink(missing_ok=True)


def acquire(folder: str | Path) -> RunLock:
    """Take `folder` (which exists) for this process: refused (ConfigError) while another live process owns it; a
    dead owner's lock is taken over. Two runs started at once: the folder's flock makes one look after the other."""
    path = Path(folder) / LOCK_FILE
    token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
    owner = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "process_start": process_start(os.getpid()),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "token": token,
    }
    folder_fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(folder_fd, fcntl.LOCK_EX)  # held until the lock file is written; released by close
        check_owner(folder)
        stale = read_owner(path)
        if stale is not None:
            log.warning(
                f"[run] {folder}: taking over the lock of a run that is no longer running ({describe(stale[0])})"
            )
        tmp = path.with_name(f"{LOCK_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(owner))
        tmp.replace(path)
    finally:
        os.close(folder_fd)
    lock = RunLock(path, token)
    threading.Thread(target=lock._beat, name="ragtrain-run-lock", daemon=True).start()
    return lock
