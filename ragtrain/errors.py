"""The config error every typed config raises, and the one-line check that builds its message."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value is out of range; the message names the key and what is allowed."""


def check(ok: bool, key: str, msg: str, value: Any) -> None:
    """Raise ConfigError("<key> <msg>, got <value>") unless `ok`."""
    if not ok:
        raise ConfigError(f"{key} {msg}, got {value!r}")
