"""Batch composition: the seeded global order, rank slices, gold insertion and passage shuffling."""

from __future__ import annotations

import random

from ragtrain.generator.train import GenExample, Sampler, train_passages


def test_sampler_visits_every_example_once_per_epoch_and_is_seeded() -> None:
    s = Sampler(10, seed=3)
    first, second = [s(p) for p in range(10)], [s(p) for p in range(10, 20)]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    assert [Sampler(10, seed=3)(p) for p in range(20)] == first + second
    assert [Sampler(10, seed=4)(p) for p in range(10)] != first


def test_rank_slices_of_a_global_batch_are_the_single_worker_batch() -> None:
    """What makes N workers x b equal 1 worker x N*b: position p of step s is the same example for any world."""
    s = Sampler(7, seed=0)
    step, b = 2, 3
    one = [s(step * 2 * b + i) for i in range(2 * b)]  # 1 worker, batch 6
    two = [s(step * 2 * b + r * b + i) for r in range(2) for i in range(b)]  # ranks 0, 1 with batch 3
    assert one == two


def test_train_passages_gold_and_order() -> None:
    ex = GenExample("q1", "who?", ["x"], ["g"])
    assert train_passages(ex, ["a", "g", "b"], 3, True, False, random.Random(0)) == ["a", "g", "b"]
    assert train_passages(ex, ["a", "b", "c"], 3, True, False, random.Random(0)) == ["a", "b", "g"]  # replaces c
    assert train_passages(ex, ["a", "b", "c"], 3, False, False, random.Random(0)) == ["a", "b", "c"]
    shuffled = train_passages(ex, ["a", "b", "c", "d"], 3, True, True, random.Random(1))
    assert sorted(shuffled) == ["a", "b", "g"]
    assert shuffled == train_passages(ex, ["a", "b", "c", "d"], 3, True, True, random.Random(1))  # seeded
