"""Variant registries: for each family of variants, one dict from the name a config uses to the class behind it.

The config layer sits below the layers that implement variants (ragtrain/sync, ...) and imports none of them: the
CLI checks a whole config before torch is imported. So an entry names its class by import path and carries the
facts the config checks read (the keys the variant reads, what it combines with); `load` imports the class when
a worker builds it. tests/test_registries.py checks that every entry's path names a class of its family.
docs/adding-a-variant.md says, family by family, how to add one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """One registry entry: where the class lives ("package.module:Class")."""

    path: str

    def load(self) -> type:
        """The class (imports its module: torch and whatever else the variant needs)."""
        module, _, name = self.path.partition(":")
        return getattr(importlib.import_module(module), name)
