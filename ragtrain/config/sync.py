"""Typed sync configuration: a strategy is a gradient reducer + a parameter mixer + a scope (ragtrain/sync/composed.py).

Imported by ragtrain/config/__init__.py (the root schema re-exports every name), so this module imports nothing heavy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ragtrain.errors import ConfigError
from ragtrain.errors import check as _check

# --- sync: a strategy is a gradient REDUCER + a parameter MIXER + a SCOPE (ragtrain/sync/composed.py) ---
REDUCERS = ("none", "allreduce", "fp16", "bf16", "powersgd", "topk")
MIXERS = ("none", "average", "gossip", "async_ps")
REDUCER_SCOPES = ("all", "intra_node", "two_level")
MIXER_SCOPES = ("all", "inter_node")
CONSENSUS = ("params", "vectors")
GOSSIP_TOPOLOGIES = ("ring", "random")
# Which kind reads which key (a key set for a kind that does not read it is an error), and the defaults.
REDUCER_KEYS = {"powersgd": ("matrix_rank", "start_iter", "error_feedback"), "topk": ("ratio", "error_feedback")}
REDUCER_DEFAULTS = {"matrix_rank": 4, "start_iter": 10, "error_feedback": True, "ratio": 0.01}
MIXER_KEYS = {
    "average": ("period", "warmup_steps", "adaptive", "target_divergence", "max_period"),
    "gossip": ("period", "topology", "mixing"),
    "async_ps": ("max_staleness",),
}
MIXER_DEFAULTS = {
    "period": 1,
    "warmup_steps": 0,
    "adaptive": False,
    "target_divergence": 1e-3,
    "max_period": 64,
    "topology": "ring",
    "mixing": 0.5,
    "max_staleness": 2,
}


def _kind_keys(obj: Any, prefix: str, kind: str, keys: dict[str, tuple[str, ...]], defaults: dict[str, Any]) -> None:
    """Refuse a key set (not null) that `kind` does not read, naming who reads it; fill the kind's unset keys."""
    for key in defaults:
        readers = [k for k, ks in keys.items() if key in ks]
        if getattr(obj, key) is not None and key not in keys.get(kind, ()):
            raise ConfigError(
                f"{prefix}.{key} is set ({getattr(obj, key)!r}) but {prefix}.kind={kind} does not read "
                f"it; it belongs to {prefix}.kind in {readers}: set it to null or change the kind"
            )
    for key in keys.get(kind, ()):
        if getattr(obj, key) is None:
            setattr(obj, key, defaults[key])


@dataclass
class ReducerConfig:
    """Gradient reducer, every step inside backward (a DDP comm hook): how gradients cross the wire."""

    kind: str = "allreduce"  # none | allreduce | fp16 | bf16 | powersgd | topk
    matrix_rank: int | None = None  # powersgd: rank of the P, Q factors (default 4)
    start_iter: int | None = None  # powersgd: plain all-reduce before this step (>= 2 with error feedback; default 10)
    error_feedback: bool | None = None  # powersgd, topk (default true)
    ratio: float | None = None  # topk: fraction of gradient entries sent (default 0.01)

    def __post_init__(self) -> None:
        k = "sync.reducer"
        _check(self.kind in REDUCERS, k + ".kind", f"must be one of {list(REDUCERS)}", self.kind)
        _kind_keys(self, k, self.kind, REDUCER_KEYS, REDUCER_DEFAULTS)
        _check(self.matrix_rank is None or self.matrix_rank > 0, k + ".matrix_rank", "must be > 0", self.matrix_rank)
        _check(self.start_iter is None or self.start_iter >= 0, k + ".start_iter", "must be >= 0", self.start_iter)
        _check(self.ratio is None or 0 < self.ratio <= 1, k + ".ratio", "must be in (0, 1]", self.ratio)


@dataclass
class MixerConfig:
    """Parameter mixer, after optimizer steps: how replicas that stepped apart are pulled together."""

    kind: str = "none"  # none | average (every period, local SGD) | gossip | async_ps (a Ray actor server)
    period: int | None = None  # average, gossip: steps between rounds (default 1)
    warmup_steps: int | None = None  # average: gradient all-reduce (DDP) for this many steps first (default 0)
    adaptive: bool | None = None  # average: shrink/grow the period with the measured divergence (default false)
    target_divergence: float | None = None  # average + adaptive: divergence aimed at at sync time (default 1e-3)
    max_period: int | None = None  # average + adaptive: upper bound of the period (default 64)
    topology: str | None = None  # gossip: ring | random (seeded pairing per round; default ring)
    mixing: float | None = None  # gossip: weight of the neighbours' mean (default 0.5)
    max_staleness: int | None = None  # async_ps: others' updates an applied push may have missed (default 2)

    def __post_init__(self) -> None:
        k = "sync.mixer"
        _check(self.kind in MIXERS, k + ".kind", f"must be one of {list(MIXERS)}", self.kind)
        _kind_keys(self, k, self.kind, MIXER_KEYS, MIXER_DEFAULTS)
        _check(self.period is None or self.period > 0, k + ".period", "must be > 0", self.period)
        _check(
            self.warmup_steps is None or self.warmup_steps >= 0, k + ".warmup_steps", "must be >= 0", self.warmup_steps
        )
        _check(
            self.max_period is None or self.max_period >= self.period,
            k + ".max_period",
            f"must be >= sync.mixer.period ({self.period})",
            self.max_period,
        )
        _check(
            self.target_divergence is None or self.target_divergence > 0,
            k + ".target_divergence",
            "must be > 0",
            self.target_divergence,
        )
        _check(
            self.topology is None or self.topology in GOSSIP_TOPOLOGIES,
            k + ".topology",
            f"must be one of {list(GOSSIP_TOPOLOGIES)}",
            self.topology,
        )
        _check(self.mixing is None or 0 < self.mixing <= 1, k + ".mixing", "must be in (0, 1]", self.mixing)
        _check(
            self.max_staleness is None or self.max_staleness >= 0,
            k + ".max_staleness",
            "must be >= 0",
            self.max_staleness,
        )


@dataclass
class ScopeConfig:
    """Where the reducer and the mixer apply: which ranks (inside / across nodes) and which parameters."""

    # all: one reduction over every rank; intra_node: inside each Ray node only (nothing crosses nodes);
    # two_level: exact fp32 all-reduce inside the node, then reducer.kind across nodes on the node-mean gradient
    reducer: str = "all"
    mixer: str = "all"  # all: every rank; inter_node: across nodes (needs scope.reducer=intra_node)
    # regexes (re.search on parameter names, e.g. 'encoder\.layer\.5\.', 'pooler\.'): the reducer applies to the
    # matching parameters only and the mixer to all the others; [] = every parameter
    reducer_params: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        k = "sync.scope"
        _check(self.reducer in REDUCER_SCOPES, k + ".reducer", f"must be one of {list(REDUCER_SCOPES)}", self.reducer)
        _check(self.mixer in MIXER_SCOPES, k + ".mixer", f"must be one of {list(MIXER_SCOPES)}", self.mixer)
        for pattern in self.reducer_params:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"sync.scope.reducer_params has {pattern!r}, not a regex: {e}") from None


@dataclass
class SyncConfig:
    """How workers' encoder replicas stay consistent (ragtrain/sync): reducer + mixer + scope, each typed.

    conf/sync/*.yaml are presets of this composition (ddp, powersgd, local_sgd, hierarchical, hybrid_powersgd, ...).
    """

    reducer: ReducerConfig = field(default_factory=ReducerConfig)
    mixer: MixerConfig = field(default_factory=MixerConfig)
    scope: ScopeConfig = field(default_factory=ScopeConfig)
    consensus: str = "params"  # end of training: params (one model) | vectors (every replica kept: vector_avg)
    bucket_cap_mb: float = 25.0  # DDP gradient bucket size (when a reducer or a warm-up runs in DDP)
    probe_passages: int = 64  # drift metrics: fixed probe set (passages, and as many queries)
    eval_every: int = 0  # drift metrics every N steps (0 = only at the end)

    def __post_init__(self) -> None:
        r, m, s = self.reducer, self.mixer, self.scope
        k = "sync."
        _check(self.consensus in CONSENSUS, k + "consensus", f"must be one of {list(CONSENSUS)}", self.consensus)
        _check(self.bucket_cap_mb > 0, k + "bucket_cap_mb", "must be > 0", self.bucket_cap_mb)
        _check(self.probe_passages > 1, k + "probe_passages", "must be > 1", self.probe_passages)
        _check(self.eval_every >= 0, k + "eval_every", "must be >= 0", self.eval_every)
        # combinations (each message names the valid ones)
        _check(
            r.kind != "none" or (s.reducer == "all" and not s.reducer_params),
            k + "scope.reducer",
            "applies to a reducer: with sync.reducer.kind=none keep scope.reducer=all and scope.reducer_params=[]",
            s.reducer,
        )
        _check(
            s.reducer != "intra_node" or r.kind == "allreduce",
            k + "reducer.kind",
            "must be allreduce with scope.reducer=intra_node (valid there: [allreduce]; compress across nodes "
            "with scope.reducer=two_level)",
            r.kind,
        )
        _check(
            s.reducer != "intra_node" or (m.kind in ("average", "gossip") and s.mixer == "inter_node"),
            k + "mixer.kind",
            "must be average or gossip with scope.mixer=inter_node when scope.reducer=intra_node "
            "(nodes would never meet); or use scope.reducer=two_level",
            m.kind,
        )
        _check(
            s.mixer != "inter_node" or s.reducer == "intra_node",
            k + "scope.mixer",
            "=inter_node needs scope.reducer=intra_node (replicas inside a node equal); valid: [all]",
            s.mixer,
        )
        _check(
            s.mixer != "inter_node" or m.topology in (None, "ring"),
            k + "mixer.topology",
            "must be ring across nodes (the node ring)",
            m.topology,
        )
        _check(
            not s.reducer_params or (r.kind in ("allreduce", "fp16", "bf16") and s.reducer == "all"),
            k + "scope.reducer_params",
            "needs reducer.kind in [allreduce, fp16, bf16] with scope.reducer=all",
            s.reducer_params,
        )
        _check(
            not s.reducer_params or m.kind in ("average", "gossip"),
            k + "mixer.kind",
            "must be average or gossip with scope.reducer_params (it syncs the other parameters)",
            m.kind,
        )
        full_reducer = r.kind != "none" and s.reducer in ("all", "two_level") and not s.reducer_params
        _check(
            not (full_reducer and m.kind != "none"),
            k + "mixer.kind",
            f"must be none with reducer.kind={r.kind} on every parameter and rank (replicas are equal after each "
            f"step: nothing to mix); valid combinations: reducer none + a mixer, scope.reducer=intra_node + "
            f"scope.mixer=inter_node, or scope.reducer_params + a mixer for the rest",
            m.kind,
        )
        _check(
            m.kind != "async_ps" or (r.kind == "none" and self.consensus == "params"),
            k + "mixer.kind",
            "=async_ps needs reducer.kind=none (workers never wait for each other) and consensus=params",
            m.kind,
        )
        _check(
            not m.warmup_steps or r.kind == "none",
            k + "mixer.warmup_steps",
            "(a gradient all-reduce warm-up) needs reducer.kind=none",
            m.warmup_steps,
        )
        _check(
            self.consensus != "vectors" or (r.kind == "none" and m.kind == "none"),
            k + "consensus",
            "=vectors keeps every replica apart: it needs reducer.kind=none and mixer.kind=none",
            self.consensus,
        )

    @property
    def strategy(self) -> str:
        """The family this composition belongs to (logs, model cards, checks): a read-only label."""
        r, m, s = self.reducer, self.mixer, self.scope
        if self.consensus == "vectors":
            return "vector_avg"
        if m.kind == "async_ps":
            return "async_ps"
        if s.reducer == "intra_node":
            return "hierarchical"
        if s.reducer == "two_level":
            return "hybrid"
        if s.reducer_params:
            return "layerwise"
        if m.kind == "average":
            return "local_sgd"
        if m.kind == "gossip":
            return "gossip"
        return {"allreduce": "ddp", "none": "independent"}.get(r.kind, "compressed")

    @property
    def label(self) -> str:
        """A short name for tables and plots: the preset it matches where it is one (powersgd, local_sgd_adaptive)."""
        s = self.strategy
        if s == "compressed":
            return self.reducer.kind
        if s == "hybrid":
            return f"hybrid_{self.reducer.kind}"
        if s == "local_sgd" and self.mixer.adaptive:
            return "local_sgd_adaptive"
        return s
