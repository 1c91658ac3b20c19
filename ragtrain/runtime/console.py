"""The console: ragtrain's own lines (one per phase, the summary table), not the libraries' chatter.

Without -v (`hydra.verbose=true` or HYDRA_FULL_ERROR=1): Hugging Face progress bars and load reports, FAISS's
loader INFO lines, Ray Data's per-10-second progress logs (when stdout is not a terminal) and Ray Train's
per-report INFO lines are turned down, in the driver and, through the environment `init_ray` passes on, in every
Ray worker and actor. Warnings and errors always show; Hydra still writes the run's log file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

# Environment for the driver and every Ray process (forwarded by ragtrain.cluster.resources.init_ray)
QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "MLFLOW_LOGGING_LEVEL": "WARNING",
    "RAGTRAIN_QUIET": "1",
}
PG_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
QUIET_LOGGERS = ("faiss", "ray.data", "ray.train", "ray.tune", "mlflow", "transformers", "sentence_transformers")


# "1": training stages draw a progress bar (rank 0, Ray's tqdm_ray, drawn by the driver) instead of printing their
# step lines. Only when the quiet console writes to a terminal: in a log file a bar is one line per redraw.
PROGRESS_ENV = "RAGTRAIN_PROGRESS"


def configure(verbose: bool) -> None:
    """Quiet the libraries unless `verbose`; call before they are imported (the environment is read at import).
    Ray Data's own settings wait for `quiet_ray_data`, called once the config has passed its checks: importing
    Ray Data costs about a second of CPU, which a command refused at its checks need not pay."""
    if not sys.stdout.isatty():  # Ray colours its worker-line prefixes: escape codes in a log file or a pipe
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if verbose:
        get_logger("ragtrain").setLevel(logging.DEBUG)
        return
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault(PROGRESS_ENV, "1" if sys.stdout.isatty() else "0")
    quiet_loggers()


def quiet_ray_data() -> None:
    """Under the quiet console (`configure`), before any work: Ray Data's progress output, and the library loggers
    turned down again, as Ray Data sets its loggers' levels when it is imported."""
    if not is_quiet():
        return
    from ray.data import DataContext  # lazy: Ray Data's import is ~1 s, and a refused config never needs it

    # On a terminal Ray Data draws one live bar per pipeline; in a log file it writes a status block every 10 s,
    # which was most of a run's output
    DataContext.get_current().enable_progress_bars = sys.stdout.isatty()
    quiet_loggers()


class _DropTokenAuthEnabled(logging.Filter):
    """Drops Ray's "Token authentication is enabled for this Ray cluster" note, nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def quiet_cli() -> None:
    """The helper commands (search, compare, paired): the same quiet libraries as a run, before they are imported,
    unless HYDRA_FULL_ERROR=1 asks for everything."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    quiet_loggers()


def quiet_loggers() -> None:
    """Library loggers to WARNING: in the driver (configure) and in Ray workers when RAGTRAIN_QUIET=1."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    # ray[default] is an opt-in extra (docs/data.md, "Ray's dashboard: an opt-in extra"): without the
    # State API, Ray Train's placement-group cleaner warns at every check that it cannot see its controller
    logging.getLogger(PG_CLEANER_LOGGER).setLevel(logging.ERROR)
    # Ray >= 2.59 turns token authentication on for every new local cluster and says so at each start: that note
    # (only it: the warning that authentication is *disabled* stays) is dropped
    auth = logging.getLogger(AUTH_LOGGER)
    if not any(isinstance(f, _DropTokenAuthEnabled) for f in auth.filters):
        auth.addFilter(_DropTokenAuthEnabled())
    # configure() turns Ray Data's bars off when stdout is not a terminal; Ray Data then warns that they are off
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    # A small corpus makes fewer blocks than the pool has actors (or the chunk step has tasks), and Ray Data warns
    # at every such pipeline that the rest stay idle: nothing a user has to act on
    warnings.filterwarnings(
        "ignore", message=r"The (minimum|maximum) number of concurrent (actors|tasks) for", category=UserWarning
    )
    # Ray Train's worker context logs every report (a TrainingReport dump) under a logger named by its file path.
    # Only where Train has loaded it (its workers; an encode actor need not import Ray Train for this), and an
    # internal module: where a Ray version moves it, those lines simply stay.
    context = sys.modules.get("ray.train.v2._internal.execution.context")
    if context is not None and hasattr(context, "logger"):
        context.logger.setLevel(logging.WARNING)


def worker_setup() -> None:
    """In every Ray worker process of a run (runtime_env's worker_process_setup_hook, cluster/resources.init_ray)
    and in Train workers and encode actors: the same quiet loggers when the driver asked for them."""
    if is_quiet():
        quiet_loggers()
    # Ray's State API (Ray Train's placement-group cleaner asks it about its controller) finds its cluster by
    # searching the machine when given no address; with a second Ray on the machine (another run) that search
    # raises in the cleaner's thread and prints a traceback. This worker knows its own cluster: say which.
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    # Workers only: the driver also calls this (an in-process encoder) and may start another Ray later
    if (
        ray.is_initialized()
        and ray.get_runtime_context().worker.mode == ray.WORKER_MODE
        and "RAY_API_SERVER_ADDRESS" not in os.environ
    ):
        os.environ["RAY_API_SERVER_ADDRESS"] = ray.get_runtime_context().gcs_address


def is_quiet() -> bool:
    """Whether this process runs under ragtrain's quiet console (set by `configure`, inherited by Ray processes)."""
    return os.environ.get("RAGTRAIN_QUIET") == "1"


def quiet_env() -> dict[str, str]:
    """The console settings of this process, for a Ray process's runtime_env (empty under -v)."""
    return {k: os.environ[k] for k in (*QUIET_ENV, PROGRESS_ENV) if k in os.environ}


def progress_bars() -> bool:
    """Whether training draws progress bars instead of step lines (`configure`: the quiet console on a terminal)."""
    return os.environ.get(PROGRESS_ENV) == "1"


# `log.info(line, extra=FILE_ONLY)`: the line goes to the run's ragtrain.log, not to the console (a progress bar
# shows the same thing there)
FILE_ONLY = {"console": False}


class _Stdout(logging.StreamHandler):
    """A handler on whatever sys.stdout is now (pytest and Ray swap it), printing the bare message."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))
        self.addFilter(lambda record: getattr(record, "console", True))

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:
        pass


def get_logger(name: str) -> logging.Logger:
    """ragtrain's logger for a module: INFO lines print as plain lines on stdout (as `print` did), DEBUG with -v;
    `attach_run_log` also writes them, timestamped, into the run's folder."""
    root = logging.getLogger("ragtrain")
    if not any(isinstance(h, _Stdout) for h in root.handlers):
        root.addHandler(_Stdout())
        root.setLevel(logging.INFO)
        root.propagate = False  # Hydra's root handler would print every line a second time, prefixed
    return logging.getLogger(name)


def attach_run_log(out_dir, who: str = "driver", name: str = "ragtrain.log") -> logging.Handler:
    """Append this process's ragtrain log lines to <out_dir>/<name> (`who`: the driver, or a stage's rank 0);
    detach the returned handler at the end."""
    get_logger("ragtrain")
    handler = logging.FileHandler(Path(out_dir) / name, encoding="utf-8")
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{who}] %(name)s: %(message)s"))
    logging.getLogger("ragtrain").addHandler(handler)
    return handler


class _Collect(logging.Handler):
    """Keeps the records it is given (the lines of the checks, before the run's log file may be written)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def collect_log_lines() -> Iterator[list[logging.LogRecord]]:
    """Collect ragtrain's log records while the block runs (the run's checks: its log file is only written once
    they have passed), to be replayed into the file with `replay`."""
    handler = _Collect()
    get_logger("ragtrain")
    logging.getLogger("ragtrain").addHandler(handler)
    try:
        yield handler.records
    finally:
        logging.getLogger("ragtrain").removeHandler(handler)


def replay(records: list[logging.LogRecord], handler: logging.Handler) -> None:
    """Write collected records through `handler`, with their own times."""
    for record in records:
        if record.levelno >= handler.level:
            handler.handle(record)


def detach_run_log(handler: logging.Handler) -> None:
    """Stop writing the run's log file (the end of `pipeline.run`)."""
    logging.getLogger("ragtrain").removeHandler(handler)
    handler.close()
