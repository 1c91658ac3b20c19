"""The training harness's pure parts: step counting shared by both recipes, and typed worker arguments."""

from __future__ import annotations

import pickle

import pytest

from ragtrain.config import to_typed
from ragtrain.train.harness import WorkerArgs, storage_dir, total_steps
from tests.conftest import compose, tiny_overrides


def test_max_steps_wins() -> None:
    assert total_steps(7, 3.0, 10, 4) == 7


@pytest.mark.parametrize("epochs,n,batch,expected", [
    (1.0, 10, 4, 2),  # 2 full batches; the last partial one (2 examples) is dropped
    (1.5, 10, 4, 3),  # 1.5 x 2 = 3
    (0.4, 10, 4, 1),  # rounded up: never 0 steps
    (2.0, 8, 4, 4),
])
def test_epochs_count_full_global_batches(epochs: float, n: int, batch: int, expected: int) -> None:
    assert total_steps(0, epochs, n, batch) == expected


def test_too_small_data_names_the_batch() -> None:
    with pytest.raises(ValueError, match="global batch of 8"):
        total_steps(0, 1.0, 5, 8)


def test_worker_args_are_typed_and_picklable(tmp_path) -> None:
    """Workers get the resolved, typed Config (no Hydra node, no interpolation left) through pickling."""
    cfg = to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp_path)]))
    args = WorkerArgs(cfg, "retriever", cpus_per_worker=1.0, refs={"probe": None})
    back = pickle.loads(pickle.dumps(args))
    assert back.cfg == cfg and type(back.cfg).__name__ == "Config"
    assert back.fit_id == args.fit_id and len(args.fit_id) == 32
    assert WorkerArgs(cfg, "retriever", 1.0).fit_id != args.fit_id  # one id per fit
    assert back.storage() == storage_dir(cfg, "retriever") == tmp_path / "out" / "ray" / "retriever"
