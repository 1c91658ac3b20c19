"""Batches are deterministic and the same global batch (and negatives) whatever the worker count."""

from __future__ import annotations

import pytest

from ragtrain.retriever.batching import TrainData, build_examples, global_batch_indices, local_batch, steps_per_epoch


def _data(n: int = 40) -> TrainData:
    queries = {f"q{i}": f"question {i}" for i in range(n)}
    qrels = {f"q{i}": {f"d{i}": 1, **({f"d{i + 1}": 2} if i % 7 == 0 else {})} for i in range(n)}
    pos = {f"d{i}": i for i in range(n + 1)}
    negatives = {f"q{i}": [j for j in range(n + 1) if j not in (i, i + 1)][:10] for i in range(n)}
    return TrainData([f"passage {i}" for i in range(n + 1)], build_examples(queries, qrels, pos, negatives))


@pytest.mark.parametrize("step", [0, 3, 7])
def test_two_ranks_concatenate_to_one(step: int) -> None:
    data = _data()
    one = local_batch(data, 8, step, seed=1, rank=0, world_size=1, num_negatives=2)
    parts = [local_batch(data, 8, step, seed=1, rank=r, world_size=2, num_negatives=2) for r in range(2)]
    assert parts[0][0] + parts[1][0] == one[0]  # queries
    assert parts[0][2] + parts[1][2] == one[2]  # golds
    # passages: each rank sends [its positives, its negatives]; together the same multiset in a known order
    b = 4
    pos = [p for q, ps, g in parts for p in ps[:b]]
    neg = [p for q, ps, g in parts for p in ps[b:]]
    assert pos == one[1][: 2 * b] and neg == one[1][2 * b :]


def test_negatives_never_gold() -> None:
    data = _data()
    for step in range(steps_per_epoch(len(data.examples), 8) * 2):
        _, pids, golds = local_batch(data, 8, step, seed=0, rank=0, world_size=1, num_negatives=3)
        negs = pids[8:]
        for i, g in enumerate(golds):
            assert not set(negs[i * 3 : (i + 1) * 3]) & set(g)


def test_epochs_cover_every_example_once() -> None:
    data = _data()
    spe = steps_per_epoch(len(data.examples), 5)
    seen = [int(i) for s in range(spe) for i in global_batch_indices(len(data.examples), 5, s, 0)]
    assert len(seen) == len(set(seen)) == spe * 5
    assert list(global_batch_indices(len(data.examples), 5, spe, 0)) != seen[:5]  # a new permutation per epoch


def test_too_few_examples_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        steps_per_epoch(3, 8)


def test_multiple_gold_gives_one_example_per_pair() -> None:
    data = _data()
    assert len(data.examples) == 40 + len([i for i in range(40) if i % 7 == 0])
