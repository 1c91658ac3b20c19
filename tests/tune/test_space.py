"""tune.space -> Tune search space: key and value validation against the schema, sync option merging, resources.

No Ray cluster: everything here runs before a sweep starts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ragtrain.config import Config, to_typed
from ragtrain.runtime.errors import ConfigError
from ragtrain.tune import space as sp
from ragtrain.tune.sweep import max_concurrency, plan_sweep, trial_need, trial_request
from tests.conftest import CONF_DIR, REPO, compose, tiny_overrides


def _plan(tmp_path: Path, *extra: str):
    cfg = to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp_path), "tune=sync_sweep", *extra]))
    return plan_sweep(cfg, CONF_DIR)


def test_sync_sweep_experiment_composes(tmp_path: Path) -> None:
    cfg = to_typed(compose(["experiment=sync_sweep", f"output_dir={tmp_path}"]))
    assert cfg.tune is not None and cfg.tune.scheduler == "asha" and cfg.experiment_name == "sync_sweep"
    # ASHA judges dev nDCG@10 measured every log window, not the training loss
    assert (cfg.tune.asha_metric, cfg.tune.asha_mode) == ("val/ndcg@10", "max")
    assert cfg.retriever.train.val_every == cfg.retriever.train.log_every
    plan = plan_sweep(cfg, CONF_DIR)
    assert [p.key for p in plan.params] == ["sync", "retriever.train.lr"]
    assert plan.base["tune"] is None and plan.base["resume"] is False  # trials are plain runs
    assert plan.tracking_uri.startswith("sqlite:////")  # absolute: trials run in other working directories


def test_no_tune_by_default(tmp_path: Path) -> None:
    assert to_typed(compose(["experiment=quickstart", f"output_dir={tmp_path}"])).tune is None


def test_parse_dotted_and_nested_keys() -> None:
    params = sp.parse_space(
        {
            "sync": {"grid": ["ddp", "local_sgd"]},
            "retriever": {"train": {"lr": {"loguniform": [1e-5, "1e-3"]}}},
            "sync.mixer.period": {"randint": [2, 9]},
            "retriever.temperature": {"uniform": [0.02, 0.1]},
        }
    )
    by = {p.key: p for p in params}
    assert set(by) == {"sync", "retriever.train.lr", "sync.mixer.period", "retriever.temperature"}
    assert by["retriever.train.lr"].args == (1e-5, 1e-3)  # YAML strings like 1e-3 become numbers
    assert sp.candidates(by["sync.mixer.period"]) == [2, 8]  # randint's upper bound is exclusive (as in Tune)
    from ray.tune.search.sample import Categorical, Float, Integer

    space = sp.to_tune(params)
    assert isinstance(space["retriever.train.lr"], Float) and isinstance(space["sync.mixer.period"], Integer)
    assert space["sync"] == {"grid_search": ["ddp", "local_sgd"]}
    assert isinstance(sp.to_tune(sp.parse_space({"sync": {"choice": ["ddp"]}}))["sync"], Categorical)


@pytest.mark.parametrize(
    "space, match",
    [
        ({"retriever.trian.lr": {"choice": [1e-3]}}, "tune.space has unknown config key 'retriever.trian.lr'"),
        ({"retriever.train.lr.x": {"choice": [1]}}, "unknown config key 'retriever.train.lr.x'"),
        ({"nope": {"choice": [1]}}, "unknown config key 'nope'"),
        ({"retriever.train": {"choice": [1]}}, "is a config group"),
        ({"output_dir": {"choice": ["a"]}}, "cannot sweep 'output_dir'"),
        ({"logger.tracking_uri": {"choice": ["a"]}}, "cannot sweep 'logger.tracking_uri'"),
        (
            {"retriever.train.lr": {"normal": [0, 1]}},
            r"kind one of \['choice', 'grid', 'uniform', 'loguniform', 'randint'\]",
        ),
        ({"retriever.train.lr": 1e-3}, r"must be a mapping"),
        ({"retriever.train.lr": {"uniform": [1e-3]}}, r"must be \[low, high\]"),
        ({"retriever.train.lr": {"uniform": [1e-2, 1e-3]}}, "needs low < high"),
        ({"retriever.train.lr": {"loguniform": [0, 1e-3]}}, "needs low > 0"),
        ({"sync.mixer.period": {"randint": [1.5, 4]}}, "must be integers"),
        ({"retriever.train.lr": {"choice": []}}, "non-empty list"),
        (
            {"sync": {"choice": ["ddp", "local_sgd"]}, "sync.mixer.period": {"choice": [4, 0]}},
            r"tune.space\['sync.mixer.period'\] value 0: sync.mixer.period must be > 0",
        ),
        # a knob no reachable sync option reads (ddp has no mixer) would never apply
        ({"sync.mixer.period": {"choice": [4]}}, r"tune.space\['sync.mixer.period'\] is read by none of the sync"),
        ({"retriever.train.batch_size": {"choice": ["big"]}}, "retriever.train.batch_size"),
        ({"sync": {"grid": ["ddp", "warp"]}}, r"unknown sync option 'warp'; valid choices: \['async_ps', 'ddp'"),
        ({"sync": {"uniform": [0, 1]}}, "takes choice or grid"),
    ],
)
def test_bad_space_fails_naming_the_key(tmp_path: Path, space: dict, match: str) -> None:
    cfg = to_typed(compose(["experiment=quickstart", f"output_dir={tmp_path}", "tune=sync_sweep"]))
    cfg.tune.space = space
    with pytest.raises(ConfigError, match=match):
        plan_sweep(cfg, CONF_DIR)


@pytest.mark.parametrize(
    "override, match",
    [
        ("tune.scheduler=hyperband", r"tune.scheduler must be one of \['fifo', 'asha'\], got 'hyperband'"),
        ("tune.searcher=hyperopt", r"tune.searcher must be one of \['random', 'optuna'\], got 'hyperopt'"),
        ("tune.mode=maximum", "tune.mode must be one of"),
        ("tune.num_samples=0", "tune.num_samples must be > 0"),
        ("tune.max_concurrent_trials=0", "tune.max_concurrent_trials must be > 0"),
        ("tune.reduction_factor=1", "tune.reduction_factor must be > 1"),
        ("tune.time_attr=epoch", "tune.time_attr must be one of"),
    ],
)
def test_bad_tune_settings_list_choices(tmp_path: Path, override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        to_typed(compose(["experiment=quickstart", f"output_dir={tmp_path}", "tune=sync_sweep", override]))


def test_metric_and_combination_checks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tune.metric must be a final pipeline metric"):
        _plan(tmp_path, "tune.metric=ndcg@10")
    with pytest.raises(ConfigError, match="not a training-window one"):
        _plan(tmp_path, "tune.metric=train/loss")
    with pytest.raises(ConfigError, match="tune.asha_metric must be reported at every log window"):
        _plan(tmp_path, "tune.asha_metric=trained/ndcg@10")
    with pytest.raises(ConfigError, match="grid, which tune.searcher=optuna cannot sample"):
        _plan(tmp_path, "tune.searcher=optuna")
    with pytest.raises(ConfigError, match="tune and compare.strategies / compare.variants are exclusive"):
        _plan(tmp_path, "compare.strategies=[ddp]")
    assert _plan(tmp_path, "tune.metric=trained/ndcg_at_10").cfg.tune.metric == "trained/ndcg_at_10"  # MLflow spelling


def test_apply_merges_sync_option_then_keys(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "sync.eval_every=3")
    cfg = sp.apply(plan.base, {"sync": "local_sgd", "retriever.train.lr": 0.02}, plan.sync_options)
    assert isinstance(cfg, Config)
    assert cfg.sync.strategy == "local_sgd" and cfg.sync.mixer.period == 8  # conf/sync/local_sgd.yaml
    assert cfg.sync.eval_every == 3  # the experiment's sync settings survive, like sync_variants
    assert cfg.retriever.train.lr == 0.02 and cfg.tune is None
    cfg = sp.apply(plan.base, {"sync": "local_sgd", "sync.mixer.period": 4}, plan.sync_options)
    assert cfg.sync.mixer.period == 4  # an explicit key beats the option file
    cfg = sp.apply(plan.base, {"sync": "powersgd"}, plan.sync_options)
    assert (cfg.sync.strategy, cfg.sync.reducer.kind, cfg.sync.reducer.start_iter) == ("compressed", "powersgd", 4)
    # a conditional space: a ddp trial skips the local-SGD period (ddp has no mixer to read it)
    assert sp.apply(plan.base, {"sync": "ddp", "sync.mixer.period": 4}, plan.sync_options).sync.mixer.period is None
    import numpy as np

    cfg = sp.apply(plan.base, {"sync": "local_sgd", "sync.mixer.period": np.int64(3)}, plan.sync_options)
    assert cfg.sync.mixer.period == 3  # Tune's numpy


def test_trial_resources_and_concurrency(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "resources=laptop_shared")  # 2 workers x 1 CPU, 2 actors x 1 CPU, taking turns
    cfg = plan.cfg
    assert trial_need(cfg) == {"CPU": 2.0}
    assert max_concurrency({"CPU": 2.0}, {"CPU": 4.0}) == 2
    assert max_concurrency({"CPU": 2.0}, {"CPU": 3.0}) == 1
    assert max_concurrency({"CPU": 1.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 2.0}) == 2
    live = sp.apply(plan.base, {"refresh.enabled": True, "refresh.every_steps": 2}, plan.sync_options)
    assert trial_need(live) == {"CPU": 4.0}  # live index refresh: trainer and pool at once
    joint_live = sp.apply(
        plan.base,
        {
            "stages": ["index", "joint"],
            "joint.passage_encoder": "trained",
            "refresh.enabled": True,
            "refresh.every_steps": 2,
        },
        plan.sync_options,
    )
    assert trial_need(joint_live) == {"CPU": 4.0}  # joint training of the passage side refreshes while it trains
    gpu_pool = sp.apply(plan.base, {"resources.pool.gpus_per_actor": 0.5}, plan.sync_options)
    assert trial_need(gpu_pool) == {"CPU": 2.0, "GPU": 1.0}  # encode actors on GPUs: the trial needs them
    # index shards on GPUs hold theirs for the whole trial, beside the trainer's and the pool's
    gpu_shards = sp.apply(
        plan.base, {"index.device": "cuda", "index.shards": "2", "index.gpus_per_shard": 0.25}, plan.sync_options
    )
    assert trial_need(gpu_shards) == {"CPU": 2.0, "GPU": 0.5}
    gpu_both = sp.apply(
        plan.base,
        {"index.device": "cuda", "index.shards": "2", "resources.pool.gpus_per_actor": 0.5},
        plan.sync_options,
    )
    assert trial_need(gpu_both) == {"CPU": 2.0, "GPU": 2.0}  # 2 x 0.5 (gpus_per_shard's default) + 2 x 0.5
    space = sp.parse_space({"resources.trainer.num_workers": {"choice": [1, 3]}})
    assert sp.worst_case(space, plan.base, plan.sync_options).resources.trainer.num_workers == 3
    assert trial_request(0) == {"CPU": 0, "memory": 1 << 20}  # Tune refuses an all-zero request
    assert trial_request(0.5) == {"CPU": 0.5}


def test_describe_labels() -> None:
    assert sp.describe({"retriever.train.lr": 0.000123456, "sync": "ddp"}) == "ddp lr=0.000123"


def test_cli_bad_space_exits_2_naming_the_key(tmp_path: Path) -> None:
    """`python -m ragtrain ... tune=NAME` with a misspelled key: exit 2 before Ray or MLflow start."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ragtrain",
            "experiment=quickstart",
            "tune=sync_sweep",
            f"output_dir={tmp_path}",
            f"logger.tracking_uri=sqlite:///{tmp_path / 'm.db'}",
            "+tune.space.retriever.trian.lr={choice: [0.1]}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "tune.space has unknown config key 'retriever.trian.lr'" in proc.stderr
    assert not (tmp_path / "m.db").exists() and not (tmp_path / "tune").exists()


def test_base_is_plain_data(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    assert OmegaConf.is_config(plan.base) is False and isinstance(plan.base["sync"], dict)


def test_optuna_searcher_waits_for_its_metric() -> None:
    """Intermediate results (train/loss) lack the sweep metric: the searcher skips them instead of a KeyError."""
    from ragtrain.tune.searchers.optuna_tpe import FinalMetricOptunaSearch

    params = sp.parse_space({"retriever.train.lr": {"loguniform": [1e-5, 1e-3]}, "sync": {"choice": ["ddp", "topk"]}})
    searcher = FinalMetricOptunaSearch(metric="trained/ndcg@10", mode="max", seed=0)
    assert searcher.set_search_properties(None, None, sp.to_tune(params))  # what Tune does with param_space
    cfg = searcher.suggest("t1")
    assert 1e-5 <= cfg["retriever.train.lr"] <= 1e-3 and cfg["sync"] in ("ddp", "topk")
    searcher.on_trial_result("t1", {"train/loss": 1.2, "step": 2, "training_iteration": 1})
    final = {"trained/ndcg@10": 0.7, "step": 6, "training_iteration": 2}
    searcher.on_trial_result("t1", final)
    searcher.on_trial_complete("t1", final)
    assert searcher.suggest("t2") is not None


def test_lr_optuna_sweep_config_plans(tmp_path: Path) -> None:
    plan = plan_sweep(
        to_typed(compose(["experiment=quickstart", f"output_dir={tmp_path}", "tune=lr_optuna"])), CONF_DIR
    )
    assert plan.cfg.tune.searcher == "optuna" and {p.kind for p in plan.params} == {"choice", "loguniform"}
