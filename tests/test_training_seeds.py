"""A run's `seed` changes what a rerun at another seed should change, the order of the training questions in every
stage, and leaves `data.seed`'s choices alone: the dev split and the evaluated questions, so two seeds are scored on
the same questions and pair question by question."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragtrain.config import to_typed
from ragtrain.config.variants import override_variants
from ragtrain.corpus.load import load_data
from ragtrain.generator.stage import build_gen_data
from ragtrain.generator.steps import Sampler
from ragtrain.retriever.batching import global_batch_indices
from tests.conftest import compose, tiny_overrides

STEPS, BATCH = 6, 4  # the first 24 training questions of each order


def _orders(cfg, n: int) -> dict[str, list[int]]:
    """The first training questions each stage draws: the generator and joint stages' sampler, the retriever
    stage's batches."""
    return {
        "generator": [Sampler(n, cfg.generator.train.seed)(p) for p in range(STEPS * BATCH)],
        "joint": [Sampler(n, cfg.joint.seed)(p) for p in range(STEPS * BATCH)],
        "retriever": [
            int(i) for s in range(STEPS) for i in global_batch_indices(n, BATCH, s, cfg.retriever.train.seed)
        ],
    }


def _questions(cfg) -> tuple[list[str], list[str], list[str]]:
    """(training question ids, EM / F1's evaluated question ids, the likelihood's evaluated question ids)."""
    gen = build_gen_data(cfg, load_data(cfg.data))
    return [e.qid for e in gen.train], [e.qid for e in gen.eval], [e.qid for e in gen.likelihood]


@pytest.mark.parametrize("how", ["seed=N", "compare.seeds"])
def test_two_seeds_train_in_other_orders_on_the_same_evaluated_questions(tmp_path: Path, how: str) -> None:
    base = tiny_overrides(tmp_path) + ["generator.eval.max_questions=5", "generator.eval.likelihood_questions=9"]
    if how == "seed=N":  # a user's rerun: only `seed` changes
        runs = [to_typed(compose(base + [f"seed={s}"])) for s in (0, 1)]
    else:  # the experiment's own seeds, one run per variant and seed
        composed = compose(base + ["experiment=squad_rag", "data=synthetic", "compare.only=[frozen]"])
        runs = list(override_variants(composed).values())
    assert [c.seed for c in runs] == [0, 1] and {c.data.seed for c in runs} == {0}
    first, second = (_questions(c) for c in runs)
    assert first == second  # the same training set, the same EM / F1 sample, the same likelihood questions
    train, em, likelihood = first
    assert len(em) == 5 and len(likelihood) == 9 and set(em) <= set(likelihood)
    a, b = (_orders(c, len(train)) for c in runs)
    for stage in ("generator", "joint", "retriever"):
        assert a[stage] != b[stage], stage  # another order of the training questions at the other seed
        assert len(set(a[stage])) == STEPS * BATCH  # distinct questions: one epoch holds them all
    # the generator and joint stages draw one order at one seed: the variants' generators see the same questions
    assert a["generator"] == a["joint"] and b["generator"] == b["joint"]


def test_a_stage_seed_set_on_its_own_stays_pinned(tmp_path: Path) -> None:
    cfg = to_typed(compose(tiny_overrides(tmp_path) + ["seed=3", "joint.seed=7"]))
    assert (cfg.retriever.train.seed, cfg.generator.train.seed, cfg.joint.seed, cfg.data.seed) == (3, 3, 7, 0)
