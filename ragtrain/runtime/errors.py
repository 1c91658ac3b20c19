"""The config error every typed config raises, and the one-line check that builds its message."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is out of range; the message names the key and what is allowed."""


def check(ok: bool, key: str, msg: str, value: Any) -> None:
    """Raise ConfigError("<key> <msg>, got <value>") unless `ok`."""
    if not ok:
        raise ConfigError(f"{key} {msg}, got {value!r}")


def filled(value: T | None, key: str) -> T:
    """A variant's key that the typed config filled with the variant's default (ragtrain/config/sync.py,
    `_kind_keys`): typed Optional in the schema, never None once a variant that reads it is built."""
    if value is None:
        raise ValueError(f"{key} is unset: the registry entry of the variant reading it must give its default")
    return value


def driver_path(path: str) -> str:
    """`path` made absolute against the driver's working folder: Ray workers, Ray Data tasks and Tune trials run
    in other folders (a trial in its own), so a relative path must not reach them as it was typed."""
    return os.path.abspath(os.path.expanduser(path))  # not resolve(): a symlink the user chose stays as typed


def local_model(name: str) -> str:
    """A model named by a local folder, made absolute (`driver_path`); a hub name or a ragtrain alias unchanged."""
    if name in ("minilm", "tiny", "smollm2"):  # ragtrain's aliases, even where a folder of that name sits in the cwd
        return name
    return driver_path(name) if name and Path(name).expanduser().exists() else name
