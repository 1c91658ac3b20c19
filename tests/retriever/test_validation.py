"""Validation during training (retriever.train.val_every): the sample, the metric, the config checks."""

from __future__ import annotations

import pytest
import torch

from ragtrain.config import to_typed
from ragtrain.config.retriever import RetrieverConfig
from ragtrain.data import make_synthetic
from ragtrain.retriever.validation import make_val_set, validate
from ragtrain.runtime.errors import ConfigError
from tests.conftest import compose, tiny_overrides


def test_the_sample_holds_every_relevant_passage_and_is_fixed() -> None:
    data = make_synthetic(num_entities=24)
    val = make_val_set(data, num_queries=5, num_passages=40, seed=0)
    assert val.qids == sorted(data.eval_qrels)[:5] and len(val.pids) == 40 == len(set(val.pids))
    relevant = {d for q in val.qids for d, g in data.eval_qrels[q].items() if g > 0}
    assert relevant <= set(val.pids)
    assert make_val_set(data, 5, 40, seed=0).pids == val.pids  # the same sample at every step and on resume


def test_validate_scores_a_perfect_and_a_random_encoder_apart() -> None:
    from ragtrain.embed.model import build_encoder, load_tokenizer

    data = make_synthetic(num_entities=24)
    val = make_val_set(data, num_queries=20, num_passages=1000, seed=0)  # the whole corpus, every dev query
    cfg = RetrieverConfig(model="tiny")
    torch.manual_seed(0)
    enc = build_encoder(cfg)
    m = validate(enc, load_tokenizer(cfg), val, 32, 64, cfg.train.precision, torch.device("cpu"))
    assert set(m) == {"val/ndcg@10", "val/recall@10"} and 0.0 <= m["val/ndcg@10"] < 1.0


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("retriever.train.val_every=3", "must be 0 \\(off\\) or a multiple of retriever.train.log_every"),
        ("retriever.train.val_queries=0", "retriever.train.val_queries must be > 0"),
    ],
)
def test_bad_validation_settings_name_the_key(tmp_path, override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp_path), "retriever.train.log_every=2", override]))


def test_asha_on_validation_needs_validation_every_window(tmp_path) -> None:
    from ragtrain.tune.sweep import plan_sweep
    from tests.conftest import CONF_DIR

    cfg = to_typed(
        compose(
            [
                "experiment=quickstart",
                *tiny_overrides(tmp_path),
                "tune=sync_sweep",
                "tune.asha_metric=val/ndcg@10",
                "tune.asha_mode=max",
            ]
        )
    )
    with pytest.raises(ConfigError, match="set retriever.train.val_every="):
        plan_sweep(cfg, CONF_DIR)
