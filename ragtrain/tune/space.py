"""`tune.space` (YAML) -> a Ray Tune search space; every key and every reachable value is checked before a sweep.

A space maps a dotted config key to one domain, e.g.

    space:
      sync: {grid: [ddp, local_sgd, powersgd]}       # a conf/sync option: merged into `sync` like sync_variants
      retriever.train.lr: {loguniform: [1e-4, 1e-2]}
      sync.mixer.period: {choice: [4, 8]}             # after the sync option (it wins); skipped where unread

Nested mappings (`retriever: {train: {lr: {...}}}`, what a Hydra override `+tune.space.retriever.train.lr=...`
produces) are flattened to the same dotted keys.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ragtrain.config import Config, to_typed
from ragtrain.config.sync import MIXERS, REDUCERS
from ragtrain.config.tune import TUNE_SEARCHERS
from ragtrain.config.variants import with_sync_preset
from ragtrain.runtime.errors import ConfigError

DOMAINS = ("choice", "grid", "uniform", "loguniform", "randint")
SYNC_KEY = "sync"  # the whole sync group: values are conf/sync option names
# Keys a trial may not change: the sweep sets them per trial (output_dir, run name) or they must be shared by
# every trial (tracking server, experiment), or they belong to the sweep itself.
FIXED_PREFIXES = ("tune", "resume", "output_dir", "logger", "compare")


@dataclass(frozen=True)
class Param:
    """One swept config key: `kind` is one of DOMAINS, `args` its list (values, or [low, high])."""

    key: str
    kind: str
    args: tuple


def _is_domain(node: Any) -> bool:
    return isinstance(node, Mapping) and len(node) == 1 and next(iter(node)) in DOMAINS


def parse_space(space: Mapping[str, Any]) -> list[Param]:
    """Flatten tune.space into one Param per key, checking each domain's shape (not yet the keys)."""
    out: list[Param] = []

    def walk(prefix: str, node: Any) -> None:
        if _is_domain(node):
            kind, args = next(iter(node.items()))
            out.append(_param(prefix, kind, args))
        elif isinstance(node, Mapping) and node:
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            raise ConfigError(
                f"tune.space['{prefix}'] must be a mapping {{kind: [...]}} with kind one of {list(DOMAINS)}, got "
                f"{node!r}"
            )

    walk("", OmegaConf.to_container(space) if OmegaConf.is_config(space) else space)
    keys = [p.key for p in out]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ConfigError(f"tune.space sets {dup} twice")
    return out


def _param(key: str, kind: str, args: Any) -> Param:
    where = f"tune.space['{key}'].{kind}"
    if not isinstance(args, (list, tuple)) or not args:
        raise ConfigError(f"{where} must be a non-empty list, got {args!r}")
    args = tuple(args)
    if kind in ("uniform", "loguniform", "randint"):
        if len(args) != 2:
            raise ConfigError(f"{where} must be [low, high], got {list(args)}")
        try:
            lo, hi = (int(a) for a in args) if kind == "randint" else (float(a) for a in args)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} bounds must be numbers, got {list(args)}") from None
        if kind == "randint" and any(float(a) != int(a) for a in args):
            raise ConfigError(f"{where} bounds must be integers, got {list(args)}")
        if not lo < hi:
            raise ConfigError(f"{where} needs low < high, got {list(args)}")
        if kind == "loguniform" and lo <= 0:
            raise ConfigError(f"{where} needs low > 0, got {list(args)}")
        args = (lo, hi)
    return Param(key, kind, args)


def _unwrap(tp: Any) -> Any:
    """Optional[X] -> X."""
    if typing.get_origin(tp) is typing.Union:
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


def check_key(key: str) -> None:
    """Raise ConfigError unless `key` names a field of the typed schema (or a key of a dict-typed field)."""
    if key == SYNC_KEY:
        return
    parts = key.split(".")
    if parts[0] in FIXED_PREFIXES:
        raise ConfigError(f"tune.space cannot sweep '{key}': {parts[0]} is set by the sweep and shared by every trial")
    node: Any = Config
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(node)
        names = [f.name for f in dataclasses.fields(node)]
        if part not in names:
            at = ".".join(parts[:i]) or "the root"
            raise ConfigError(f"tune.space has unknown config key '{key}' (no '{part}' under {at}; valid: {names})")
        tp = _unwrap(hints[part])
        last = i == len(parts) - 1
        if dataclasses.is_dataclass(tp):
            if last:
                raise ConfigError(f"tune.space key '{key}' is a config group, not a value: sweep one of its keys")
            node = tp
        elif typing.get_origin(tp) is dict:
            if len(parts) - i > 2:
                raise ConfigError(
                    f"tune.space has unknown config key '{key}' ({'.'.join(parts[: i + 1])} is a flat mapping)"
                )
            return
        elif not last:
            raise ConfigError(f"tune.space has unknown config key '{key}' ({'.'.join(parts[: i + 1])} is a value)")


def as_dict(node: Any) -> dict[str, Any]:
    """A mapping config node (a structured config, a YAML file's top level) as a plain dict."""
    data = OmegaConf.to_container(node, enum_to_str=True)
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping, got {type(data).__name__}: {data!r}")
    return {str(k): v for k, v in data.items()}


def sync_options(conf_dir: str | Path) -> dict[str, dict]:
    """Every conf/sync option: name -> its YAML as a plain dict."""
    return {p.stem: as_dict(OmegaConf.load(p)) for p in sorted(Path(conf_dir, "sync").glob("*.yaml"))}


def candidates(p: Param) -> list:
    """The values of a domain that are checked up front: every listed value, or both bounds of a range."""
    if p.kind in ("choice", "grid"):
        return list(p.args)
    lo, hi = p.args
    return [lo, hi - 1] if p.kind == "randint" else [lo, hi]


def _plain(v: Any) -> Any:
    """numpy scalars (Tune samples them) -> Python scalars (OmegaConf accepts only those)."""
    return v.item() if hasattr(v, "item") and not isinstance(v, (list, dict, str)) else v


def _read_by_option(node: Any, key: str) -> bool:
    """Whether the trial's sync option reads `key`: a sync.reducer.* / sync.mixer.* key belongs to some kinds only
    (what ragtrain.config's REDUCERS / MIXERS registries say each reads); the other keys are always read."""
    part, _, field = key.partition(".")[2].partition(".")
    if not key.startswith("sync.") or part not in ("reducer", "mixer") or field == "kind":
        return True
    registry = REDUCERS if part == "reducer" else MIXERS
    owners = [kind for kind, variant in registry.items() if field in variant.reads]
    return not owners or node.sync[part].kind in owners


def apply(base: Mapping[str, Any], values: Mapping[str, Any], sync_opts: Mapping[str, dict]) -> Config:
    """The typed config of one trial: `base` with the sync option merged into `sync`, then every other key set."""
    # merged into the structured root: a DictConfig (OmegaConf.merge is annotated with ListConfig too)
    node = cast(DictConfig, OmegaConf.merge(OmegaConf.structured(Config), copy.deepcopy(dict(base))))
    try:
        if SYNC_KEY in values:
            name = values[SYNC_KEY]
            if name not in sync_opts:
                raise ConfigError(
                    f"tune.space['sync'] has unknown sync option {name!r}; valid choices: {sorted(sync_opts)}"
                )
            node.sync = with_sync_preset(node.sync, sync_opts[name])  # like sync_variants: keeps measurement keys
        for key in sorted(k for k in values if k != SYNC_KEY):
            if not _read_by_option(node, key):
                continue  # a conditional space: e.g. sync.mixer.period is a knob of local_sgd's trials only
            OmegaConf.update(node, key, _plain(values[key]), merge=False)
    except OmegaConfBaseException as e:
        raise ConfigError(
            f"tune.space: {values} does not fit the schema: {e.msg if hasattr(e, 'msg') else e}"
        ) from None
    return to_typed(node)


def validate(
    params: list[Param], base: Mapping[str, Any], sync_opts: Mapping[str, dict], searcher: str
) -> list[Config]:
    """Check every key and every listed value / range bound against the schema; returns those configs."""
    out = []
    for p in params:
        check_key(p.key)
        if p.key == SYNC_KEY and p.kind not in ("choice", "grid"):
            raise ConfigError(f"tune.space['sync'] takes choice or grid of conf/sync option names, got {p.kind}")
        if p.kind == "grid" and not TUNE_SEARCHERS[searcher].grid:
            raise ConfigError(
                f"tune.space['{p.key}'] uses grid, which tune.searcher={searcher} cannot sample: use choice"
            )
        for v in candidates(p):
            try:
                out.append(apply(base, {**_reader(p.key, params, base, sync_opts), p.key: v}, sync_opts))
            except ConfigError as e:
                msg = str(e)
                raise ConfigError(
                    msg if msg.startswith("tune.space") else f"tune.space['{p.key}'] value {v!r}: {msg}"
                ) from None
    return out


def _reader(key: str, params: list[Param], base: Mapping[str, Any], sync_opts: Mapping[str, dict]) -> dict:
    """{} for most keys; for a sync.reducer.* / sync.mixer.* key, a swept sync option that reads it (so its values
    are checked there), or a ConfigError when no reachable sync option reads it (it would never apply)."""
    if _read_by_option(OmegaConf.merge(OmegaConf.structured(Config), copy.deepcopy(dict(base))), key):
        return {}
    swept = [v for p in params if p.key == SYNC_KEY for v in candidates(p)]
    for name in swept:
        if name in sync_opts:
            node = OmegaConf.merge(OmegaConf.structured(Config), copy.deepcopy(dict(base)))
            node.sync = with_sync_preset(node.sync, sync_opts[name])
            if _read_by_option(node, key):
                return {SYNC_KEY: name}
    raise ConfigError(
        f"tune.space['{key}'] is read by none of the sync options the sweep reaches "
        f"({swept or 'the base config only'}): sweep a sync option whose kind reads it"
    )


def to_tune(params: list[Param]) -> dict[str, Any]:
    """Tune's param_space: one flat entry per key (dotted keys are plain strings to Tune and Optuna)."""
    from ray import tune  # lazy: ray is heavy (~0.5 s); this module imports without it

    make = {
        "choice": lambda a: tune.choice(list(a)),
        "grid": lambda a: tune.grid_search(list(a)),
        "uniform": lambda a: tune.uniform(*a),
        "loguniform": lambda a: tune.loguniform(*a),
        "randint": lambda a: tune.randint(*a),
    }
    return {p.key: make[p.kind](p.args) for p in params}


def worst_case(params: list[Param], base: Mapping[str, Any], sync_opts: Mapping[str, dict]) -> Config:
    """The base config with every swept `resources.*` number at its largest value: the biggest trial."""
    values: dict[str, Any] = {}
    for p in params:
        if p.key.startswith("resources."):
            nums = [v for v in candidates(p) if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if nums:
                values[p.key] = max(nums)
            elif p.kind in ("choice", "grid") and True in p.args:
                values[p.key] = True  # use_gpu: the GPU variant is the bigger one
    return apply(base, values, sync_opts)


def short(key: str, value: Any) -> str:
    """`retriever.train.lr=0.0003`-style label part: the last key component and a compact value."""
    name = key.rsplit(".", 1)[-1]
    if isinstance(value, float) and value != 0 and math.isfinite(value):
        value = f"{value:.3g}"
    return f"{name}={value}" if key != SYNC_KEY else str(value)


def describe(values: Mapping[str, Any], order: list[str] | None = None) -> str:
    """A trial's sampled values in one line (sync option first)."""
    keys = order or sorted(values, key=lambda k: (k != SYNC_KEY, k))
    return " ".join(short(k, _plain(values[k])) for k in keys if k in values)
