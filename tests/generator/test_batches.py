"""Batch composition: the seeded global order, rank slices, gold insertion and passage shuffling."""

from __future__ import annotations

import random

from ragtrain.generator.steps import GenExample, Sampler, train_passages


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


def test_the_gold_passage_is_never_pushed_out_of_its_training_prompt() -> None:
    # Passages of different lengths under a budget that holds two of them: a shuffle (or a long higher-ranked hit)
    # would put the gold passage last, where the prompt cuts or drops it
    length = {"a": 5, "b": 6, "c": 4, "g": 5}

    def whole(ids: list[str]) -> int:  # passages that fit whole, in this order, in 11 tokens
        used = 0
        for i, p in enumerate(ids):
            used += length[p]
            if used > 11:
                return i
        return len(ids)

    ex = GenExample("q1", "who?", ["x"], ["g"])
    for seed in range(20):
        ids = train_passages(ex, ["a", "b", "g"], 3, True, True, random.Random(seed), whole)
        assert "g" in ids[: whole(ids)] and sorted(ids) == ["a", "b", "g"]  # whole, whatever the order drawn
    # rank order without shuffling: the gold passage and the best-ranked hit that fits beside it; the rest after
    assert train_passages(ex, ["a", "b", "g"], 3, True, False, random.Random(0), whole) == ["a", "g", "b"]
    assert train_passages(ex, ["b", "a", "c"], 3, True, False, random.Random(0), whole) == ["b", "g", "a"]  # c replaced
    # no gold to keep (include_gold=false): the old behaviour, every id shuffled
    assert sorted(train_passages(ex, ["a", "b", "c"], 3, False, True, random.Random(0), whole)) == ["a", "b", "c"]


def test_a_real_prompt_holds_the_gold_passage_whole() -> None:
    from transformers import AutoTokenizer

    from ragtrain.embed.model import minilm_path
    from ragtrain.generator.prompt import PromptBuilder, Template

    tok = AutoTokenizer.from_pretrained(minilm_path())
    b = PromptBuilder(tok, 40, 0, Template("question:", "context:"))
    texts = {"a": "alpha " * 12, "b": "bravo " * 9, "c": "charlie " * 3, "g": "golf is the answer here"}
    ex = GenExample("q1", "who plays golf?", ["golf"], ["g"])
    gold_ids = b.passage_ids(texts["g"])
    for seed in range(10):
        ids = train_passages(
            ex,
            ["a", "b", "c", "g"],
            4,
            True,
            True,
            random.Random(seed),
            lambda ps: b.whole_passages(ex.question, [texts[p] for p in ps]),
        )
        src = b.source(ex.question, [texts[p] for p in ids])
        assert any(src[i : i + len(gold_ids)] == gold_ids for i in range(len(src)))  # the whole gold passage


def test_step_passages_follow_the_gold_only_curriculum_then_the_retrieved_ones() -> None:
    """One function chooses a training prompt's passages for the generator stage and the joint stage alike."""
    from ragtrain.config.generator import GeneratorTrainConfig
    from ragtrain.generator.steps import step_passages

    ex = GenExample("q1", "who?", ["x"], ["g"])
    t = GeneratorTrainConfig(oracle_steps=2, include_gold=True, shuffle_passages=False)
    assert [step_passages(ex, ["a", "b"], s, t, 2, random.Random(0)) for s in (0, 1)] == [["g"], ["g"]]
    assert step_passages(ex, ["a", "b"], 2, t, 2, random.Random(0)) == ["a", "g"]  # the gold replaces b
    assert step_passages(ex, ["a", "g", "b"], 2, t, 1, random.Random(0)) == ["g"]  # top 1: the gold replaces a
