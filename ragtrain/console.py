"""The console: ragtrain's own lines (one per phase, the summary table), not the libraries' chatter.

Without -v (`hydra.verbose=true` or HYDRA_FULL_ERROR=1): Hugging Face progress bars and load reports, FAISS's
loader INFO lines, Ray Data's per-10-second progress logs (when stdout is not a terminal) and Ray Train's
per-report INFO lines are turned down, in the driver and, through the environment `init_ray` passes on, in every
Ray worker and actor. Warnings and errors always show; Hydra still writes the run's log file.
"""

from __future__ import annotations

import logging
import os
import sys

# Environment for the driver and every Ray process (forwarded by ragtrain.cluster.resources.init_ray)
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error", "MLFLOW_LOGGING_LEVEL": "WARNING",
             "RAGTRAIN_QUIET": "1"}
QUIET_LOGGERS = ("faiss", "ray.data", "ray.train", "ray.tune", "mlflow", "transformers", "sentence_transformers")


def configure(verbose: bool) -> None:
    """Quiet the libraries unless `verbose`; call before they are imported (the environment is read at import)."""
    if verbose:
        return
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    from ray.data import DataContext  # imported first: Ray Data sets its loggers' levels when it is imported

    # On a terminal Ray Data draws one live bar per pipeline; in a log file it writes a status block every 10 s,
    # which was most of a run's output
    DataContext.get_current().enable_progress_bars = sys.stdout.isatty()
    quiet_loggers()


def quiet_loggers() -> None:
    """Library loggers to WARNING: in the driver (configure) and in Ray workers when RAGTRAIN_QUIET=1."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    # Ray Train's worker context logs every report (a TrainingReport dump) under a logger named by its file path
    from ray.train.v2._internal.execution import context

    context.logger.setLevel(logging.WARNING)


def worker_setup() -> None:
    """In a Ray Train worker or actor: the same quiet loggers when the driver asked for them."""
    if os.environ.get("RAGTRAIN_QUIET") == "1":
        quiet_loggers()


def quiet_env() -> dict[str, str]:
    """The console settings of this process, for a Ray process's runtime_env (empty under -v)."""
    return {k: os.environ[k] for k in QUIET_ENV if k in os.environ}
