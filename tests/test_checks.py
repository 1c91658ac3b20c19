"""Checks that need no training run before any work, and a user error is one line with exit code 2."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ragtrain.config import to_typed
from ragtrain.runtime.errors import ConfigError
from tests.conftest import REPO, compose, tiny_overrides


def _cfg(tmp: Path, *extra: str):
    return to_typed(compose(["experiment=quickstart", *tiny_overrides(tmp), *extra]))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # released on close: nothing listens there


DOCS = ("data=documents", "data.generate=true")  # a source that carves dev from train (data.dev_size applies)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("resources.num_cpus=0",), "resources.num_cpus"),
        ((*DOCS, "data.dev_size=1.5"), r"data.dev_size must be a count of queries .* got 1.5"),
        ((*DOCS, "data.dev_size=0"), r"data.dev_size must be a count of queries .* got 0"),
    ],
)
def test_bad_values_name_the_key(tmp_path, overrides: tuple, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, *overrides)


def test_dev_size_is_a_count_or_a_fraction(tmp_path) -> None:
    assert _cfg(tmp_path, *DOCS, "data.dev_size=0.25").data.dev_size == 0.25
    count = _cfg(tmp_path, *DOCS, "data.dev_size=40").data.dev_size
    assert count == 40 and isinstance(count, int)  # the loaders read a float as a fraction


@pytest.mark.parametrize(
    ("override", "where"),
    [
        ("data.dev_size=40", "data=beir and data=documents"),
        ("data.prepare=ray", "data=beir and data=documents"),
        ("data.glob=*.md", "data=documents"),
        ("data.on_error=skip", "data=documents and data=squad"),
    ],
)
def test_folder_keys_set_with_synthetic_data_are_refused(tmp_path, override: str, where: str) -> None:
    """The synthetic KB reads no folder and has fixed splits: these keys would do nothing there."""
    with pytest.raises(ConfigError, match=rf"{override.split('=')[0]} applies to {where} only \(data=synthetic"):
        _cfg(tmp_path, override)


def test_tracking_uri_checks_fail_in_seconds_naming_the_setting(tmp_path) -> None:
    from ragtrain.track.mlflow import check_tracking_uri

    with pytest.raises(ConfigError, match=r"logger.tracking_uri .*unknown scheme 'foo'"):
        check_tracking_uri("foo://bar")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for uri in (f"sqlite:///{blocker}/m.db", f"sqlite:///{blocker}/sub/m.db", str(blocker), f"file://{blocker}/runs"):
        with pytest.raises(ConfigError, match=f"{blocker} is a file, not a folder"):  # root too: no mode bits involved
            check_tracking_uri(uri)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root ignores the mode bits: nothing to test with a read-only folder here
        locked = None
    for uri in [f"sqlite:///{locked}/m.db"] if locked else []:
        with pytest.raises(ConfigError, match="nothing can be created in"):
            check_tracking_uri(uri)
    with pytest.raises(ConfigError, match=r"MLFLOW_TRACKING_URI\)='http://127.0.0.1:\d+' does not answer"):
        check_tracking_uri(f"http://127.0.0.1:{_closed_port()}", timeout=2)
    check_tracking_uri(f"sqlite:///{tmp_path}/new/sub/m.db")  # missing folders are fine: MLflow creates them


def test_credentials_in_a_tracking_uri_are_redacted() -> None:
    from ragtrain.track.mlflow import redact_uri

    assert redact_uri("https://alice:s3cret@mlflow.example.com:5000") == "https://***@mlflow.example.com:5000"
    assert redact_uri("sqlite:////tmp/m.db") == "sqlite:////tmp/m.db"


def test_a_model_that_is_not_offline_fails_before_data_or_ray(tmp_path) -> None:
    from ragtrain.pipeline.stages import run

    cfg = _cfg(tmp_path, "retriever.model=some-org/not-cached-model")
    with pytest.raises(ConfigError, match=r"retriever.model='some-org/not-cached-model' is not available offline"):
        run(cfg)
    out = Path(cfg.output_dir)
    assert not (out / "config.yaml").exists() and not (out / "status.json").exists()  # not taken for a run


@pytest.mark.parametrize("folder", ["/no/such/encoder", "./no-such-encoder", "models/no/such-encoder"])
def test_a_model_folder_that_does_not_exist_is_named_as_missing(tmp_path, folder: str) -> None:
    """A path is not a hub id: a missing one says so, not what the hub says of a malformed id."""
    from ragtrain.embed.model import check_model_offline

    with pytest.raises(ConfigError) as e:
        check_model_offline(_cfg(tmp_path, f"retriever.model={folder}").retriever)
    assert str(e.value).startswith(f"retriever.model={folder!r}: no such folder; valid choices: retriever=minilm")
    assert "Repo id" not in str(e.value)


@pytest.mark.parametrize(("factory", "match"), [("IVF4096,Flat", "4096 IVF lists"), ("IVF8,Nope", "not a valid faiss")])
def test_a_bad_index_factory_fails_before_training_without_a_zeroshot_index(tmp_path, factory, match) -> None:
    """zeroshot_eval=false and no mining: the first index would be built after training; the check runs first."""
    from ragtrain.pipeline.stages import run

    cfg = _cfg(tmp_path, "zeroshot_eval=false", "retriever.train.hard_negatives=0", f"index.factory='{factory}'")
    with pytest.raises(ConfigError, match=match):
        run(cfg)
    # The passage store the checks wrote (the corpus size is known only after it) is removed with the folder
    assert not Path(cfg.output_dir).exists()


def test_failed_checks_remove_only_what_they_wrote(tmp_path) -> None:
    """A folder that held files before keeps them; the store this run wrote into it goes."""
    from ragtrain.pipeline.stages import run

    cfg = _cfg(tmp_path, "zeroshot_eval=false", "retriever.train.hard_negatives=0", "index.factory='IVF4096,Flat'")
    out = Path(cfg.output_dir)
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "mine.txt").write_text("kept")
    with pytest.raises(ConfigError, match="4096 IVF lists"):
        run(cfg)
    assert sorted(p.name for p in out.iterdir()) == ["notes"]
    assert (out / "notes" / "mine.txt").read_text() == "kept"


def test_resume_refuses_another_config_naming_the_keys(tmp_path) -> None:
    from omegaconf import OmegaConf

    from ragtrain.pipeline.stages import check_resume

    first = _cfg(tmp_path)
    out = Path(first.output_dir)
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(first)))
    check_resume(_cfg(tmp_path, "resume=true"), out)  # the same config: fine
    with pytest.raises(ConfigError, match=r"data.num_entities: 24 -> 30; retriever.train.lr"):
        check_resume(_cfg(tmp_path, "resume=true", "data.num_entities=30", "retriever.train.lr=0.5"), out)
    check_resume(_cfg(tmp_path, "resume=true", "fault.max_failures=3", "resume_allow_changes=[fault]"), out)
    with pytest.raises(ConfigError, match="fault.max_failures"):
        check_resume(_cfg(tmp_path, "resume=true", "fault.max_failures=3"), out)


def test_all_grade_zero_qrels_fail_before_encoding() -> None:
    from ragtrain.data import make_synthetic
    from ragtrain.data.types import DataError
    from ragtrain.pipeline.stages import check_qrels

    data = make_synthetic(num_entities=12)
    check_qrels(data)
    data.eval_qrels = {q: {d: 0 for d in judged} for q, judged in data.eval_qrels.items()}
    with pytest.raises(DataError, match=r"evaluated \(dev\) queries has grade 0"):
        check_qrels(data)


def test_fewer_training_examples_than_one_global_batch_fail_before_training(tmp_path) -> None:
    from ragtrain.data import make_synthetic
    from ragtrain.retriever.stage import check_train_batch

    data = make_synthetic(num_entities=12)
    n = sum(1 for judged in data.train_qrels.values() for g in judged.values() if g > 0)
    check_train_batch(_cfg(tmp_path, f"retriever.train.batch_size={n // 2}", "resources.trainer.num_workers=2"), data)
    with pytest.raises(
        ConfigError,
        match=rf"^{n} training examples < one global batch of {2 * (n // 2 + 1)} "
        r"\(retriever.train.batch_size x resources.trainer.num_workers\)",
    ):
        check_train_batch(
            _cfg(tmp_path, f"retriever.train.batch_size={n // 2 + 1}", "resources.trainer.num_workers=2"), data
        )
    check_train_batch(_cfg(tmp_path, f"retriever.train.batch_size={n + 1}", "stages=[index]"), data)  # no training
    # chunks: every chunk of a relevant document is an example, so a short document count is not the answer yet
    pairs = {q: {d: g for d, g in judged.items()} for q, judged in data.train_qrels.items()}
    data.doc_of = {f"{d}#{k}": d for judged in pairs.values() for d in judged for k in range(2)}
    check_train_batch(_cfg(tmp_path, f"retriever.train.batch_size={n}", "resources.trainer.num_workers=2"), data)


def test_the_trainer_is_not_checked_without_retriever_training() -> None:
    from ragtrain.cluster.resources import InfeasibleResourcesError, check_config
    from ragtrain.config.resources import PoolResources, ResourcesConfig, TrainerResources

    res = ResourcesConfig(
        trainer=TrainerResources(num_workers=8, cpus_per_worker=1), pool=PoolResources(num_actors=1, cpus_per_actor=1)
    )
    nodes = [{"CPU": 2.0}]
    with pytest.raises(InfeasibleResourcesError, match="resources.trainer"):
        check_config(res, nodes=nodes)
    check_config(res, nodes=nodes, trainer=False)  # stages without retriever: only the pool must fit


def _cli(tmp_path: Path, *overrides: str, verbose: bool = False) -> subprocess.CompletedProcess:
    """`python -m ragtrain experiment=quickstart <tiny overrides> *overrides`, as a user runs it (verbose: -v)."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    if verbose:
        env["HYDRA_FULL_ERROR"] = "1"
    args = [sys.executable, "-m", "ragtrain", "experiment=quickstart", *tiny_overrides(tmp_path), *overrides]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)


def test_cli_user_error_is_one_line_and_exit_2(tmp_path) -> None:
    closed = f"logger.tracking_uri=http://127.0.0.1:{_closed_port()}"
    r = _cli(tmp_path, closed)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("config error: logger.tracking_uri")
    assert "Traceback" not in r.stderr
    r = _cli(tmp_path, closed, verbose=True)  # -v keeps the traceback
    assert r.returncode == 2 and "Traceback" in r.stderr and "ConfigError" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("config error: logger.tracking_uri")


def test_cli_user_error_leaves_no_folder_behind(tmp_path) -> None:
    """A bad index factory on the embedded defaults (MLflow in ./mlruns, Hydra's run folder under ./outputs): exit 2,
    and the working folder is as it was: no run folder, no empty parents of it, no empty mlruns/."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "HF_HUB_OFFLINE": "1"}
    for k in ("HYDRA_FULL_ERROR", "MLFLOW_TRACKING_URI"):
        env.pop(k, None)
    args = [
        sys.executable,
        "-m",
        "ragtrain",
        "experiment=quickstart",
        "retriever=tiny",
        "data.num_entities=24",
        "index.factory='IVF4096,Flat'",
    ]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("config error: index.factory='IVF4096,Flat' asks for 4096")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("how", ["multirun", "hydra.verbose", "HYDRA_FULL_ERROR"])
def test_cli_user_error_in_other_modes_leaves_no_folder_behind(how: str, tmp_path) -> None:
    """A sweep of Hydra's own (-m) stopped by its first job's error, and the verbose modes: exit 2, no folder."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "HF_HUB_OFFLINE": "1"}
    for k in ("HYDRA_FULL_ERROR", "MLFLOW_TRACKING_URI"):
        env.pop(k, None)
    args = [
        sys.executable,
        "-m",
        "ragtrain",
        *(["-m"] if how == "multirun" else []),
        "experiment=quickstart",
        "retriever=tiny",
    ]
    if how == "multirun":
        args += ["retriever.train.lr=-1,-2"]
    else:
        args += ["retriever.train.lr=-1"] + (["hydra.verbose=true"] if how == "hydra.verbose" else [])
        env.update({"HYDRA_FULL_ERROR": "1"} if how == "HYDRA_FULL_ERROR" else {})
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "config error: retriever.train.lr must be > 0, got -1.0"
    assert ("Traceback" in r.stderr) == (how != "multirun")
    assert list(tmp_path.iterdir()) == []


def test_a_run_folder_with_the_runs_own_files_is_kept(tmp_path, monkeypatch) -> None:
    """Only a run folder holding nothing but Hydra's files is removed after a user error (one the run wrote into
    stays), with the parents made for it; a parent that existed before stays."""
    import ragtrain.__main__ as cli

    run_dir = tmp_path / "outputs" / "x" / "t"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / "__main__.log").write_text("log")
    (run_dir / "corpus").mkdir()
    monkeypatch.setattr(cli, "_EXISTING_BEFORE", {tmp_path, tmp_path / "outputs"})  # outputs/x/t made by the run
    cli.remove_run_folder(run_dir)
    assert (run_dir / "corpus").is_dir() and (run_dir / "__main__.log").exists()
    (run_dir / "corpus").rmdir()
    cli.remove_run_folder(run_dir)
    assert [p.name for p in tmp_path.iterdir()] == ["outputs"] and not any((tmp_path / "outputs").iterdir())


def test_unwritable_cache_dir_fails_before_any_work(tmp_path) -> None:
    """index.cache_dir is written after the first encode: a folder that cannot be created is refused up front."""
    from ragtrain.config import to_typed
    from ragtrain.pipeline.stages import run
    from tests.conftest import compose, tiny_overrides

    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = to_typed(compose(tiny_overrides(tmp_path) + [f"index.cache_dir={blocker / 'cache'}"]))
    with pytest.raises(
        ConfigError, match=r"index.cache_dir='.*/file/cache' is not writable .*choose another index.cache_dir"
    ):
        run(cfg)
    assert not (tmp_path / "out" / "config.yaml").exists()  # nothing of a run was written


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "data.prepare=cluster",
            r"data.prepare=cluster; Invalid value 'cluster', expected one of \[auto, driver, ray\]$",
        ),
        ("data.foo=1", r"Could not override 'data.foo'.*Key 'foo' not in 'DataConfig'$"),
        ("sync=nope", r"Could not find 'sync/nope'; valid choices: async_ps, ddp, .*vector_avg$"),
    ],
)
def test_an_override_hydra_cannot_merge_is_one_line_and_exit_2(override, message, capsys, monkeypatch) -> None:
    """Before @hydra.main: Hydra itself would print a multi-line report and exit 1."""
    from ragtrain.__main__ import check_overrides

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as e:
        check_overrides(["data=documents", "data.root=/tmp", override])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("config error: ")
    assert re.search(message, err.strip())
    check_overrides(["experiment=quickstart", "retriever.train.lr=1e-3"])  # good overrides pass silently
    assert capsys.readouterr().err == ""


def test_a_sweep_folder_that_is_not_hydras_is_kept(tmp_path, monkeypatch) -> None:
    """remove_sweep_folder never removes the cwd, nor a job folder without Hydra's .hydra/ (a user's own logs)."""
    import ragtrain.__main__ as cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "notes.log").write_text("mine")
    (tmp_path / "multirun.yaml").write_text("x")
    cli.remove_sweep_folder(tmp_path / "0", tmp_path)  # hydra.sweep.dir=.
    assert (tmp_path / "0" / "notes.log").exists() and (tmp_path / "multirun.yaml").exists()
    sweep = tmp_path / "multirun" / "d" / "t"
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "notes.log").write_text("mine")
    (sweep / "multirun.yaml").write_text("x")
    cli.remove_sweep_folder(sweep / "0", sweep)
    assert (sweep / "0" / "notes.log").exists()
    (sweep / "0" / ".hydra").mkdir()
    (sweep / "0" / "notes.log").unlink()
    cli.remove_sweep_folder(sweep / "0", sweep)  # Hydra's job folder: removed, then the sweep's and its parents
    assert not (tmp_path / "multirun").exists() and (tmp_path / "0" / "notes.log").exists()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("refresh.every_steps=5",), r"refresh.every_steps applies only with refresh.enabled=true"),
        (("refresh.probe_queries=8",), r"refresh.probe_queries applies only with refresh.enabled=true"),
        (
            ("stages=[index]", "refresh.enabled=true", "refresh.every_steps=5"),
            r"refresh.enabled refreshes the index during retriever training \(or joint training with "
            r"joint.passage_encoder=trained\), and stages \['index'\] train no passage encoder",
        ),
        (("stages=[index,index]",), r"stages lists \['index'\] more than once"),
        (
            ("stages=[index,retriever]",),
            r"stages must be in the order the pipeline runs them "
            r"\(retriever -> index -> joint -> generator\): write \['retriever', 'index'\]",
        ),
    ],
)
def test_settings_that_would_be_ignored_or_misread_are_refused(tmp_path, overrides: tuple, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, *overrides)


def test_refresh_settings_of_a_variant_that_enables_refresh_compose(tmp_path) -> None:
    """scifact_refresh sets the schedule in the one variant that refreshes: the others carry no refresh keys."""
    from ragtrain.config.variants import override_variants

    variants = override_variants(compose(["experiment=scifact_refresh", f"output_dir={tmp_path}"]))
    assert variants["live_refresh"].refresh.every_steps == 15 and variants["in_batch"].refresh.every_steps == 0


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ("sync=gossip", "resources.trainer.num_workers=1"),
            "sync=gossip is a no-op with resources.trainer.num_workers=1",
        ),
        (
            ("sync=async_ps", "resources.trainer.num_workers=1"),
            "sync=async_ps is a no-op with resources.trainer.num_workers=1",
        ),
        (("data.split=train",), "data.split=train: the figures are measured on the training queries"),
    ],
)
def test_legal_settings_that_do_less_than_they_seem_warn(tmp_path, overrides: tuple, line: str) -> None:
    from ragtrain.config import ineffective_settings

    assert any(w.startswith(line) for w in ineffective_settings(_cfg(tmp_path, *overrides)))
    assert ineffective_settings(_cfg(tmp_path)) == []  # the quickstart itself: nothing to say


def test_cli_stage_order_error_is_one_line_and_exit_2(tmp_path) -> None:
    r = _cli(tmp_path, "stages=[index,retriever]")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("config error: stages must be in the order")
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_lora_target_modules_the_model_lacks_fail_before_any_work(tmp_path) -> None:
    """PEFT would refuse them in every trainer worker after the zero-shot encode: the driver checks them first."""
    from ragtrain.retriever.lora import check_lora_targets

    cfg = _cfg(tmp_path, "retriever.lora.rank=4", "retriever.lora.target_modules=[query,no_such_module]")
    with pytest.raises(
        ConfigError,
        match=r"retriever.lora.target_modules names \['no_such_module'\], which this model "
        r"\(tiny\) has no Linear layer for; valid module names: \[.*'query'.*\]",
    ):
        check_lora_targets(cfg.retriever)
    check_lora_targets(_cfg(tmp_path, "retriever.lora.rank=4", "retriever.lora.target_modules=[query,value]").retriever)
    from ragtrain.pipeline.stages import run

    with pytest.raises(ConfigError, match=r"retriever.lora.target_modules names \['no_such_module'\]"):
        run(_cfg(tmp_path, "retriever.lora.rank=4", "retriever.lora.target_modules=[no_such_module]"))
    assert not (tmp_path / "out").exists()  # before the data were read: nothing left


def test_an_output_dir_inside_data_root_is_refused(tmp_path) -> None:
    """The next run on that root would read this run's outputs (corpus/, logs, exports) as documents."""
    root = tmp_path / "docs"
    root.mkdir()
    (root / "a.txt").write_text("A document.")
    over = [
        "experiment=docs_quickstart",
        "retriever=tiny",
        f"data.root={root}",
        "data.generate=false",
        f"logger.tracking_uri=sqlite:///{tmp_path / 'm.db'}",
    ]
    with pytest.raises(ConfigError, match=r"output_dir is inside data.root \(.*docs\): the next run on that root"):
        to_typed(compose([*over, f"output_dir={root / 'runs' / 'one'}"]))
    assert to_typed(compose([*over, f"output_dir={tmp_path / 'out'}"])).output_dir == str(tmp_path / "out")


def test_a_sqlite_store_that_is_a_folder_or_cannot_be_created_fails_in_one_line(tmp_path) -> None:
    """An OperationalError / FileNotFoundError traceback after the data were prepared, the run left 'running'."""
    from ragtrain.track.mlflow import check_tracking_uri

    (tmp_path / "m.db").mkdir()
    with pytest.raises(ConfigError, match=r"m.db is a folder, not a database file; name a file in it"):
        check_tracking_uri(f"sqlite:///{tmp_path / 'm.db'}")
    with pytest.raises(ConfigError, match=r"sqlite:////proc/x/m.db'\: nothing can be created in /proc"):
        check_tracking_uri("sqlite:////proc/x/m.db")


def test_a_sweep_probes_its_tracking_store_before_anything_starts(tmp_path) -> None:
    from ragtrain.tune.sweep import plan_sweep
    from tests.conftest import CONF_DIR

    cfg = to_typed(
        compose(
            [
                "experiment=quickstart",
                *tiny_overrides(tmp_path),
                "tune=sync_sweep",
                "logger.tracking_uri=sqlite:////proc/x/m.db",
            ]
        )
    )
    with pytest.raises(ConfigError, match=r"nothing can be created in /proc"):
        plan_sweep(cfg, CONF_DIR)


def test_experiment_name_is_one_folder_name(tmp_path) -> None:
    for bad in ("../../tmp/escaped", "/tmp/escaped", "a//b"):
        with pytest.raises(ConfigError, match=r"experiment_name must name a folder below outputs/ .* got "):
            _cfg(tmp_path, f"experiment_name={bad}")
    assert _cfg(tmp_path, "experiment_name=sweeps/lr 1e-4").experiment_name == "sweeps/lr 1e-4"  # nested: inside
    from ragtrain.commands.compare import folder_name

    assert folder_name("../../../../tmp/escaped") == "tmp_escaped"
    assert folder_name("..") == "experiment" and folder_name("sweep-test") == "sweep-test"


def _copy_of_finished_run(quickstart_run, tmp_path: Path) -> tuple:
    import shutil

    cfg, _, _ = quickstart_run
    copy = tmp_path / "run"
    shutil.copytree(cfg.output_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "ray"))
    return cfg, copy, {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}


def _unchanged(copy: Path, before: dict) -> None:
    now = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    assert now.keys() == before.keys() and all(now[p] == before[p] for p in before)


def test_a_new_run_into_a_finished_runs_folder_is_refused(quickstart_run, tmp_path) -> None:
    """It silently replaced the finished run's metrics.json, index and exports."""
    from dataclasses import replace

    from ragtrain.pipeline.stages import check_fresh_output, run

    cfg, copy, before = _copy_of_finished_run(quickstart_run, tmp_path)
    with pytest.raises(
        ConfigError,
        match=rf"output_dir='{copy}' holds a complete run \(.*status.json\): a new run "
        "would replace its results; .* or replace it with overwrite=true",
    ):
        run(replace(cfg, output_dir=str(copy)))
    _unchanged(copy, before)
    check_fresh_output(replace(cfg, output_dir=str(copy), overwrite=True))  # asked for: allowed


@pytest.mark.parametrize("case", ["another_store", "misspelled_key"])
def test_a_resume_checks_everything_before_touching_the_folder(quickstart_run, tmp_path, case: str) -> None:
    """resume=true under another tracking store failed with MlflowException after rewriting corpus/ and config.yaml
    and leaving status.json 'running'; a misspelled resume_allow_changes key was accepted."""
    from dataclasses import replace

    from ragtrain.pipeline.stages import run

    cfg, copy, before = _copy_of_finished_run(quickstart_run, tmp_path)
    allow = ["output_dir", "logger.tracking_uri"] if case == "another_store" else ["output_dir", "retriever.trian"]
    other = f"sqlite:///{tmp_path / 'other' / 'mlflow.db'}" if case == "another_store" else cfg.logger.tracking_uri
    resumed = replace(
        cfg,
        output_dir=str(copy),
        resume=True,
        resume_allow_changes=allow,
        logger=replace(cfg.logger, tracking_uri=other),
    )
    match = (
        r"resume=true: the MLflow run \w+ of .*run \(.*mlflow_run_id\) is not in logger.tracking_uri=.*other"
        if case == "another_store"
        else r"resume_allow_changes names \['retriever.trian'\], which are not config"
    )
    with pytest.raises(ConfigError, match=match):
        run(resumed)
    _unchanged(copy, before)


def test_cli_a_broken_tracking_store_is_one_line_before_any_work(tmp_path) -> None:
    """A garbage SQLite file passed the checks and failed 25-45 s later with an 85-line traceback."""
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(bytes(range(256)) * 40)
    # a factory no 24-entity corpus can train: the run's first check of its data would fail here, in seconds
    r = _cli(tmp_path, f"logger.tracking_uri=sqlite:///{garbage}", "index.factory='IVF4096,Flat'")
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: logger.tracking_uri") and f"{garbage} cannot be used as an MLflow" in last
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_a_store_that_fails_once_the_run_folder_exists_marks_it_failed(ray_session, tmp_path) -> None:
    """A store MLflow refuses only when it opens it (a schema from another MLflow version) left the folder
    'running' for good, so the next run there was refused; now the folder says failed and the next run may go."""
    import json
    import sqlite3

    from ragtrain.pipeline.stages import check_fresh_output, run
    from ragtrain.runtime.run_lock import LOCK_FILE

    cfg = _cfg(tmp_path, "stages=[index]")
    db = Path(cfg.logger.tracking_uri.removeprefix("sqlite:///"))
    con = sqlite3.connect(db)
    con.execute("UPDATE alembic_version SET version_num = '0000future'")
    con.commit()
    con.close()
    with pytest.raises(
        ConfigError, match=r"logger.tracking_uri=.* MLflow cannot open the store \(Detected out-of-date"
    ):
        run(cfg)
    out = Path(cfg.output_dir)
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "failed" and "out-of-date database schema" in status["error"]
    assert not (out / LOCK_FILE).exists()
    check_fresh_output(cfg)  # a failed run's folder may be reused


def _shard_lost() -> None:
    from ragtrain.index.sharded import ShardUnavailableError

    raise ShardUnavailableError("index shard 2 did not answer within 5s (index.shard_timeout_s): it is restarting")


def test_store_errors_reach_a_cli_user_as_one_line(ray_session) -> None:
    """ShardUnavailableError (raised on the driver, or inside the refresh service's actor and re-raised by Ray with
    the actor's traceback in its text) is a store error: one `index error:` line, exit 2."""
    import ray

    from ragtrain.__main__ import error_line, user_errors
    from ragtrain.index.sharded import ShardUnavailableError

    want = "index error: index shard 2 did not answer within 5s (index.shard_timeout_s): it is restarting"
    try:
        _shard_lost()
    except user_errors() as e:
        assert error_line(e) == want
    try:
        ray.get(ray.remote(_shard_lost).remote())
    except user_errors() as e:  # a RayTaskError that is also a ShardUnavailableError
        assert isinstance(e, ShardUnavailableError) and len(str(e).splitlines()) > 1  # the remote traceback
        assert error_line(e) == want


def test_index_shards_on_gpus_are_checked_beside_the_trainer() -> None:
    """index.device=cuda: the shards hold their GPU share for the whole run, so the trainer's GPUs must fit beside."""
    from ragtrain.cluster.resources import InfeasibleResourcesError, check_config
    from ragtrain.config.resources import PoolResources, ResourcesConfig, TrainerResources

    res = ResourcesConfig(
        trainer=TrainerResources(num_workers=1, cpus_per_worker=4, use_gpu=True),
        pool=PoolResources(num_actors=2, cpus_per_actor=2),
    )
    one_gpu = [{"CPU": 16.0, "GPU": 1.0}]
    check_config(res, nodes=one_gpu)  # CPU shards: the trainer has the GPU
    with pytest.raises(
        InfeasibleResourcesError, match=r"resources.trainer beside the index shards' GPUs .*index.device=cpu"
    ):
        check_config(res, nodes=one_gpu, shard_gpus=(2, 0.5))
    check_config(res, nodes=[{"CPU": 16.0, "GPU": 2.0}], shard_gpus=(2, 0.5))  # 1 GPU for the shards, 1 to train
    half = replace(res, trainer=replace(res.trainer, gpus_per_worker=0.5))
    check_config(half, nodes=one_gpu, shard_gpus=(2, 0.25))  # one GPU shared: half to train, a quarter per shard
    with pytest.raises(InfeasibleResourcesError, match=r"index.device=cuda: 3 index shards x index.gpus_per_shard=1"):
        check_config(res, nodes=[{"CPU": 16.0, "GPU": 2.0}], shard_gpus=(3, 1.0))


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("index.device=tpu", r"index.device must be one of \['cpu', 'cuda'\], got 'tpu'"),
        ("index.gpus_per_shard=0", r"index.gpus_per_shard must be a fraction of one GPU in \(0, 1\]"),
        ("resources.trainer.gpus_per_worker=1.5", r"resources.trainer.gpus_per_worker must be a fraction of one GPU"),
        (
            "resources.trainer.gpus_per_worker=0.5",  # quickstart: 2 workers
            r"resources.trainer.gpus_per_worker below 1 could put two of the 2 NCCL ranks on one GPU",
        ),
    ],
)
def test_index_device_settings_name_the_key(tmp_path, override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, override)


def test_index_device_cuda_with_a_cpu_faiss_is_one_line_and_exit_2(tmp_path) -> None:
    """The CPU build of FAISS (faiss-cpu) cannot hold an index on a GPU: the line says to install the gpu extra."""
    from ragtrain.index.faiss_index import faiss_gpu_support

    if faiss_gpu_support():
        pytest.skip("this faiss has GPU support (tests/index/test_faiss_index.py covers the messages)")
    r = _cli(tmp_path, "index.device=cuda")
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: index.device=cuda needs FAISS with GPU support"), last
    assert "pip install -e .[gpu]" in last and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "config.yaml").exists()
