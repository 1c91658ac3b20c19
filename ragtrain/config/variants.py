"""The runs one composed config expands into: `compare.strategies` (one conf/sync option each) and
`compare.variants` (named lists of overrides, optionally once per seed), each typed and checked as a run."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from ragtrain.config import Config, check_ascii_numbers, to_typed
from ragtrain.config.sync import SyncConfig
from ragtrain.runtime.errors import ConfigError


def with_sync_preset(sync: Any, preset: Any) -> DictConfig:
    """`sync` with a conf/sync preset's composition: reducer, mixer, scope and consensus come from the preset alone
    (a merge would keep the previous preset's keys, e.g. reducer.matrix_rank under reducer.kind=topk); the
    measurement keys (probe_passages, eval_every, bucket_cap_mb) keep `sync`'s values."""
    base = OmegaConf.structured(SyncConfig)
    for key in ("bucket_cap_mb", "probe_passages", "eval_every"):
        base[key] = sync[key]
    return cast(DictConfig, OmegaConf.merge(base, preset))  # merged into a structured config: a DictConfig


def sync_variants(cfg: DictConfig, conf_dir: str) -> dict[str, Config]:
    """One typed config per `compare.strategies` entry: conf/sync/<name>.yaml replaces the sync group."""
    out: dict[str, Config] = {}
    choices = sorted(p.stem for p in Path(conf_dir, "sync").glob("*.yaml"))
    for i, name in enumerate(cfg.compare.strategies):
        path = Path(conf_dir, "sync", f"{name}.yaml")
        if not path.exists():
            raise ConfigError(f"compare.strategies has unknown sync option {name!r}; valid choices: {choices}")
        variant = copy.deepcopy(cfg)
        variant.sync = with_sync_preset(
            cfg.sync, OmegaConf.load(path)
        )  # keeps e.g. sync.eval_every set by the experiment
        variant.compare.strategies = []
        variant.output_dir = str(Path(cfg.output_dir, name))
        variant.logger.run_name = f"{cfg.experiment_name}/{name}"
        variant.zeroshot_eval = bool(cfg.zeroshot_eval) and i == 0  # the zero-shot figure is the same for all
        out[name] = to_typed(variant)
    return out


def override_variants(cfg: DictConfig) -> dict[str, Config]:
    """One typed config per `compare.variants` entry: its `key=value` overrides merged into the composed config."""
    named = dict(cfg.compare.variants)
    unknown = [n for n in cfg.compare.only if n not in named]
    if unknown:
        raise ConfigError(f"compare.only names {unknown}, which are not variants: choose from {list(named)}")
    chosen = {n: named[n] for n in cfg.compare.only} if cfg.compare.only else named
    seeds: list[int | None] = [int(x) for x in cfg.compare.seeds]  # None: the variant's own seed
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"compare.seeds={seeds} repeats a seed: each seed is run once per variant")
    out: dict[str, Config] = {}
    for i, (name, overrides) in enumerate(chosen.items()):
        variant = copy.deepcopy(cfg)
        for item in overrides:
            key, sep, value = str(item).partition("=")
            if not sep:
                raise ConfigError(f"compare.variants.{name} has {item!r}: each entry must be key=value")
            if not _has_key(cfg, key):
                raise ConfigError(f"compare.variants.{name} sets unknown config key {key!r}")
            OmegaConf.update(variant, key, OmegaConf.from_dotlist([f"v={value}"]).v, merge=True)
            check_ascii_numbers(variant, [str(item)], f"compare.variants.{name}: ")
            field = key.removeprefix("resources.")
            if key in SESSION_KEYS and variant.resources[field] != cfg.resources[field]:
                # the first variant starts the local Ray that every later one joins: its own value would be ignored
                raise ConfigError(
                    f"compare.variants.{name} sets {item!r}, but every variant runs in the one Ray session the "
                    f"first starts ({key}={cfg.resources[field]}): set {key} outside compare.variants"
                )
        variant.compare.variants, variant.compare.only, variant.compare.seeds = {}, [], []
        variant.zeroshot_eval = bool(cfg.zeroshot_eval) and i == 0  # the zero-shot figure is the same for all
        for seed in seeds or [None]:
            each = copy.deepcopy(variant)
            label = name if seed is None else f"{name}{SEED_MARK}{seed}"
            folder = Path(cfg.output_dir, name)
            each.output_dir = str(folder if seed is None else folder / f"seed{seed}")
            each.logger.run_name = f"{cfg.experiment_name}/{label}"
            if seed is not None:  # every training seed, not the data's: the same split and eval sample per seed
                for key in SEEDED:
                    OmegaConf.update(each, key, seed, merge=True)
                each.zeroshot_eval = variant.zeroshot_eval and seed == seeds[0]
            out[label] = to_typed(each)
    return out


SESSION_KEYS = ("resources.num_cpus", "resources.dashboard")  # settings of the local Ray that variants share
SEEDED = ("seed", "retriever.train.seed", "generator.train.seed", "joint.seed")  # what compare.seeds sets
SEED_MARK = "/seed="  # a variant's label when compare.seeds repeats it: `frozen/seed=1`


def _has_key(cfg: DictConfig, dotted: str) -> bool:
    """Whether a dotted key exists in the config (its value may be None)."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node[part]
    return True
