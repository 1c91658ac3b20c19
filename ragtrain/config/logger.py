"""The `logger:` group (conf/logger/*.yaml): the MLflow store, and the tracking server's credentials kept out of
the config."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from urllib.parse import unquote, urlsplit, urlunsplit

from ragtrain.runtime.errors import check as _check


class LoggerBackend(str, Enum):
    mlflow = "mlflow"
    none = "none"


@dataclass
class LoggerConfig:
    backend: LoggerBackend = LoggerBackend.mlflow
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlruns/mlflow.db
    experiment_name: str = "ragtrain"
    run_name: str | None = None
    register_as: str | None = None  # register the exported retriever in the MLflow Model Registry under this name

    def __post_init__(self) -> None:
        _check(
            not self.register_as or LoggerBackend(self.backend) == LoggerBackend.mlflow,
            "logger.register_as",
            "needs logger=mlflow (the Model Registry lives in the MLflow store)",
            self.register_as,
        )
        if self.tracking_uri:
            self.tracking_uri = take_credentials(self.tracking_uri)


# MLflow's own settings for an HTTP server's basic auth: every MLflow client reads them from the environment
AUTH_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


def auth_env() -> dict[str, str]:
    """The tracking server's basic-auth variables of this process, for the Ray workers that log to MLflow."""
    return {k: os.environ[k] for k in AUTH_ENV if k in os.environ}


def take_credentials(uri: str) -> str:
    """The tracking URI without its user:password@ part, which moves into MLflow's basic-auth environment variables
    (AUTH_ENV) of this process and the Ray workers it starts: the config, and every file, parameter and log line made
    from it, then never holds the password. Only an http(s) server takes them so; a database URI with a password
    is refused (its client reads the password from the environment instead, e.g. PGPASSWORD)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    userinfo, host = parts.netloc.rsplit("@", 1)
    _check(
        parts.scheme in ("http", "https"),
        "logger.tracking_uri",
        f"holds credentials for a {parts.scheme} "
        "store, which would be written into config.yaml and MLflow's params: put them in the environment "
        "(e.g. PGPASSWORD for postgresql) and remove them from the URI",
        f"{parts.scheme}://***@{host}",
    )
    user, _, password = userinfo.partition(":")
    os.environ[AUTH_ENV[0]], os.environ[AUTH_ENV[1]] = unquote(user), unquote(password)
    return urlunsplit(parts._replace(netloc=host))
