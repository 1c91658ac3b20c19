"""Every experiment composes the way users compose it; bad keys and values fail before work, naming the key."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig

from ragtrain.config import Config, to_flat_dict, to_typed
from ragtrain.runtime.errors import ConfigError
from tests.conftest import CONF_DIR, REPO, compose

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def test_experiments_exist() -> None:
    assert {"quickstart", "scifact_zeroshot", "scifact_finetune"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_validates(name: str, tmp_path: Path) -> None:
    cfg = compose([f"experiment={name}", f"output_dir={tmp_path}"])
    typed = to_typed(cfg)
    assert isinstance(typed, Config)
    assert typed.experiment_name == name
    flat = to_flat_dict(typed)
    assert flat["retriever.train.batch_size"] == str(typed.retriever.train.batch_size)


def test_experiment_file_starts_with_global_package() -> None:
    for p in (CONF_DIR / "experiment").glob("*.yaml"):
        assert p.read_text().startswith("# @package _global_"), p


def test_command_line_group_override_beats_experiment(tmp_path: Path) -> None:
    typed = to_typed(compose(["experiment=quickstart", "retriever=tiny", f"output_dir={tmp_path}"]))
    assert typed.retriever.model == "tiny"


def test_unknown_key_fails() -> None:
    with pytest.raises(ConfigCompositionException) as e:
        compose(["retriever.train.batch_sise=4"])
    assert "batch_sise" in str(e.value) + str(e.value.__cause__)


def test_wrong_type_fails() -> None:
    with pytest.raises(ConfigCompositionException) as e:
        compose(["retriever.train.batch_size=big"])
    assert "batch_size" in str(e.value) + str(e.value.__cause__)


def test_bad_enum_lists_choices() -> None:
    with pytest.raises(ConfigCompositionException) as e:
        compose(["index.precision=fp8"])
    msg = str(e.value) + str(e.value.__cause__)
    assert "fp32" in msg and "bf16" in msg


SYNC_OPTIONS = sorted(p.stem for p in (CONF_DIR / "sync").glob("*.yaml"))


def test_every_sync_option_composes_as_a_preset(tmp_path: Path) -> None:
    """`sync=NAME` on the command line: each option is a reducer + mixer + scope composition (the old names too)."""
    assert {
        "ddp",
        "fp16",
        "powersgd",
        "topk",
        "local_sgd",
        "local_sgd_adaptive",
        "gossip",
        "hierarchical",
        "async_ps",
        "vector_avg",
        "hybrid_powersgd",
        "layerwise",
    } <= set(SYNC_OPTIONS)
    for name in SYNC_OPTIONS:
        typed = to_typed(compose(["experiment=quickstart", f"sync={name}", f"output_dir={tmp_path}"]))
        flat = to_flat_dict(typed)
        assert flat["sync.reducer.kind"] == typed.sync.reducer.kind and flat["sync.label"] == name, name


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["sync=powersgd", "sync.reducer.ratio=0.1"], "sync.reducer.ratio"),  # a top-k key under PowerSGD
        (["sync=ddp", "sync.mixer.kind=average"], "sync.mixer.kind"),  # nothing to mix after a full all-reduce
        (["sync=hierarchical", "sync.scope.mixer=all"], "sync.mixer.kind"),  # nodes would never meet
    ],
)
def test_sync_keys_a_kind_does_not_read_fail(overrides: list, key: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        to_typed(compose([*overrides, f"output_dir={tmp_path}"]))
    assert key in str(e.value)


@pytest.mark.parametrize(
    "override,key",
    [
        ("retriever.train.batch_size=0", "retriever.train.batch_size"),
        ("retriever.train.lr=-1", "retriever.train.lr"),
        ("retriever.temperature=0", "retriever.temperature"),
        ("resources.trainer.num_workers=0", "resources.trainer.num_workers"),
        ("index.top_k=0", "index.top_k"),
        ("index.top_k=10", "index.top_k"),  # recall@100 would be recall@10 under another name
        ("stages=[retriever,bogus]", "stages"),
        ("data.source=beir", "data.root"),
        ("index.distill_steps=10", "index.distill_steps"),  # needs sync=vector_avg
        ("index.distill_lr=0", "index.distill_lr"),
    ],
)
def test_out_of_range_values_name_the_key(override: str, key: str, tmp_path: Path) -> None:
    cfg = compose([override, f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as e:
        to_typed(cfg)
    assert key in str(e.value)


@pytest.mark.parametrize(
    "overrides,needs",
    [
        (["stages=[index]"], "needs stages [retriever, index]"),
        (["sync=vector_avg"], "does not apply to sync=vector_avg"),
    ],
)
def test_align_anchors_that_would_do_nothing_fail(overrides: list, needs: str, tmp_path: Path) -> None:
    """index.align_anchors without a zero-shot and a trained index to align (or with vector_avg) is refused."""
    cfg = compose(["experiment=quickstart", "index.align_anchors=8", *overrides, f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=re.escape("index.align_anchors " + needs)):
        to_typed(cfg)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ragtrain", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_cli_unknown_group_option_lists_choices() -> None:
    r = _cli("experiment=nope")
    assert r.returncode != 0
    assert "quickstart" in r.stderr and "nope" in r.stderr


def test_cli_bad_value_fails_before_work(tmp_path: Path) -> None:
    r = _cli("retriever.train.batch_size=0", f"output_dir={tmp_path}/out")
    assert r.returncode == 2
    assert "retriever.train.batch_size must be > 0" in r.stderr
    assert not (tmp_path / "out").exists()  # nothing started


def test_override_variants_apply_their_keys(tmp_path) -> None:
    from ragtrain.config.variants import override_variants

    cfg = compose(["experiment=scifact_refresh", f"output_dir={tmp_path}"])
    variants = override_variants(cfg)
    assert list(variants) == [
        "in_batch",
        "stale_index",
        "live_refresh",
        "shards_global",
        "shards_eager",
        "shards_aligned",
        "shards_quarter",
    ]
    assert variants["in_batch"].retriever.train.hard_negatives == 0
    assert variants["stale_index"].retriever.train.hard_negatives == 1 and not variants["stale_index"].refresh.enabled
    assert variants["live_refresh"].refresh.enabled and variants["live_refresh"].refresh.every_steps == 15
    assert variants["live_refresh"].output_dir == str(tmp_path / "live_refresh")
    assert [v.zeroshot_eval for v in variants.values()] == [True] + [False] * 6
    sharded = [variants[f"shards_{n}"] for n in ("global", "eager", "aligned", "quarter")]
    assert [(v.index.shards, v.refresh.consistency, v.refresh.fraction) for v in sharded] == [
        ("3", "global", 1.0),
        ("3", "eager", 1.0),
        ("3", "aligned", 1.0),
        ("3", "global", 0.25),
    ]
    assert all(v.refresh.every_steps == 15 for v in sharded) and sharded[2].refresh.anchors >= 384


def test_compare_only_runs_the_named_variants_in_its_order(tmp_path) -> None:
    from ragtrain.config.variants import override_variants

    cfg = compose(["experiment=shard_refresh", f"output_dir={tmp_path}", "compare.only=[partial_hot,full_global]"])
    variants = override_variants(cfg)
    assert list(variants) == ["partial_hot", "full_global"]
    assert variants["partial_hot"].refresh.priority == "hot" and variants["partial_hot"].refresh.fraction == 0.25
    assert variants["partial_hot"].zeroshot_eval and not variants["full_global"].zeroshot_eval
    assert variants["full_global"].compare.only == []


def test_cli_unknown_compare_only_name_lists_the_variants(tmp_path) -> None:
    r = _cli("experiment=shard_refresh", "compare.only=[full_globl]", f"output_dir={tmp_path}/out")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "compare.only names ['full_globl'], which are not variants: choose from ['full_global'," in r.stderr
    assert not (tmp_path / "out").exists()


def test_distill_with_vector_avg_validates(tmp_path) -> None:
    cfg = to_typed(
        compose(["experiment=quickstart", "sync=vector_avg", "index.distill_steps=10", f"output_dir={tmp_path}"])
    )
    assert cfg.index.distill_steps == 10


@pytest.mark.parametrize(
    "variant, message",
    [
        ("retriever.train.hard_negativs=1", "unknown config key 'retriever.train.hard_negativs'"),
        ("refresh.enabled", "each entry must be key=value"),
        ("refresh.every_steps=-1", "refresh.every_steps must be >= 0"),
    ],
)
def test_bad_override_variant_names_the_problem(tmp_path, variant, message) -> None:
    from ragtrain.config.variants import override_variants

    cfg = compose(["experiment=scifact_refresh", f"output_dir={tmp_path}"])
    cfg.compare.variants = {"bad": [variant]}
    with pytest.raises(ConfigError, match=message):
        override_variants(cfg)


def test_relative_paths_are_made_absolute_on_the_driver(tmp_path: Path, monkeypatch) -> None:
    """Ray Data tasks, scoring actors, index shards and Tune trials run in other folders: every user path reaches
    them absolute, resolved against the folder the command ran in."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "teacher").mkdir()
    (tmp_path / "my-encoder").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = to_typed(
        compose(
            [
                "data=documents",
                "data.root=docs",
                "retriever.teacher.path=teacher",
                "retriever.model=my-encoder",
                "generator.retrieval.index_dir=idx",
                f"output_dir={tmp_path / 'out'}",
            ]
        )
    )
    assert cfg.data.root == str(tmp_path / "docs")
    assert cfg.retriever.teacher.path == str(tmp_path / "teacher")
    assert cfg.retriever.model == str(tmp_path / "my-encoder")
    assert cfg.generator.retrieval.index_dir == str(tmp_path / "idx")
    hub = to_typed(compose(["retriever.model=sentence-transformers/all-MiniLM-L6-v2", f"output_dir={tmp_path}"]))
    assert hub.retriever.model == "sentence-transformers/all-MiniLM-L6-v2"  # a hub name, not a folder here


def test_an_output_dir_url_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^output_dir must be a folder path .* not a URL, got 's3://bucket/run'"):
        to_typed(compose(["output_dir=s3://bucket/run"]))


def test_an_added_key_the_schema_lacks_is_refused(tmp_path: Path) -> None:
    """Hydra's hint for an unknown key is '+key=value', which adds it; the typed config would drop it silently."""
    with pytest.raises(ConfigError, match=r"^unknown config key\(s\) \['retriever.train.batch_sise'\]"):
        to_typed(compose(["experiment=quickstart", "+retriever.train.batch_sise=4", f"output_dir={tmp_path}"]))
    typed = to_typed(compose(["experiment=lora_compare", f"output_dir={tmp_path}"]))
    assert len(typed.compare.variants) >= 2  # a dict field's keys are names, not schema keys


def test_a_saved_config_with_relative_paths_compares_equal_after_resolution(tmp_path: Path, monkeypatch) -> None:
    """Runs and sweeps saved before paths were made absolute resume without a spurious difference."""
    from ragtrain.config import absolute_paths, changed_keys

    (tmp_path / "docs").mkdir()
    monkeypatch.chdir(tmp_path)
    now = to_flat_dict(to_typed(compose(["data=documents", "data.root=docs", f"output_dir={tmp_path / 'o'}"])))
    saved = {**now, "data.root": "docs"}  # as an older run wrote it
    assert changed_keys(saved, now, ()) == ["data.root"]
    assert changed_keys(absolute_paths(saved), now, ()) == []
    assert absolute_paths({"generator.retrieval.index_dir": "None"}) == {"generator.retrieval.index_dir": "None"}


_LIVE = ["refresh.enabled=true", "refresh.every_steps=5"]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["experiment=quickstart", "compare.only=[full_global]"],
            r"compare.only picks among compare.variants, and this experiment has none",
        ),
        (
            ["experiment=sync_compare", "compare.only=[ddp]"],
            r"compare.only picks among compare.variants, and this experiment has none .*compare.strategies=\[",
        ),
        (["index.shard_timeout_s=inf"], r"index.shard_timeout_s must be a number of seconds in \[1, 3600\], got inf"),
        (["index.shard_timeout_s=nan"], r"index.shard_timeout_s must be a number of seconds in \[1, 3600\], got nan"),
        (["index.shard_timeout_s=0.001"], r"index.shard_timeout_s must be a number of seconds in \[1, 3600\]"),
        (
            ["experiment=quickstart", "refresh.enabled=true", "refresh.every_steps=5", "refresh.priority=hot"],
            r"refresh.priority=hot chooses the rows a partial refresh re-encodes, and refresh.fraction=1.0",
        ),
        (["refresh.priority=drift"], r"refresh.priority applies only with refresh.enabled=true"),
        (
            ["experiment=squad_rag", "stages=[index,joint,generator]"],
            r"stages.*the joint stage trains and evaluates the generator itself",
        ),
        ([*_LIVE, "refresh.timeout_s=inf"], r"refresh.timeout_s must be a number of seconds in \[1, 86400\], got inf"),
        ([*_LIVE, "refresh.timeout_s=0.5"], r"refresh.timeout_s must be a number of seconds in \[1, 86400\], got 0.5"),
        (["fault.hold_shard_encode=0"], r"fault.hold_shard_encode acts on a live refresh round: it needs refresh"),
        (
            [*_LIVE, "index.shards=3", "fault.kill_shard_before_apply=3"],
            r"fault.kill_shard_before_apply names an index shard, and index.shards=3 numbers them from 0, got 3",
        ),
    ],
)
def test_settings_that_would_be_ignored_fail_naming_the_key(overrides: list, match: str, tmp_path: Path) -> None:
    """Accepted and ignored (compare.only without variants, refresh.priority on a full refresh), or a timeout that
    never fires (inf, nan) or always does (0.001 s)."""
    with pytest.raises(ConfigError, match=match):
        to_typed(compose([*overrides, f"output_dir={tmp_path}"]))


@pytest.mark.parametrize(
    ("key", "value"), [("seed", "١٢"), ("retriever.train.max_steps", "１２"), ("index.nprobe", "٤")]
)
def test_numbers_in_other_scripts_digits_are_refused_naming_the_key(key: str, value: str, tmp_path: Path) -> None:
    """Python's int() reads '١٢' (Arabic-Indic) and '１２' (full-width) as 12: quoted (Hydra's lexer refuses them
    bare), a slip of the input method ran as that number."""
    from ragtrain.config import check_ascii_numbers

    over = f"{key}='{value}'"
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}={value!r} is written with digits other than 0-9"):
        check_ascii_numbers(compose([over, f"output_dir={tmp_path}"]), [over])
    named = "experiment_name='run٢'"  # a string key may hold any script
    check_ascii_numbers(compose([f"output_dir={tmp_path}", named]), [named])


@pytest.mark.parametrize("value", ["'١٢'", "١٢"])
def test_cli_a_number_in_other_digits_is_one_line_and_exit_2(tmp_path: Path, value: str) -> None:
    r = _cli("experiment=quickstart", f"seed={value}", f"output_dir={tmp_path}/out")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "config error: seed='١٢' is written with digits other than 0-9" in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_variant_number_in_other_digits_is_refused(tmp_path) -> None:
    from ragtrain.config.variants import override_variants

    cfg = compose(["experiment=scifact_refresh", f"output_dir={tmp_path}"])
    cfg.compare.variants = {"odd": ["retriever.train.max_steps='１２'"]}
    with pytest.raises(ConfigError, match=r"compare.variants.odd: retriever.train.max_steps='１２' is written with"):
        override_variants(cfg)


def test_compare_seeds_repeat_each_variant_per_seed(tmp_path) -> None:
    from ragtrain.config.variants import override_variants

    cfg = compose(
        [
            "experiment=shard_refresh",
            f"output_dir={tmp_path}",
            "compare.only=[partial_hot,full_global]",
            "compare.seeds=[3,5]",
        ]
    )
    variants = override_variants(cfg)
    assert list(variants) == ["partial_hot/seed=3", "partial_hot/seed=5", "full_global/seed=3", "full_global/seed=5"]
    assert [v.seed for v in variants.values()] == [3, 5, 3, 5]
    assert variants["full_global/seed=5"].output_dir == str(tmp_path / "full_global" / "seed5")
    assert variants["full_global/seed=5"].logger.run_name == "shard_refresh/full_global/seed=5"
    assert [v.zeroshot_eval for v in variants.values()] == [True, False, False, False]
    assert all(v.compare.seeds == [] for v in variants.values())


def test_cli_compare_seeds_without_variants_is_one_line(tmp_path) -> None:
    r = _cli("compare.seeds=[0,1]", f"output_dir={tmp_path}/out")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "compare.seeds" in r.stderr and "compare.variants" in r.stderr
    assert not (tmp_path / "out").exists()


def test_squad_rag_variants_give_every_generator_the_same_training_budget(tmp_path) -> None:
    """The variants differ in the retriever only: every generator (the generator stage's or the joint stage's)
    trains the same steps on the same global batch, from one seeded order, on one passage (the gold one in
    training); joint_full keeps the 2 trainer workers and adds a CPU for its refresh actor."""
    from ragtrain.config.variants import override_variants

    variants = override_variants(compose(["experiment=squad_rag", f"output_dir={tmp_path}"]))
    assert len(variants) == 8
    budget = set()
    for name, v in variants.items():
        workers = v.resources.trainer.num_workers
        if "joint" in v.stages:
            budget.add((v.joint.max_steps, v.joint.batch_size * workers, v.joint.seed == v.seed))
        else:
            assert v.generator.train.oracle_steps == 0, name
            budget.add((v.generator.train.max_steps, v.generator.train.batch_size * workers,
                        v.generator.train.seed == v.seed))  # fmt: skip
        assert (v.generator.retrieval.top_k, v.generator.train.include_gold) == (1, True), name
    assert budget == {(16, 4, True)}
    full = variants["joint_full/seed=0"].resources
    assert (full.num_cpus, full.trainer.num_workers, full.pool.num_actors) == (3, 2, 1)
    assert {v.resources.num_cpus for v in variants.values()} == {3}  # one local Ray for every variant


def test_a_variant_cannot_resize_the_ray_session_the_variants_share(tmp_path) -> None:
    """The first variant starts the local Ray every later one joins: a variant's own resources.num_cpus would be
    ignored (and its resource check fail after the earlier variants ran), so it is refused when composed."""
    from ragtrain.config.variants import override_variants

    def variant(name: str, cpus: int) -> DictConfig:
        return compose(
            ["experiment=squad_rag", f"output_dir={tmp_path}", f"compare.variants.{name}=['resources.num_cpus={cpus}']"]
        )

    with pytest.raises(ConfigError, match=r"compare.variants.joint_full sets 'resources.num_cpus=4', but every "
                       r"variant runs in the one Ray session the first starts \(resources.num_cpus=3\)"):  # fmt: skip
        override_variants(variant("joint_full", 4))
    same = variant("frozen", 3)
    assert override_variants(same)["frozen/seed=0"].resources.num_cpus == 3
