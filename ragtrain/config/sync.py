"""Typed sync configuration: a strategy is a gradient reducer + a parameter mixer + a scope (ragtrain/sync/composed.py).

Imported by ragtrain/config/__init__.py (the root schema), so this module imports nothing heavy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from ragtrain.config.registry import Variant
from ragtrain.runtime.errors import ConfigError
from ragtrain.runtime.errors import check as _check

# --- sync: a strategy is a gradient REDUCER + a parameter MIXER + a SCOPE (ragtrain/sync/composed.py) ---
# One registry per family: name -> the class (ragtrain/sync/...) and the facts the checks below read. Adding a
# variant is its class file and one line here (docs/adding-a-variant.md).


@dataclass(frozen=True)
class ReducerVariant(Variant):
    """A gradient reducer (ragtrain/sync/reducers/): a DDP comm hook run inside backward."""

    reads: dict[str, Any] = field(default_factory=dict)  # ReducerConfig keys it reads -> their defaults
    sends: bool = True  # puts gradients on the wire (none: every worker keeps its own)
    exact: bool = False  # the exact fp32 mean, what scope.reducer=intra_node computes inside a node
    slices: bool = False  # can average some parameters' slices of a bucket (scope.reducer_params)
    family: str = "compressed"  # SyncConfig.strategy when it runs alone on every parameter and rank


@dataclass(frozen=True)
class MixerVariant(Variant):
    """A parameter mixer (ragtrain/sync/mixers/): runs after optimizer steps."""

    reads: dict[str, Any] = field(default_factory=dict)  # MixerConfig keys it reads -> their defaults
    mixes: bool = True  # moves parameters during training (none: only the end-of-training consensus)
    subset: bool = False  # can own the parameters outside scope.reducer_params
    across_nodes: bool = False  # can run with scope.mixer=inter_node
    asynchronous: bool = False  # workers never wait for each other: no gradient collective, no gathered negatives
    family: str | None = None  # SyncConfig.strategy


@dataclass(frozen=True)
class ReducerScopeVariant(Variant):
    """Which ranks a reducer spans (ragtrain/sync/scopes/)."""

    within_node: bool = False  # nothing crosses nodes: its own exact mean inside each node, a mixer joins nodes
    family: str | None = None  # SyncConfig.strategy


@dataclass(frozen=True)
class MixerScopeVariant(Variant):
    """Which ranks a mixer spans (ragtrain/sync/scopes/)."""

    across_nodes: bool = False  # one worker per node takes part: needs replicas equal inside a node


REDUCERS: dict[str, ReducerVariant] = {
    "none": ReducerVariant("ragtrain.sync.reducers.none:NoReducer", sends=False, family="independent"),
    "allreduce": ReducerVariant("ragtrain.sync.reducers.allreduce:AllReduce", exact=True, slices=True, family="ddp"),
    "fp16": ReducerVariant("ragtrain.sync.reducers.fp16:Fp16", slices=True),
    "bf16": ReducerVariant("ragtrain.sync.reducers.bf16:Bf16", slices=True),
    "powersgd": ReducerVariant(
        "ragtrain.sync.reducers.powersgd:PowerSGD", reads={"matrix_rank": 4, "start_iter": 10, "error_feedback": True}
    ),
    "topk": ReducerVariant("ragtrain.sync.reducers.topk:TopK", reads={"ratio": 0.01, "error_feedback": True}),
}
MIXERS: dict[str, MixerVariant] = {
    "none": MixerVariant("ragtrain.sync.mixers.none:NoMixer", mixes=False),
    "average": MixerVariant(
        "ragtrain.sync.mixers.average:Average",
        reads={
            "period": 1,
            "warmup_steps": 0,
            "adaptive": False,
            "target_divergence": 1e-3,
            "max_period": 64,
            "comm_share": 0.0,
        },
        subset=True,
        across_nodes=True,
        family="local_sgd",
    ),
    "gossip": MixerVariant(
        "ragtrain.sync.mixers.gossip:Gossip",
        reads={"period": 1, "topology": "ring", "mixing": 0.5},
        subset=True,
        across_nodes=True,
        family="gossip",
    ),
    "async_ps": MixerVariant(
        "ragtrain.sync.mixers.async_ps:AsyncPS", reads={"max_staleness": 2}, asynchronous=True, family="async_ps"
    ),
    # DiLoCo (Douillard et al. 2023): outer Nesterov SGD on the averaged pseudo-gradient, the paper's outer_lr and
    # outer_momentum; period 8 as local_sgd's (the paper's 500 inner steps are for pretraining runs far longer)
    "diloco": MixerVariant(
        "ragtrain.sync.mixers.diloco:Diloco",
        reads={
            "period": 8,
            "warmup_steps": 0,
            "max_period": 64,
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            "pseudo_grad_dtype": "fp16",
            "comm_share": 0.0,
        },
        subset=True,
        across_nodes=True,
        family="diloco",
    ),
}
PSEUDO_GRAD_DTYPES = ("fp16", "fp32")  # diloco's wire types (ragtrain/sync/mixers/diloco.py maps them to torch's)
REDUCER_SCOPES: dict[str, ReducerScopeVariant] = {
    "all": ReducerScopeVariant("ragtrain.sync.scopes.all_ranks:AllRanks"),
    "intra_node": ReducerScopeVariant(
        "ragtrain.sync.scopes.intra_node:IntraNode", within_node=True, family="hierarchical"
    ),
    "two_level": ReducerScopeVariant("ragtrain.sync.scopes.two_level:TwoLevel", family="hybrid"),
}
MIXER_SCOPES: dict[str, MixerScopeVariant] = {
    "all": MixerScopeVariant("ragtrain.sync.scopes.all_ranks_mixer:AllRanksMixer"),
    "inter_node": MixerScopeVariant("ragtrain.sync.scopes.inter_node:InterNode", across_nodes=True),
}


@dataclass(frozen=True)
class ConsensusVariant(Variant):
    """What the replicas become at the end of training (ragtrain/sync/consensus/)."""

    keeps_replicas: bool = False  # every replica is handed on (no parameter mean): needs replicas kept apart
    family: str | None = None  # SyncConfig.strategy


@dataclass(frozen=True)
class TopologyVariant(Variant):
    """Which peers a gossip round mixes with (ragtrain/sync/topologies/)."""

    across_nodes: bool = False  # can run on the node ring (scope.mixer=inter_node)


CONSENSUS: dict[str, ConsensusVariant] = {
    "params": ConsensusVariant("ragtrain.sync.consensus.params:ParamMean"),
    "vectors": ConsensusVariant(
        "ragtrain.sync.consensus.vectors:KeepReplicas", keeps_replicas=True, family="vector_avg"
    ),
}
GOSSIP_TOPOLOGIES: dict[str, TopologyVariant] = {
    "ring": TopologyVariant("ragtrain.sync.topologies.ring:Ring", across_nodes=True),
    "random": TopologyVariant("ragtrain.sync.topologies.random_pairs:RandomPairs"),
}


def _names(registry: dict[str, Any], ok: Any) -> list[str]:
    """The names in `registry` whose entry satisfies `ok`: the valid choices an error message lists."""
    return [name for name, v in registry.items() if ok(v)]


def _kind_keys(obj: Any, prefix: str, registry: dict[str, Any]) -> None:
    """Refuse a key set (not null) that `obj.kind` does not read, naming who reads it; fill the kind's unset keys."""
    reads = registry[obj.kind].reads
    for key in (f.name for f in fields(obj) if f.name != "kind"):
        if getattr(obj, key) is not None and key not in reads:
            readers = _names(registry, lambda v, key=key: key in v.reads)
            raise ConfigError(
                f"{prefix}.{key} is set ({getattr(obj, key)!r}) but {prefix}.kind={obj.kind} does not read "
                f"it; it belongs to {prefix}.kind in {readers}: set it to null or change the kind"
            )
    for key, default in reads.items():
        if getattr(obj, key) is None:
            setattr(obj, key, default)


@dataclass
class ReducerConfig:
    """Gradient reducer, every step inside backward (a DDP comm hook): how gradients cross the wire."""

    kind: str = "allreduce"  # a name in REDUCERS: none | allreduce | fp16 | bf16 | powersgd | topk
    matrix_rank: int | None = None  # powersgd: rank of the P, Q factors (default 4)
    start_iter: int | None = None  # powersgd: plain all-reduce before this step (>= 2 with error feedback; default 10)
    error_feedback: bool | None = None  # powersgd, topk (default true)
    ratio: float | None = None  # topk: fraction of gradient entries sent (default 0.01)

    def __post_init__(self) -> None:
        k = "sync.reducer"
        _check(self.kind in REDUCERS, k + ".kind", f"must be one of {list(REDUCERS)}", self.kind)
        _kind_keys(self, k, REDUCERS)
        _check(self.matrix_rank is None or self.matrix_rank > 0, k + ".matrix_rank", "must be > 0", self.matrix_rank)
        _check(self.start_iter is None or self.start_iter >= 0, k + ".start_iter", "must be >= 0", self.start_iter)
        _check(self.ratio is None or 0 < self.ratio <= 1, k + ".ratio", "must be in (0, 1]", self.ratio)


@dataclass
class MixerConfig:
    """Parameter mixer, after optimizer steps: how replicas that stepped apart are pulled together."""

    # a name in MIXERS: none | average (local SGD) | gossip | async_ps (a Ray actor server) | diloco
    kind: str = "none"
    period: int | None = None  # average, gossip, diloco: steps between rounds (default 1; diloco 8)
    warmup_steps: int | None = None  # average, diloco: gradient all-reduce (DDP) for this many steps first (default 0)
    adaptive: bool | None = None  # average: shrink/grow the period with the measured divergence (default false)
    target_divergence: float | None = None  # average + adaptive: divergence aimed at at sync time (default 1e-3)
    # average + adaptive, average / diloco + comm_share: upper bound of the period (default 64)
    max_period: int | None = None
    # average, diloco: the share of step time communication may take; after each round the period is set from the
    # measured round and compute seconds to keep under it (ragtrain/sync/network.py). 0: off, a fixed period (default)
    comm_share: float | None = None
    outer_lr: float | None = None  # diloco: outer SGD learning rate on the averaged pseudo-gradient (default 0.7)
    outer_momentum: float | None = None  # diloco: the outer SGD's Nesterov momentum (default 0.9)
    pseudo_grad_dtype: str | None = None  # diloco: fp16 | fp32, the pseudo-gradient's type on the wire (default fp16)
    topology: str | None = None  # gossip: a name in GOSSIP_TOPOLOGIES: ring | random (seeded pairs; default ring)
    mixing: float | None = None  # gossip: weight of the neighbours' mean (default 0.5)
    max_staleness: int | None = None  # async_ps: others' updates an applied push may have missed (default 2)

    def __post_init__(self) -> None:
        k = "sync.mixer"
        _check(self.kind in MIXERS, k + ".kind", f"must be one of {list(MIXERS)}", self.kind)
        _kind_keys(self, k, MIXERS)
        _check(self.period is None or self.period > 0, k + ".period", "must be > 0", self.period)
        _check(
            self.warmup_steps is None or self.warmup_steps >= 0, k + ".warmup_steps", "must be >= 0", self.warmup_steps
        )
        _check(
            self.max_period is None or self.period is None or self.max_period >= self.period,
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
        self._check_outer()

    def _check_outer(self) -> None:
        """diloco's outer step and the measured period (comm_share)."""
        k = "sync.mixer"
        share = self.comm_share
        _check(share is None or 0 <= share < 1, k + ".comm_share", "must be in (0, 1), or 0 for a fixed period", share)
        _check(
            not (share and self.adaptive),
            k + ".comm_share",
            "and sync.mixer.adaptive=true both set the period: keep one (comm_share=0 or adaptive=false)",
            share,
        )
        _check(self.outer_lr is None or self.outer_lr > 0, k + ".outer_lr", "must be > 0", self.outer_lr)
        _check(
            self.outer_momentum is None or 0 <= self.outer_momentum < 1,
            k + ".outer_momentum",
            "must be in [0, 1)",
            self.outer_momentum,
        )
        _check(
            self.pseudo_grad_dtype is None or self.pseudo_grad_dtype in PSEUDO_GRAD_DTYPES,
            k + ".pseudo_grad_dtype",
            f"must be one of {list(PSEUDO_GRAD_DTYPES)}",
            self.pseudo_grad_dtype,
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
    # a name in CONSENSUS, the end of training: params (one model) | vectors (every replica kept: vector_avg)
    consensus: str = "params"
    bucket_cap_mb: float = 25.0  # DDP gradient bucket size (when a reducer or a warm-up runs in DDP)
    probe_passages: int = 64  # drift metrics: fixed probe set (passages, and as many queries)
    eval_every: int = 0  # drift metrics every N steps (0 = only at the end)

    def __post_init__(self) -> None:
        k = "sync."
        _check(self.consensus in CONSENSUS, k + "consensus", f"must be one of {list(CONSENSUS)}", self.consensus)
        _check(self.bucket_cap_mb > 0, k + "bucket_cap_mb", "must be > 0", self.bucket_cap_mb)
        _check(self.probe_passages > 1, k + "probe_passages", "must be > 1", self.probe_passages)
        _check(self.eval_every >= 0, k + "eval_every", "must be >= 0", self.eval_every)
        self._check_scopes()
        self._check_mixing()

    def _check_scopes(self) -> None:
        """Which ranks and parameters the reducer and the mixer may span, from the registries' facts (each message
        names the valid choices)."""
        r, m, s = self.reducer, self.mixer, self.scope
        k = "sync."
        red, mix = REDUCERS[r.kind], MIXERS[m.kind]
        rscope, mscope = REDUCER_SCOPES[s.reducer], MIXER_SCOPES[s.mixer]
        exact = _names(REDUCERS, lambda v: v.exact)
        joining = _names(MIXERS, lambda v: v.across_nodes)
        within = _names(REDUCER_SCOPES, lambda v: v.within_node)
        _check(
            red.sends or (s.reducer == "all" and not s.reducer_params),
            k + "scope.reducer",
            f"applies to a reducer: with sync.reducer.kind={r.kind} keep scope.reducer=all and scope.reducer_params=[]",
            s.reducer,
        )
        _check(
            not rscope.within_node or red.exact,
            k + "reducer.kind",
            f"must be {' or '.join(exact)} with scope.reducer={s.reducer} (valid there: [{', '.join(exact)}]; "
            "compress across nodes with scope.reducer=two_level)",
            r.kind,
        )
        _check(
            not rscope.within_node or (mix.across_nodes and mscope.across_nodes),
            k + "mixer.kind",
            f"must be {' or '.join(joining)} with scope.mixer=inter_node when scope.reducer={s.reducer} "
            "(nodes would never meet); or use scope.reducer=two_level",
            m.kind,
        )
        _check(
            not mscope.across_nodes or rscope.within_node,
            k + "scope.mixer",
            f"={s.mixer} needs {' or '.join('scope.reducer=' + n for n in within)} (replicas inside a node "
            f"equal); valid: [{', '.join(_names(MIXER_SCOPES, lambda v: not v.across_nodes))}]",
            s.mixer,
        )
        node_ring = _names(GOSSIP_TOPOLOGIES, lambda v: v.across_nodes)
        _check(
            not mscope.across_nodes or m.topology is None or GOSSIP_TOPOLOGIES[m.topology].across_nodes,
            k + "mixer.topology",
            f"must be one of {node_ring} across nodes (the node ring)",
            m.topology,
        )
        _check(
            not s.reducer_params or (red.slices and s.reducer == "all"),
            k + "scope.reducer_params",
            f"needs reducer.kind in [{', '.join(_names(REDUCERS, lambda v: v.slices))}] with scope.reducer=all",
            s.reducer_params,
        )

    def _check_mixing(self) -> None:
        """What the mixer can run with: the reducer beside it, its warm-up, the consensus."""
        r, m, s = self.reducer, self.mixer, self.scope
        k = "sync."
        red, mix, cons = REDUCERS[r.kind], MIXERS[m.kind], CONSENSUS[self.consensus]
        partial = _names(MIXERS, lambda v: v.subset)
        merged = _names(CONSENSUS, lambda v: not v.keeps_replicas)
        _check(
            not s.reducer_params or mix.subset,
            k + "mixer.kind",
            f"must be {' or '.join(partial)} with scope.reducer_params (it syncs the other parameters)",
            m.kind,
        )
        _check(
            not (self.replicas_equal and mix.mixes),
            k + "mixer.kind",
            f"must be none with reducer.kind={r.kind} on every parameter and rank (replicas are equal after each "
            f"step: nothing to mix); valid combinations: reducer none + a mixer, scope.reducer=intra_node + "
            f"scope.mixer=inter_node, or scope.reducer_params + a mixer for the rest",
            m.kind,
        )
        _check(
            not mix.asynchronous or (not red.sends and not cons.keeps_replicas),
            k + "mixer.kind",
            f"={m.kind} needs reducer.kind=none (workers never wait for each other) and "
            f"{' or '.join('consensus=' + n for n in merged)}",
            m.kind,
        )
        _check(
            not m.warmup_steps or not red.sends,
            k + "mixer.warmup_steps",
            "(a gradient all-reduce warm-up) needs reducer.kind=none",
            m.warmup_steps,
        )
        _check(
            not cons.keeps_replicas or (not red.sends and not mix.mixes),
            k + "consensus",
            f"={self.consensus} keeps every replica apart: it needs reducer.kind=none and mixer.kind=none",
            self.consensus,
        )

    @property
    def replicas_equal(self) -> bool:
        """Every replica applies the same gradient each step: a sending reducer on every parameter and rank."""
        s = self.scope
        return REDUCERS[self.reducer.kind].sends and not REDUCER_SCOPES[s.reducer].within_node and not s.reducer_params

    @property
    def strategy(self) -> str:
        """The family this composition belongs to (logs, model cards, checks): a read-only label."""
        mixer, scope = MIXERS[self.mixer.kind], REDUCER_SCOPES[self.scope.reducer]
        consensus = CONSENSUS[self.consensus].family
        if consensus:
            return consensus
        if mixer.asynchronous and mixer.family:
            return mixer.family
        if scope.family:
            return scope.family
        if self.scope.reducer_params:
            return "layerwise"
        return mixer.family or REDUCERS[self.reducer.kind].family

    @property
    def label(self) -> str:
        """A short name for tables and plots: the preset it matches where it is one (powersgd, local_sgd_adaptive,
        local_sgd_network)."""
        s = self.strategy
        if s == "compressed":
            return self.reducer.kind
        if s == "hybrid":
            return f"hybrid_{self.reducer.kind}"
        if s == "local_sgd" and self.mixer.adaptive:
            return "local_sgd_adaptive"
        if s in ("local_sgd", "diloco") and self.mixer.comm_share:
            return f"{s}_network"
        return s
