"""The variant registries the config checks read (ragtrain/config/registry.py): every entry names a class of its
family, and a new entry is all the config and the builder need to accept a new variant."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest
import torch
from torch import nn

from ragtrain.config.data import DATA_SOURCES
from ragtrain.config.generator import GENERATOR_ARCHS
from ragtrain.config.joint import JOINT_LOSSES
from ragtrain.config.retriever import TEACHER_LOSSES
from ragtrain.config.sync import (
    CONSENSUS,
    GOSSIP_TOPOLOGIES,
    MIXER_SCOPES,
    MIXERS,
    REDUCER_SCOPES,
    REDUCERS,
    MixerConfig,
    ReducerConfig,
    ReducerVariant,
)
from ragtrain.config.tune import TUNE_SCHEDULERS, TUNE_SEARCHERS
from ragtrain.corpus.sources.base import DataSource
from ragtrain.generator.archs.base import Architecture
from ragtrain.joint.losses.base import JointLoss
from ragtrain.retriever.teacher.base import TeacherLoss
from ragtrain.runtime.errors import ConfigError
from ragtrain.sync.composed import build_sync
from ragtrain.sync.consensus.base import Consensus
from ragtrain.sync.mixers.base import Mixer
from ragtrain.sync.reducers.allreduce import AllReduce
from ragtrain.sync.reducers.base import Reducer, SliceReducer
from ragtrain.sync.scopes.base import MixerScope, ReducerScope
from ragtrain.sync.topologies.base import Topology
from ragtrain.tune.schedulers.base import Scheduler
from ragtrain.tune.searchers.base import Searcher
from tests.conftest import sync_config

FAMILIES = [
    (REDUCERS, Reducer, ReducerConfig),
    (MIXERS, Mixer, MixerConfig),
    (REDUCER_SCOPES, ReducerScope, None),
    (MIXER_SCOPES, MixerScope, None),
    (CONSENSUS, Consensus, None),
    (GOSSIP_TOPOLOGIES, Topology, None),
    (TUNE_SCHEDULERS, Scheduler, None),
    (TUNE_SEARCHERS, Searcher, None),
    (JOINT_LOSSES, JointLoss, None),
    (TEACHER_LOSSES, TeacherLoss, None),
    (DATA_SOURCES, DataSource, None),
    (GENERATOR_ARCHS, Architecture, None),
]


def _protocol_methods(protocol: type) -> set[str]:
    """The methods a Protocol asks for (`__call__` included: a loss is a callable object)."""
    return {
        n for n, v in vars(protocol).items() if inspect.isfunction(v) and (not n.startswith("_") or n == "__call__")
    }


def _defines(cls: type, method: str) -> bool:
    """`cls` or a base of its own defines `method` (every class is callable through `type`: not what is asked)."""
    return any(callable(vars(k).get(method)) for k in cls.__mro__ if k is not object)


@pytest.mark.parametrize("registry,protocol,schema", FAMILIES)
def test_every_entry_names_a_class_of_its_family(registry, protocol, schema) -> None:
    keys = {f.name for f in fields(schema)} - {"kind"} if schema else set()
    for name, variant in registry.items():
        cls = variant.load()
        assert inspect.isclass(cls), name
        missing = {m for m in _protocol_methods(protocol) if not _defines(cls, m)}
        assert not missing, f"{name} ({variant.path}) lacks {sorted(missing)} of {protocol.__name__}"
        if schema:  # the keys it reads are fields of its typed config
            assert set(variant.reads) <= keys, name


def test_reducer_flags_match_the_classes() -> None:
    """`slices` promises reduce_slices (scope.reducer_params calls it)."""
    for name, variant in REDUCERS.items():
        has = callable(getattr(variant.load(), "reduce_slices", None))
        assert has == variant.slices, name
    assert _protocol_methods(SliceReducer) - _protocol_methods(Reducer) == {"reduce_slices"}


class HalfAllReduce(AllReduce):
    """A reducer defined outside the package: all-reduce, with the bucket halved first (easy to see)."""

    def hook(self, bucket):
        bucket.buffer().mul_(0.5)
        return super().hook(bucket)


def test_one_registry_line_is_all_a_new_reducer_needs(monkeypatch) -> None:
    """Registered by one line, a reducer is a valid sync.reducer.kind, listed among the valid choices, and built."""
    with pytest.raises(ConfigError) as e:
        sync_config("ddp", reducer={"kind": "half"})
    assert "half" not in str(e.value).split("must be one of")[1].split("]")[0]

    monkeypatch.setitem(REDUCERS, "half", ReducerVariant(f"{__name__}:HalfAllReduce", slices=True))
    cfg = sync_config("ddp", reducer={"kind": "half"})
    assert cfg.strategy == "compressed" and cfg.label == "half"
    strategy = build_sync(cfg)
    assert isinstance(strategy.scope.reducer, HalfAllReduce)
    with pytest.raises(ConfigError) as e:
        sync_config("ddp", reducer={"kind": "warp"})
    assert "'half'" in str(e.value)  # the valid choices come from the registry
    model = nn.Linear(2, 2)
    assert strategy.wrap(model, torch.device("cpu")) is model  # one process: no DDP, the model as it is


def test_tune_variants_build_tune_objects() -> None:
    """Each scheduler and searcher builds the Ray Tune object a sweep runs with, from the sweep's typed config."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search import ConcurrencyLimiter
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from ragtrain.config.tune import TuneConfig
    from ragtrain.tune.schedulers.base import build_scheduler
    from ragtrain.tune.searchers.base import build_searcher

    t = TuneConfig(space={"retriever.train.lr": {"choice": [1e-5]}}, max_t=7)
    assert isinstance(build_scheduler(t), FIFOScheduler) and isinstance(build_searcher(t, 2), BasicVariantGenerator)
    t.scheduler, t.searcher = "asha", "optuna"
    asha, optuna = build_scheduler(t), build_searcher(t, 3)
    assert isinstance(asha, ASHAScheduler) and asha._max_t == 7
    assert isinstance(optuna, ConcurrencyLimiter) and optuna.max_concurrent == 3
