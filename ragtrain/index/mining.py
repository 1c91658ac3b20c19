"""Hard-negative candidates from a ranking: the one rule that static mining and the live index both use."""

from __future__ import annotations

from typing import Container, Sequence, TypeVar

T = TypeVar("T")


def hard_negative_candidates(ranked: Sequence[T], gold: Container[T], skip_top: int) -> list[T]:
    """The ranking minus gold, minus the top `skip_top` of what remains.

    Gold is removed before counting the skipped ranks: the top non-gold passages are the likeliest false
    negatives (unjudged relevant passages), and that is what `hard_negative_skip_top` guards against. Counting a
    gold passage among them would keep, e.g. with gold at rank 1 and skip_top=1, the passage at rank 2.
    """
    return [d for d in ranked if d not in gold][skip_top:]
