"""Hard-negative candidates: gold removed first, then the top non-gold ranks skipped (the false-negative guard)."""

from __future__ import annotations

from ragtrain.index.mining import hard_negative_candidates


def test_skip_top_counts_non_gold_ranks_only() -> None:
    ranked = ["gold", "likely_false_negative", "b", "c", "d"]
    # gold at rank 1 and skip_top=1: the passage at rank 2, the likeliest false negative, is the one skipped
    assert hard_negative_candidates(ranked, {"gold"}, skip_top=1) == ["b", "c", "d"]
    assert hard_negative_candidates(ranked, {"gold"}, skip_top=0) == ["likely_false_negative", "b", "c", "d"]


def test_gold_anywhere_is_never_a_candidate() -> None:
    ranked = [7, 3, 9, 1, 4, 8]
    assert hard_negative_candidates(ranked, {3, 4}, skip_top=2) == [1, 8]
    assert hard_negative_candidates(ranked, set(), skip_top=6) == []
