"""Refresh priorities (`refresh.priority`): which rows a partial refresh round re-encodes first.

One class per value behind `RefreshPriority` (base.py). To add one: a module here with its class, and one line in
`PRIORITIES`; the config check lists these names as the valid choices.
"""

from __future__ import annotations

from ragtrain.index.priority.base import RefreshPriority
from ragtrain.index.priority.drift import Drift
from ragtrain.index.priority.hot import Hot
from ragtrain.index.priority.oldest import Oldest

PRIORITIES: dict[str, type[RefreshPriority]] = {
    "oldest": Oldest,
    "drift": Drift,
    "hot": Hot,
}
