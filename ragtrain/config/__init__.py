"""Typed configuration schema: the root `Config`, registered in Hydra's ConfigStore, and how a composed config
becomes it.

`conf/config.yaml` starts its defaults list with `ragtrain_schema`, so every YAML file and command-line
override is merged into these dataclasses: an unknown key or a value of the wrong type fails at compose time,
and `to_typed()` runs the range checks before any work starts. Each group is its own module, with its range checks
(data.py, retriever.py, index.py, resources.py, logger.py, sync.py, generator.py, joint.py, tune.py); the checks
across groups are the functions in CROSS_CHECKS below. Workers receive the typed object that `to_typed()` returns
(interpolations resolved on the driver), never a Hydra config.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from ragtrain.config.data import DataConfig
from ragtrain.config.generator import GeneratorConfig
from ragtrain.config.index import IndexConfig, RefreshConfig
from ragtrain.config.joint import JointConfig, PassageEncoder
from ragtrain.config.logger import LoggerConfig
from ragtrain.config.resources import ResourcesConfig
from ragtrain.config.retriever import RetrieverConfig
from ragtrain.config.sync import SyncConfig
from ragtrain.config.tune import TuneConfig
from ragtrain.runtime.errors import ConfigError, driver_path, local_model
from ragtrain.runtime.errors import check as _check


@dataclass
class CheckpointConfig:
    """Retriever and joint training checkpoints (ragtrain/train/checkpoint.py): all it takes to continue exactly."""

    every_steps: int = 0  # 0 = only the final checkpoint
    keep: int = 2  # checkpoints kept in the run's storage path

    def __post_init__(self) -> None:
        _check(self.every_steps >= 0, "checkpoint.every_steps", "must be >= 0", self.every_steps)
        _check(self.keep > 0, "checkpoint.keep", "must be > 0", self.keep)


@dataclass
class FaultConfig:
    """Worker-failure handling, and fault injection for testing it."""

    max_failures: int = 0  # Ray Train restarts the worker group from the latest checkpoint up to this many times
    kill_worker_at_step: int = 0  # > 0: rank `kill_rank` exits (os._exit) after this step, once per run
    kill_rank: int = 0
    kill_encode_actor_at_batch: int = -1  # >= 0: the Ray Data encode actor that reaches its batch N dies, once per run
    # >= 0: that index shard's first live refresh encode announces itself (its pid and the version, in
    # <output_dir>/shards/.faults/encoding-shard-<i>.json) and holds until that file is removed: a signal sent then
    # lands while the round is in flight (once per run)
    hold_shard_encode: int = -1
    # >= 0: under refresh.consistency=global, that index shard dies (os._exit) between the barrier and the apply of
    # the first round (once per run)
    kill_shard_before_apply: int = -1

    def __post_init__(self) -> None:
        _check(self.max_failures >= -1, "fault.max_failures", "must be >= 0 (or -1: unlimited)", self.max_failures)
        _check(self.kill_worker_at_step >= 0, "fault.kill_worker_at_step", "must be >= 0", self.kill_worker_at_step)
        _check(self.kill_rank >= 0, "fault.kill_rank", "must be >= 0", self.kill_rank)
        for key in ("hold_shard_encode", "kill_shard_before_apply"):
            _check(
                getattr(self, key) >= -1, "fault." + key, "must be a shard number >= 0 (or -1: off)", getattr(self, key)
            )


STAGES = ("retriever", "index", "joint", "generator")


@dataclass
class CompareConfig:
    # conf/sync options to run one after another on the same data (experiment=sync_compare); empty = one run
    strategies: list[str] = field(default_factory=list)
    # named variants, each a list of `key=value` overrides of this config (experiment=scifact_refresh)
    variants: dict[str, list[str]] = field(default_factory=dict)
    # run only these variants, in this order (e.g. compare.only=[full_global,partial_hot]); empty = every variant
    only: list[str] = field(default_factory=list)
    # run every variant once per seed, e.g. [0, 1]: each sets `seed`, retriever.train.seed, generator.train.seed and
    # joint.seed (data.seed stays: the same split and eval questions); the table gives each variant's mean and its
    # spread (min, max) over seeds. Empty = once
    seeds: list[int] = field(default_factory=list)


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    tune: TuneConfig | None = None  # set (tune=NAME): run a Ray Tune sweep instead of one run
    refresh: RefreshConfig = field(default_factory=RefreshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    joint: JointConfig = field(default_factory=JointConfig)
    experiment_name: str = "default"
    # retriever = train the bi-encoder; index = build the index with the final encoder and evaluate it
    stages: list[str] = field(default_factory=lambda: ["retriever", "index"])
    zeroshot_eval: bool = True  # with the retriever stage: also build + evaluate an index of the untrained encoder
    output_dir: str = "outputs/default"
    seed: int = 0
    resume: bool = False  # continue the run (tune: the sweep) in output_dir; finished trials are kept
    # keys (or whole groups, e.g. fault) that may differ from the resumed run's config.yaml; any other difference
    # is refused with the keys named
    resume_allow_changes: list[str] = field(default_factory=list)
    # write a new run into an output_dir that holds a finished or running one (its files are replaced); without it,
    # that is refused
    overwrite: bool = False
    # write <output_dir>/export (sentence-transformers retriever, transformers generator) and log them to MLflow
    export: bool = True
    # write <output_dir>/ray_timeline.json at the end: Ray's timeline of every task and actor method of the run
    # (open it in chrome://tracing or https://ui.perfetto.dev)
    profile: bool = False

    def __post_init__(self) -> None:
        """Checks across groups (each group checks its own keys): one ConfigError naming the key, before any work."""
        for check in CROSS_CHECKS:
            check(self)


# --- checks across groups: each a function of the whole config, run by Config.__post_init__


def check_paths(cfg: Config) -> None:
    # experiment_name names the run's folder (outputs/<experiment_name>/<time>): a folder below outputs/, never a
    # path out of it (`../../tmp/x`) nor an absolute one
    parts = cfg.experiment_name.replace("\\", "/").split("/")
    _check(
        bool(cfg.experiment_name.strip())
        and not cfg.experiment_name.startswith(("/", "~"))
        and ".." not in parts
        and "" not in parts,
        "experiment_name",
        "must name a folder below outputs/ (no absolute path, no '..' and no empty part)",
        cfg.experiment_name,
    )
    # the run renames folders, appends to logs and memory-maps stores: a POSIX filesystem, not a bucket URL
    _check(
        "://" not in cfg.output_dir,
        "output_dir",
        "must be a folder path (on a cluster: a shared POSIX filesystem such as NFS or EFS), not a URL",
        cfg.output_dir,
    )
    if cfg.data.root:  # a run writes corpus/, vectors/ and logs: a documents walk of the root would read them
        root, out = Path(cfg.data.root).resolve(), Path(cfg.output_dir).resolve()
        _check(
            not out.is_relative_to(root),
            "output_dir",
            f"is inside data.root ({root}): the next run on that "
            "root would read this run's outputs as its data; choose an output_dir outside data.root",
            cfg.output_dir,
        )


def check_stages(cfg: Config) -> None:
    bad = [s for s in cfg.stages if s not in STAGES]
    _check(not bad, "stages", f"has unknown stage(s) {bad}; valid choices: {list(STAGES)}", cfg.stages)
    twice = sorted({s for s in cfg.stages if cfg.stages.count(s) > 1})
    _check(not twice, "stages", f"lists {twice} more than once: each stage runs once", cfg.stages)
    # the pipeline runs its stages in one order, whatever the list says: a list in another order misleads
    in_order = [s for s in STAGES if s in cfg.stages]
    _check(
        list(cfg.stages) == in_order,
        "stages",
        f"must be in the order the pipeline runs them ({' -> '.join(STAGES)}): write {in_order}",
        cfg.stages,
    )
    _check(bool(cfg.stages), "stages", f"is empty: nothing to do; valid choices: {list(STAGES)}", cfg.stages)
    # the live refresh starts from this run's index build: a saved index has no vector files of its own here
    _check(
        "joint" not in cfg.stages or "index" in cfg.stages or cfg.joint.passage_encoder == PassageEncoder.frozen,
        "stages",
        f"{cfg.stages}: joint.passage_encoder=trained refreshes the run's own index: add the index stage "
        "(stages: [retriever, index, joint] or [index, joint])",
        cfg.stages,
    )
    # the joint stage fine-tunes and scores the generator itself; a generator stage after it would start again
    # from the untrained generator and retrieve from the pre-joint index, not the jointly trained retriever
    _check(
        not {"joint", "generator"} <= set(cfg.stages),
        "stages",
        "lists both joint and generator: the joint stage trains and evaluates the generator itself (closed-book, "
        "RAG and oracle EM; <output_dir>/joint/generator): use [index, joint] for joint training or [index, "
        "generator] for the generator alone",
        cfg.stages,
    )
    _check(
        not (cfg.data.chunk.enabled and "joint" in cfg.stages),
        "data.chunk.enabled",
        "is not supported with the joint stage yet (its gold contexts are whole passages)",
        True,
    )


def check_features(cfg: Config) -> None:
    """Settings that need another setting, or another stage."""
    _check(
        cfg.export or not cfg.logger.register_as,
        "logger.register_as",
        "needs export=true (the registered model is the exported retriever)",
        cfg.logger.register_as,
    )
    _check(
        not (cfg.data.chunk.enabled and "generator" in cfg.stages),
        "data.chunk.enabled",
        "is not supported with the generator stage yet (its gold contexts are whole passages)",
        True,
    )
    vector_avg = cfg.sync.strategy == "vector_avg" or "vector_avg" in cfg.compare.strategies
    # align_anchors maps the zero-shot index onto the trained index: both must be built, by one encoder
    _check(
        not cfg.index.align_anchors or {"retriever", "index"} <= set(cfg.stages),
        "index.align_anchors",
        f"needs stages [retriever, index] (it maps the zero-shot index onto the trained one; stages are "
        f"{cfg.stages}): add them or set it to 0",
        cfg.index.align_anchors,
    )
    _check(
        not cfg.index.align_anchors or cfg.sync.strategy != "vector_avg",
        "index.align_anchors",
        "does not apply to sync=vector_avg (its index holds consensus vectors, no single trained encoder): set it to 0",
        cfg.index.align_anchors,
    )
    # A restart resumes at a checkpoint with an empty loss window: at a window's end, the loss logged after a
    # restart is the uninterrupted run's; mid-window it would average only the steps since the checkpoint. The
    # retriever's and the joint stage's training read checkpoint.every_steps (a joint run without the retriever
    # stage is not held to the retriever's windows)
    every = cfg.checkpoint.every_steps
    windows = {"joint.log_every": cfg.joint.log_every} if "joint" in cfg.stages else {}
    if "retriever" in cfg.stages or not windows:
        windows["retriever.train.log_every"] = cfg.retriever.train.log_every
    for key, log_every in windows.items():
        _check(
            every % log_every == 0,
            "checkpoint.every_steps",
            f"must be 0 or a multiple of {key} ({log_every}), so a restarted run logs the same loss windows",
            every,
        )
    _check(
        not cfg.index.distill_steps or vector_avg,
        "index.distill_steps",
        "needs sync=vector_avg (the student learns the replicas' consensus vectors)",
        cfg.index.distill_steps,
    )


def check_teacher(cfg: Config) -> None:
    teacher = cfg.retriever.teacher
    if teacher.weight > 0:  # the teacher scores the mined candidates once: they must exist and stay fixed
        _check(
            "retriever" in cfg.stages,
            "retriever.teacher.weight",
            f"needs the retriever stage (stages are {cfg.stages})",
            teacher.weight,
        )
        _check(
            cfg.retriever.train.hard_negatives > 0,
            "retriever.teacher.weight",
            "needs retriever.train.hard_negatives > 0 (the teacher scores each query's mined negatives)",
            teacher.weight,
        )
        _check(
            not cfg.refresh.enabled,
            "retriever.teacher.weight",
            "does not work with refresh.enabled (the live index's negatives change; the teacher scored the "
            "zero-shot index's once): turn one off",
            teacher.weight,
        )


def check_refresh(cfg: Config) -> None:
    # refresh.* keys are read only by a live refresh during retriever training: otherwise they would be ignored
    changed = [k for k, v in vars(RefreshConfig()).items() if k != "enabled" and getattr(cfg.refresh, k) != v]
    _check(
        cfg.refresh.enabled or not changed,
        f"refresh.{changed[0] if changed else ''}",
        "applies only with refresh.enabled=true (the live index refresh is off): remove it or enable refresh",
        getattr(cfg.refresh, changed[0]) if changed else None,
    )
    joint_full = "joint" in cfg.stages and cfg.joint.passage_encoder == PassageEncoder.trained
    _check(
        not cfg.refresh.enabled or "retriever" in cfg.stages or joint_full,
        "refresh.enabled",
        f"refreshes the index "
        f"during retriever training (or joint training with joint.passage_encoder=trained), and stages "
        f"{cfg.stages} train no passage encoder: add the retriever stage or set refresh.enabled=false",
        cfg.refresh.enabled,
    )
    _check(
        not joint_full or cfg.refresh.enabled,
        "joint.passage_encoder",
        "changes the passage vectors while training: it needs the live refresh (refresh.enabled=true with "
        "refresh.every_steps > 0), or use joint.passage_encoder=frozen",
        "trained",
    )
    r, f = cfg.refresh, cfg.fault
    for key in ("hold_shard_encode", "kill_shard_before_apply"):  # the live refresh's fault hooks
        shard = getattr(f, key)
        _check(
            shard < 0 or r.enabled,
            f"fault.{key}",
            "acts on a live refresh round: it needs refresh.enabled=true",
            shard,
        )
        _check(
            shard < 0 or not cfg.index.shards.isdigit() or shard < int(cfg.index.shards),
            f"fault.{key}",
            f"names an index shard, and index.shards={cfg.index.shards} numbers them from 0",
            shard,
        )
    if r.enabled and r.fraction >= 1.0 and r.priority != RefreshConfig.priority:
        raise ConfigError(
            f"refresh.priority={r.priority} chooses the rows a partial refresh re-encodes, and "
            f"refresh.fraction={r.fraction} re-encodes every row each round: set refresh.fraction < 1 or "
            "remove refresh.priority"
        )


def check_compare(cfg: Config) -> None:
    c = cfg.compare
    hint = f"; to run a subset of compare.strategies, list it there: compare.strategies={c.strategies}"
    _check(
        not c.only or bool(c.variants),
        "compare.only",
        "picks among compare.variants, and this experiment has none (it would run everything)"
        + (hint if c.strategies else ""),
        c.only,
    )
    _check(
        not c.seeds or bool(c.variants),
        "compare.seeds",
        "repeats each of compare.variants once per seed, and this experiment has none (it would run once)",
        c.seeds,
    )


CROSS_CHECKS = (
    check_paths,
    check_stages,
    check_features,
    check_teacher,
    check_refresh,
    check_compare,
)  # Config.__post_init__ runs them in order


def ineffective_settings(cfg: Config) -> list[str]:
    """Settings that are legal but do less than they seem to (one warning line each, logged before any work)."""
    out = []
    if cfg.sync.strategy != "ddp" and cfg.resources.trainer.num_workers == 1 and "retriever" in cfg.stages:
        out.append(
            f"sync={cfg.sync.strategy} is a no-op with resources.trainer.num_workers=1: one replica has "
            "nothing to exchange (0 bytes sent); use 2 or more workers to compare sync strategies"
        )
    if cfg.data.split == "train":
        out.append(
            "data.split=train: the figures are measured on the training queries, not held-out ones "
            "(use dev or test to measure generalisation)"
        )
    return out


PROJECT_ROOT = Path(__file__).resolve().parents[2]  # the checkout (holds conf/); data paths are relative to it


def data_root() -> str:
    """`${ragtrain.data_root:}`: $RAGTRAIN_DATA, else ../shared/data; a relative one is taken from the project
    root, not the cwd, so a run composes the same paths wherever it is started."""
    return str((PROJECT_ROOT / os.environ.get("RAGTRAIN_DATA", "../shared/data")).resolve())


def register_resolvers() -> None:
    """`${ragtrain.project:}` (the checkout's absolute path) and `${ragtrain.data_root:}` for the conf files."""
    for name, fn in (("ragtrain.project", lambda: str(PROJECT_ROOT)), ("ragtrain.data_root", data_root)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def register_configs() -> None:
    """Register the schema so `conf/config.yaml` can extend it (defaults: `ragtrain_schema`), and the resolvers."""
    # lazy: hydra only registers the schemas; config checks (and Ray workers) import this module without it
    from hydra.core.config_store import ConfigStore

    register_resolvers()
    store = ConfigStore.instance()
    # once per process: storing converts the whole schema to OmegaConf again (about a third of a compose's CPU),
    # and the stored schema never changes
    if "ragtrain_schema.yaml" not in store.repo:
        store.store(name="ragtrain_schema", node=Config)


def _to_object(cfg: DictConfig, kind: type, expected: str | None = None) -> Any:
    """OmegaConf.to_object with our ConfigError surfaced unwrapped; the result must be a `kind`."""
    try:
        obj = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as e:  # omegaconf wraps __post_init__ errors; surface ours unwrapped
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise
    if not isinstance(obj, kind):
        raise ConfigError(f"config root is {type(obj).__name__}, expected {expected or kind.__name__}")
    return obj


# Config keys holding a user path that the typed config makes absolute (folders; models and tokenizers only when a
# local folder): a run or sweep saved before that wrote them as typed
PATH_KEYS = {
    "data.root": driver_path,
    "retriever.teacher.path": driver_path,
    "generator.retrieval.index_dir": driver_path,
    "retriever.model": local_model,
    "generator.model": local_model,
    "generator.tokenizer": local_model,
}


def absolute_paths(flat: dict[str, Any]) -> dict[str, Any]:
    """A saved flat config with its PATH_KEYS made absolute as the typed config makes them (resume compares it)."""
    unset = ("", "None")  # flatten() writes an unset value as "None"
    return {
        k: (PATH_KEYS[k](v) if k in PATH_KEYS and isinstance(v, str) and v not in unset else v) for k, v in flat.items()
    }


def unknown_keys(node: Any, obj: Any, prefix: str = "") -> list[str]:
    """Keys of the composed `node` that the typed `obj` has no field for (e.g. `+retriever.train.batch_sise=4`:
    Hydra adds it, and building the dataclass would silently drop it)."""
    if not dataclasses.is_dataclass(obj) or not isinstance(node, DictConfig):
        return []
    fields = {f.name for f in dataclasses.fields(obj)}
    out = []
    for key in node.keys():
        if key not in fields:
            out.append(prefix + str(key))
        else:
            out += unknown_keys(node._get_node(key), getattr(obj, key), f"{prefix}{key}.")
    return out


def check_ascii_numbers(cfg: DictConfig, overrides: Sequence[str], where: str = "") -> None:
    """A number typed with other digits than 0-9 is refused, naming its key: Python's int() and float() read any
    script's digits (`seed=١٢` and `seed=１２` are 12), so a slip of the input method would run unnoticed. Only
    numeric keys: a string may hold any script."""
    for item in overrides:
        key, sep, value = str(item).lstrip("+~").partition("=")
        if not sep or not has_non_ascii_digits(value):
            continue
        try:
            typed = OmegaConf.select(cfg, key.strip(), throw_on_missing=False)
        except Exception:  # an interpolation that does not resolve here: not a number this check can judge
            continue
        items = list(typed) if isinstance(typed, ListConfig) else [typed]
        if any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
            raise ConfigError(non_ascii_digits(f"{where}{key.strip()}", value, f" (Python reads it as {typed})"))


def non_ascii_digits(key: str, value: str, read_as: str = "") -> str:
    """The message for a number typed with digits other than 0-9."""
    shown = value.strip().strip("'\"")
    return f"{key}={shown!r} is written with digits other than 0-9{read_as}: type it with 0-9"


def has_non_ascii_digits(text: str) -> bool:
    return any(c.isdigit() and not c.isascii() for c in text)


def to_typed(cfg: DictConfig) -> Config:
    """Resolve interpolations (driver only) and build the typed config, running every range check."""
    typed = _to_object(cfg, Config, "the ragtrain schema (conf/config.yaml defaults)")
    extra = [k for k in unknown_keys(cfg, typed) if k != "hydra"]
    if extra:
        raise ConfigError(
            f"unknown config key(s) {extra}: not in the ragtrain schema, so they would be ignored "
            "(a '+key=value' override adds a key; check its spelling)"
        )
    return typed


def flatten(node: Any, prefix: str = "") -> dict[str, str]:
    """A nested config container (dicts of plain values) as dotted keys with string values."""
    if isinstance(node, dict):
        return {
            k: v
            for key, sub in node.items()
            for k, v in flatten(sub, f"{prefix}.{key}" if prefix else str(key)).items()
        }
    return {prefix: str(node.value if isinstance(node, Enum) else node)}


def changed_keys(before: dict[str, str], after: dict[str, str], allowed: Sequence[str] = ()) -> list[str]:
    """Dotted keys whose values differ between two flat configs, except `allowed` keys or groups (a prefix)."""
    return sorted(
        k
        for k in set(before) | set(after)
        if before.get(k) != after.get(k) and not any(k == a or k.startswith(a + ".") for a in allowed)
    )


def to_flat_dict(cfg: Config) -> dict[str, str]:
    """Flatten the typed config to dotted keys (for MLflow params)."""
    out = flatten(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))
    out["sync.strategy"], out["sync.label"] = (
        cfg.sync.strategy,
        cfg.sync.label,
    )  # derived, for tables (commands/compare.py)
    return out
