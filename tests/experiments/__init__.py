"""Tests of the scripts in experiments/ (loaded by path: experiments/ is a folder of scripts, not a package)."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from tests.conftest import REPO


def script(name: str) -> ModuleType:
    """experiments/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
