"""Consistency policies (`refresh.consistency`): when a refresh round's new rows become searchable.

One class per value behind `ConsistencyPolicy` (base.py). To add one: a module here with its class, and one line
in `POLICIES`; the config check lists these names as the valid choices.
"""

from __future__ import annotations

from ragtrain.index.consistency.aligned import Aligned
from ragtrain.index.consistency.base import ConsistencyPolicy
from ragtrain.index.consistency.eager import Eager
from ragtrain.index.consistency.global_ import Global

POLICIES: dict[str, type[ConsistencyPolicy]] = {
    "global": Global,
    "eager": Eager,
    "aligned": Aligned,
}
