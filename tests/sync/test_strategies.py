"""Sync strategies on real multi-process gloo groups: equivalences, consensus, and bytes counted where sent."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ragtrain.config.sync import MIXERS, REDUCERS, MixerConfig, SyncConfig
from ragtrain.runtime.errors import ConfigError
from ragtrain.sync.base import flat_params
from ragtrain.sync.comm import STATS, all_gather_bytes, all_reduce_bytes
from ragtrain.sync.composed import build_sync
from ragtrain.sync.drift import param_divergence, replica_cosine, topk_jaccard
from ragtrain.sync.topologies.base import build_topology
from tests.conftest import spawn, sync_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 8))


def S(preset: str, **overrides) -> dict:
    """A job's sync: conf/sync/<preset>.yaml with `overrides` merged (e.g. mixer={'period': 4})."""
    return {"preset": preset, **overrides}


def _sync(sync: dict) -> SyncConfig:
    return sync_config(sync["preset"], **{k: v for k, v in sync.items() if k not in ("preset", "clip")})


def _train_one(
    rank: int, sync: SyncConfig, clip: float | None, steps: int, lr: float, seed_per_rank: bool, nodes: list | None
) -> dict:
    """Train a small MLP with the given strategy and SGD+momentum (gradients clipped to `clip` per clip group);
    returns params, bytes and drift per step (all parameters: div; the first / last layer alone: div_first /
    div_last)."""
    STATS.reset()
    model = _model(rank if seed_per_rank else 0)
    strategy = build_sync(sync, nodes)
    wrapped = strategy.wrap(model, torch.device("cpu"))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    bytes_per_step, divergences, by_category, first, last = [], [], [], [], []
    for step in range(steps):
        x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen)
        before = STATS.total_bytes()
        loss = ((wrapped(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if clip:  # as the recipe does: one gradient norm per strategy.clip_groups group
            for group in strategy.clip_groups(params):
                torch.nn.utils.clip_grad_norm_(group, clip)
        opt.step()
        strategy.after_step(params, step)
        bytes_per_step.append(STATS.total_bytes() - before)
        by_category.append(dict(STATS.bytes))
        divergences.append(param_divergence(params))
        first.append(param_divergence(list(model[0].parameters())))
        last.append(param_divergence(list(model[2].parameters())))
    return {
        "params": flat_params(params),
        "bytes": bytes_per_step,
        "div": divergences,
        "state": strategy.state(),
        "cat": by_category,
        "div_first": first,
        "div_last": last,
    }


def _train_many(rank: int, world: int, port: int, out: str, jobs: list[tuple]) -> None:
    """Every job of one world size in ONE process group: a spawn (torch import x world) costs seconds, a job ms."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = [_train_one(rank, *job) for job in jobs]  # every rank runs the jobs in the same order
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


# Every (world, sync, steps, lr, seed_per_rank, nodes) job the tests below ask for; `run` trains all jobs of a
# world size together on first use. A job missing here still runs (in its own spawn).
NODES = ["a", "a", "b", "b"]  # 4 workers declared on 2 nodes
PLAIN_OUTER = {"outer_lr": 1.0, "outer_momentum": 0.0, "pseudo_grad_dtype": "fp32"}  # diloco's outer step = the mean
TOP = {"reducer_params": [r"^2\."]}  # layer-wise: the MLP's top layer (module 2) every step, module 0 by the mixer
_JOBS: list[tuple] = [
    (2, S("ddp"), 6, 0.05, False, None),
    (2, S("local_sgd", mixer={"period": 1}), 6, 0.05, False, None),
    (2, S("local_sgd", mixer={"period": 4}), 6, 0.05, False, None),
    (2, S("local_sgd", mixer={"period": 3, "warmup_steps": 2}), 6, 0.05, False, None),
    (2, S("local_sgd", mixer={"period": 1, "adaptive": True, "target_divergence": 1.0}), 8, 0.05, False, None),
    (2, S("local_sgd", mixer={"period": 4, "adaptive": True, "target_divergence": 1e-9}), 8, 0.05, False, None),
    (2, S("diloco", mixer={"period": 3, "warmup_steps": 2, **PLAIN_OUTER}), 6, 0.05, False, None),
    *[(2, S("diloco", mixer={"period": 4, "pseudo_grad_dtype": d}), 6, 0.05, False, None) for d in ("fp16", "fp32")],
    (2, S("fp16"), 6, 0.05, False, None),
    (2, S("powersgd", reducer={"matrix_rank": 2, "start_iter": 2}), 5, 0.05, False, None),
    *[
        (
            2,
            S(c, bucket_cap_mb=0.001, **({"reducer": {"matrix_rank": 2, "start_iter": 2}} if c == "powersgd" else {})),
            5,
            0.05,
            False,
            None,
        )
        for c in ("powersgd", "topk", "fp16")
    ],
    (2, S("topk", reducer={"ratio": 0.05}), 6, 0.05, False, None),
    (2, S("fp16", reducer={"kind": "bf16"}), 6, 0.05, False, None),
    (2, S("vector_avg"), 6, 0.05, False, None),
    (2, S("layerwise", scope=TOP, mixer={"period": 4}), 6, 0.05, False, None),
    (2, S("layerwise", scope=TOP, mixer={"period": 4}, clip=0.05), 6, 0.05, False, None),
    (3, S("gossip", mixer={"topology": "ring", "mixing": 0.5}), 40, 0.0, True, None),
    (3, S("gossip", mixer={"topology": "ring", "period": 2}), 6, 0.05, False, None),
    (4, S("gossip", mixer={"topology": "random", "mixing": 0.5}), 40, 0.0, True, None),
    *[
        (4, S("hierarchical", mixer={"kind": k, "period": 2}), 6, 0.05, False, NODES)
        for k in ("average", "gossip", "diloco")
    ],
    (4, S("ddp"), 6, 0.05, False, None),
    (
        4,
        S(
            "hybrid_powersgd",
            reducer={"kind": "allreduce", "matrix_rank": None, "start_iter": None, "error_feedback": None},
        ),
        6,
        0.05,
        False,
        NODES,
    ),
    (4, S("hybrid_powersgd", reducer={"matrix_rank": 2, "start_iter": 2}), 5, 0.05, False, NODES),
]
_RESULTS: dict[str, dict] = {}


def _spawn(tmp: Path, world: int, jobs: list[tuple]) -> list[dict]:
    out = str(tmp / f"jobs_{world}_{len(os.listdir(tmp))}.pt")
    typed = [(_sync(j[1]), j[1].get("clip"), *j[2:]) for j in jobs]  # composed here, once, not in every rank
    spawn(_train_many, (world, _free_port(), out, typed), world)
    return torch.load(out, weights_only=True)


def run(
    tmp: Path, world: int, sync: dict, steps: int = 6, lr: float = 0.05, seed_per_rank: bool = False, nodes=None
) -> dict:
    """The result of one training job (rank 0's view), from the shared per-world-size spawn when listed."""
    job = (world, sync, steps, lr, seed_per_rank, nodes)
    key = repr(job)
    if key not in _RESULTS:
        batch = [j for j in _JOBS if j[0] == world and repr(j) not in _RESULTS]
        if job not in batch:
            batch = [job]
        for j, result in zip(batch, _spawn(tmp, world, batch)):
            _RESULTS[repr(j)] = result
    return _RESULTS[key]


N_PARAMS = 64 * 96 + 96 + 96 * 8 + 8


def test_ddp_counts_full_allreduce(tmp_path: Path) -> None:
    r = run(tmp_path, 2, S("ddp"))
    assert r["bytes"] == [all_reduce_bytes(4 * N_PARAMS, 2)] * 6
    assert max(r["div"]) < 1e-7  # replicas identical


def test_local_sgd_period_1_equals_ddp(tmp_path: Path) -> None:
    ddp = run(tmp_path, 2, S("ddp"))
    local = run(tmp_path, 2, S("local_sgd", mixer={"period": 1}))
    torch.testing.assert_close(local["params"], ddp["params"], atol=1e-5, rtol=0)
    # ... and with a longer period the replicas really drift between rounds (the test is not vacuous)
    local4 = run(tmp_path, 2, S("local_sgd", mixer={"period": 4}))
    assert local4["div"][2] > 1e-4 and local4["div"][3] < 1e-7
    assert local4["bytes"] == [0, 0, 0, all_reduce_bytes(4 * N_PARAMS, 2), 0, 0]


def test_local_sgd_warmup_then_local(tmp_path: Path) -> None:
    r = run(tmp_path, 2, S("local_sgd", mixer={"period": 3, "warmup_steps": 2}))
    full = all_reduce_bytes(4 * N_PARAMS, 2)
    assert r["bytes"] == [full, full, 0, 0, full, 0]


def test_diloco_with_a_plain_outer_step_is_local_sgd(tmp_path: Path) -> None:
    """outer_lr 1, no momentum, fp32: anchor - mean(anchor - theta_i) = mean(theta_i), after the same warm-up and at the
    same rounds as average (equal up to float rounding: the mean is formed from differences)."""
    local = run(tmp_path, 2, S("local_sgd", mixer={"period": 3, "warmup_steps": 2}))
    diloco = run(tmp_path, 2, S("diloco", mixer={"period": 3, "warmup_steps": 2, **PLAIN_OUTER}))
    torch.testing.assert_close(diloco["params"], local["params"], atol=1e-6, rtol=0)
    assert diloco["bytes"] == local["bytes"]
    assert diloco["div"][3] > 1e-4 and diloco["div"][4] < 1e-7  # apart between rounds, equal right after one
    assert diloco["state"]["sync/outer_rounds"] == 1


@pytest.mark.parametrize("dtype,size", [("fp16", 2), ("fp32", 4)])
def test_diloco_sends_one_all_reduce_of_the_pseudo_gradient_in_its_dtype(tmp_path: Path, dtype: str, size: int) -> None:
    r = run(tmp_path, 2, S("diloco", mixer={"period": 4, "pseudo_grad_dtype": dtype}))
    per_round = all_reduce_bytes(size * N_PARAMS, 2)
    assert r["bytes"] == [0, 0, 0, per_round, 0, 0]
    assert [c.get("params", 0) for c in r["cat"]] == [0, 0, 0, per_round, per_round, per_round]
    assert r["div"][2] > 1e-4 and r["div"][3] == 0.0  # every replica restarts from the one new anchor


def test_local_sgd_adaptive_period_moves(tmp_path: Path) -> None:
    grow = run(tmp_path, 2, S("local_sgd", mixer={"period": 1, "adaptive": True, "target_divergence": 1.0}), steps=8)
    assert grow["state"]["sync/period"] > 1  # divergence far below target: sync less often
    shrink = run(tmp_path, 2, S("local_sgd", mixer={"period": 4, "adaptive": True, "target_divergence": 1e-9}), steps=8)
    assert shrink["state"]["sync/period"] < 4  # divergence above target: sync more often


# the 4-worker random topology is the same consensus with another mixing matrix (make test-slow)
@pytest.mark.parametrize(
    "world,topology",
    [
        (3, "ring"),
        pytest.param(
            4, "random", marks=pytest.mark.slow(reason="the same consensus as the ring, another mixing matrix")
        ),
    ],
)
def test_gossip_reaches_consensus_when_learning_stops(tmp_path: Path, world: int, topology: str) -> None:
    r = run(
        tmp_path, world, S("gossip", mixer={"topology": topology, "mixing": 0.5}), steps=40, lr=0.0, seed_per_rank=True
    )
    assert r["div"][0] > 1e-2  # replicas started apart
    assert r["div"][-1] < 1e-4 * r["div"][0]
    early = [d for d in r["div"] if d > 1e-6]  # above float noise the divergence shrinks every round
    assert all(b < a for a, b in zip(early, early[1:]))


def test_gossip_bytes_are_point_to_point(tmp_path: Path) -> None:
    r = run(tmp_path, 3, S("gossip", mixer={"topology": "ring", "period": 2}))
    assert r["bytes"] == [0, 2 * 4 * N_PARAMS] * 3  # two ring neighbours, every second step


# gossip across nodes (one send to one peer node) in make test-slow: the gossip mixer's own arithmetic is in the
# default suite (test_gossip_reaches_consensus_when_learning_stops), and 4-worker runs cost ~12 s each
@pytest.mark.parametrize(
    "inter_node",
    [
        "average",
        "diloco",
        pytest.param(
            "gossip",
            marks=pytest.mark.slow(
                reason="4-worker runs cost ~12 s each; the gossip mixer's arithmetic runs by default"
            ),
        ),
    ],
)
def test_hierarchical_groups_by_node(tmp_path: Path, inter_node: str) -> None:
    """4 workers on 2 (declared) nodes: 2-worker all-reduce inside a node every step, across nodes every 2nd."""
    r = run(tmp_path, 4, S("hierarchical", mixer={"kind": inter_node, "period": 2}), nodes=NODES)
    p = 4 * N_PARAMS
    intra = [c.get("grad_intra", 0) for c in r["cat"]]
    inter = [c.get("params_inter", 0) for c in r["cat"]]
    assert intra == [all_reduce_bytes(p, 2) * (s + 1) for s in range(6)]
    # average: the fp32 mean over every rank; diloco: the fp16 pseudo-gradient; gossip: one peer node, one send
    per_round = {"average": all_reduce_bytes(p, 4), "diloco": all_reduce_bytes(p // 2, 4), "gossip": p}[inter_node]
    assert inter == [per_round * ((s + 1) // 2) for s in range(6)]
    assert r["state"]["sync/nodes"] == 2
    if inter_node != "gossip":
        assert r["div"][1] < 1e-6  # right after an inter-node round every replica is equal


def test_hybrid_is_intra_node_allreduce_then_inter_node_reducer(tmp_path: Path) -> None:
    """two_level on 4 workers / 2 nodes: the node mean (2-worker all-reduce), then the reducer among the 2 workers of
    equal local rank. With an exact all-reduce across nodes it is DDP; with PowerSGD the bytes across nodes follow
    the rank, and every replica applies the same gradient."""
    p = 4 * N_PARAMS
    exact = run(
        tmp_path,
        4,
        S(
            "hybrid_powersgd",
            reducer={"kind": "allreduce", "matrix_rank": None, "start_iter": None, "error_feedback": None},
        ),
        nodes=NODES,
    )
    ddp = run(tmp_path, 4, S("ddp"))
    torch.testing.assert_close(exact["params"], ddp["params"], atol=1e-5, rtol=0)
    assert [c["grad_intra"] for c in exact["cat"]] == [all_reduce_bytes(p, 2) * (s + 1) for s in range(6)]
    assert [c["grad_inter"] for c in exact["cat"]] == [all_reduce_bytes(p, 2) * (s + 1) for s in range(6)]
    assert exact["state"]["sync/nodes"] == 2 and max(exact["div"]) < 1e-6

    rank = 2
    r = run(tmp_path, 4, S("hybrid_powersgd", reducer={"matrix_rank": rank, "start_iter": 2}), steps=5, nodes=NODES)
    compressed = rank * (96 + 64) + rank * (8 + 96) + 96 + 8  # as in test_powersgd_bytes_follow_rank
    intra = all_reduce_bytes(p, 2)  # every step, every bucket, fp32
    inter = [all_reduce_bytes(p, 2)] * 2 + [all_reduce_bytes(4 * compressed, 2)] * 3  # 2 nodes: a 2-party ring
    assert r["bytes"] == [intra + b for b in inter]
    assert max(r["div"]) < 1e-6  # both cross-node groups computed the same PowerSGD result
    assert 10 * inter[-1] < ddp["bytes"][-1]  # across nodes: > 10x less than ddp's 4-worker all-reduce of all


def test_layerwise_top_layer_every_step_the_rest_every_k(tmp_path: Path) -> None:
    """scope.reducer_params = the top layer: its gradients are all-reduced every step (bytes = its size) and it
    never drifts; the first layer trains apart and is averaged every 4 steps (bytes = its size, then)."""
    r = run(tmp_path, 2, S("layerwise", scope=TOP, mixer={"period": 4}))
    top, rest = 4 * (96 * 8 + 8), 4 * (64 * 96 + 96)
    grad, params = all_reduce_bytes(top, 2), all_reduce_bytes(rest, 2)
    assert r["bytes"] == [grad, grad, grad, grad + params, grad, grad]
    assert [c.get("params", 0) for c in r["cat"]] == [0, 0, 0, params, params, params]
    assert max(r["div_last"]) < 1e-7  # the every-step group stays equal
    assert r["div_first"][2] > 1e-4 and r["div_first"][3] < 1e-7 and r["div_first"][5] > 1e-4  # drifts, averaged
    assert r["state"]["sync/period"] == 4
    # gradient clipping as the recipe does it (per clip group): an active clip keeps the every-step group equal (one
    # global norm over averaged + local gradients gave each rank its own coefficient: the top layer drifted)
    clipped = run(tmp_path, 2, S("layerwise", scope=TOP, mixer={"period": 4}, clip=0.05))
    assert max(clipped["div_last"]) < 1e-7 and clipped["div_first"][2] > 1e-4
    assert clipped["params"].sub(r["params"]).abs().max() > 1e-4  # the clip was active


def test_layerwise_pattern_that_matches_nothing_fails() -> None:
    strategy = build_sync(sync_config("layerwise"))  # patterns for a 6-layer BERT
    with pytest.raises(ValueError, match=r"reducer_params pattern .* matches no parameter"):
        strategy.wrap(_model(), torch.device("cpu"))


def test_fp16_halves_bytes(tmp_path: Path) -> None:
    r = run(tmp_path, 2, S("fp16"))
    assert r["bytes"] == [all_reduce_bytes(2 * N_PARAMS, 2)] * 6


def test_powersgd_bytes_follow_rank(tmp_path: Path) -> None:
    rank = 2
    r = run(tmp_path, 2, S("powersgd", reducer={"matrix_rank": rank, "start_iter": 2}), steps=5)
    full = all_reduce_bytes(4 * N_PARAMS, 2)
    # PowerSGD compresses a matrix only when r(n + m) < n m; vectors (biases) go uncompressed.
    compressed = rank * (96 + 64) + rank * (8 + 96) + 96 + 8
    assert r["bytes"][:2] == [full, full]
    assert r["bytes"][2:] == [all_reduce_bytes(4 * compressed, 2)] * 3
    assert full / r["bytes"][-1] > 10


@pytest.mark.parametrize("compression", ["powersgd", "topk", "fp16"])
def test_compression_with_many_buckets(tmp_path: Path, compression: str) -> None:
    """Several DDP buckets per step (as with MiniLM's 90 MB of gradients): no collective mismatch, replicas equal.
    DDP closes a bucket once it reaches the cap: 1 KB splits this MLP's two layers into two buckets from step 1
    (5 KB kept both layers in one, so the test saw a single bucket)."""
    sync = S(
        compression,
        bucket_cap_mb=0.001,
        **({"reducer": {"matrix_rank": 2, "start_iter": 2}} if compression == "powersgd" else {}),
    )
    r = run(tmp_path, 2, sync, steps=5)
    assert max(r["div"]) < 1e-6
    assert r["bytes"][-1] > 0


def test_topk_bytes_follow_ratio(tmp_path: Path) -> None:
    r = run(tmp_path, 2, S("topk", reducer={"ratio": 0.05}))
    k = int(0.05 * N_PARAMS)
    assert r["bytes"] == [all_gather_bytes(k * 8, 2)] * 6
    assert max(r["div"]) < 1e-6  # every worker applies the same sparse average


# One job per reducer in the REDUCERS registry and the bytes one worker sends in the last of its steps (2 workers,
# one DDP bucket): a new reducer adds its line here, and the figure says what it puts on the wire.
PSGD_RANK = 2
REDUCER_JOBS = {
    "none": (S("vector_avg"), 6, 0),
    "allreduce": (S("ddp"), 6, all_reduce_bytes(4 * N_PARAMS, 2)),
    "fp16": (S("fp16"), 6, all_reduce_bytes(2 * N_PARAMS, 2)),
    "bf16": (S("fp16", reducer={"kind": "bf16"}), 6, all_reduce_bytes(2 * N_PARAMS, 2)),
    "powersgd": (
        S("powersgd", reducer={"matrix_rank": PSGD_RANK, "start_iter": 2}),
        5,
        all_reduce_bytes(4 * (PSGD_RANK * (96 + 64) + PSGD_RANK * (8 + 96) + 96 + 8), 2),
    ),
    "topk": (S("topk", reducer={"ratio": 0.05}), 6, all_gather_bytes(int(0.05 * N_PARAMS) * 8, 2)),
}


@pytest.mark.parametrize("kind", list(REDUCERS))
def test_every_reducer_pins_one_steps_bytes(tmp_path: Path, kind: str) -> None:
    """Each registered reducer, on real 2-process gloo: its last step's bytes exactly, and (a reducer that sends)
    replicas that stay equal."""
    assert kind in REDUCER_JOBS, f"reducer {kind!r} is registered but has no line in REDUCER_JOBS"
    sync, steps, expected = REDUCER_JOBS[kind]
    r = run(tmp_path, 2, sync, steps=steps)
    assert _sync(sync).reducer.kind == kind
    assert r["bytes"][-1] == expected
    if REDUCERS[kind].sends:
        assert max(r["div"]) < 1e-6
    else:
        assert r["div"][-1] > 1e-4  # every worker kept its own gradient: the replicas stepped apart


# One job per mixer in the MIXERS registry (world, sync, every step's bytes of one worker): a new mixer adds its line
# here. async_ps needs Ray: test_async_ps_pulls_are_counted_and_timed pins its bytes.
MIXER_JOBS = {
    "none": (2, S("vector_avg"), [0] * 6),
    "average": (2, S("local_sgd", mixer={"period": 4}), [0, 0, 0, all_reduce_bytes(4 * N_PARAMS, 2), 0, 0]),
    "gossip": (3, S("gossip", mixer={"topology": "ring", "period": 2}), [0, 2 * 4 * N_PARAMS] * 3),
    "diloco": (
        2,
        S("diloco", mixer={"period": 4, "pseudo_grad_dtype": "fp16"}),
        [0, 0, 0, all_reduce_bytes(2 * N_PARAMS, 2), 0, 0],
    ),
}


@pytest.mark.parametrize("kind", [k for k in MIXERS if k != "async_ps"])
def test_every_mixer_pins_its_bytes_per_step(tmp_path: Path, kind: str) -> None:
    """Each registered mixer on real gloo: every step's bytes exactly, and replicas equal right after a round."""
    assert kind in MIXER_JOBS, f"mixer {kind!r} is registered but has no line in MIXER_JOBS"
    world, sync, expected = MIXER_JOBS[kind]
    r = run(tmp_path, world, sync)
    assert _sync(sync).mixer.kind == kind
    assert r["bytes"] == expected
    assert r["div"][0] > 1e-5  # every worker stepped alone first: there was something to mix
    if kind in ("average", "diloco"):
        assert r["div"][3] < 1e-7  # right after its round


def test_neighbours_agree_across_ranks() -> None:
    for rnd in range(5):
        for world in (2, 3, 5, 6):
            pairs = {r: build_topology("random").neighbours(r, world, rnd) for r in range(world)}
            for r, ps in pairs.items():
                for p in ps:
                    assert r in pairs[p]
    assert build_topology("ring").neighbours(0, 4, 0) == [1, 3]
    assert build_topology("ring").neighbours(1, 2, 0) == [0]


def test_metrics_single_process_defaults() -> None:
    emb = torch.nn.functional.normalize(torch.randn(5, 4), dim=-1)
    assert replica_cosine(emb) == 0.0 and topk_jaccard(emb, emb) == 1.0


@pytest.mark.parametrize(
    "sync,key",
    [
        ({"reducer": {"kind": "nope"}}, "sync.reducer.kind"),
        ({"mixer": {"kind": "nope"}}, "sync.mixer.kind"),
        ({"reducer": {"kind": "none"}, "mixer": {"kind": "average", "period": 0}}, "sync.mixer.period"),
        ({"reducer": {"kind": "topk", "ratio": 1.5}}, "sync.reducer.ratio"),
        ({"reducer": {"kind": "topk", "ratio": 0.0}}, "sync.reducer.ratio"),
        ({"reducer": {"kind": "powersgd", "matrix_rank": 0}}, "sync.reducer.matrix_rank"),
        ({"reducer": {"kind": "none"}, "mixer": {"kind": "gossip", "topology": "star"}}, "sync.mixer.topology"),
        ({"scope": {"reducer": "nowhere"}}, "sync.scope.reducer"),
        ({"scope": {"reducer_params": ["("]}}, "sync.scope.reducer_params"),
        ({"reducer": {"kind": "none"}, "mixer": {"kind": "diloco", "outer_lr": 0.0}}, "sync.mixer.outer_lr"),
        (
            {"reducer": {"kind": "none"}, "mixer": {"kind": "diloco", "outer_momentum": 1.0}},
            "sync.mixer.outer_momentum",
        ),
        (
            {"reducer": {"kind": "none"}, "mixer": {"kind": "diloco", "pseudo_grad_dtype": "int8"}},
            "sync.mixer.pseudo_grad_dtype",
        ),
    ],
)
def test_bad_parameters_name_the_key_and_choices(sync: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        sync_config("ddp", **sync)
    assert key in str(e.value)


@pytest.mark.parametrize(
    "sync,key,named",
    [
        # a key of another kind: named, with the kinds that read it
        ({"reducer": {"kind": "topk", "matrix_rank": 4}}, "sync.reducer.matrix_rank", "['powersgd']"),
        (
            {"reducer": {"kind": "none"}, "mixer": {"kind": "gossip", "warmup_steps": 2}},
            "sync.mixer.warmup_steps",
            "['average', 'diloco']",
        ),
        ({"mixer": {"kind": "async_ps", "period": 3}}, "sync.mixer.period", "['average', 'gossip', 'diloco']"),
        (
            {"reducer": {"kind": "none"}, "mixer": {"kind": "gossip", "outer_lr": 0.5}},
            "sync.mixer.outer_lr",
            "['diloco']",
        ),
        # combinations that cannot work: the valid ones are named
        ({"mixer": {"kind": "average"}}, "sync.mixer.kind", "scope.reducer=intra_node + scope.mixer=inter_node"),
        (
            {"reducer": {"kind": "powersgd"}, "scope": {"reducer": "intra_node"}, "mixer": {"kind": "average"}},
            "sync.reducer.kind",
            "[allreduce]",
        ),
        ({"scope": {"reducer": "intra_node"}}, "sync.mixer.kind", "average or gossip or diloco"),
        (
            {"reducer": {"kind": "none"}, "mixer": {"kind": "average"}, "scope": {"mixer": "inter_node"}},
            "sync.scope.mixer",
            "[all]",
        ),
        (
            {"reducer": {"kind": "topk"}, "mixer": {"kind": "average"}, "scope": {"reducer_params": ["x"]}},
            "sync.scope.reducer_params",
            "[allreduce, fp16, bf16]",
        ),
        ({"scope": {"reducer_params": ["x"]}}, "sync.mixer.kind", "average or gossip or diloco"),
        (
            {"reducer": {"kind": "none"}, "mixer": {"kind": "async_ps"}, "consensus": "vectors"},
            "sync.mixer.kind",
            "consensus=params",
        ),
        ({"consensus": "vectors"}, "sync.consensus", "reducer.kind=none and mixer.kind=none"),
    ],
)
def test_unused_keys_and_invalid_combinations_fail_naming_the_valid_ones(sync: dict, key: str, named: str) -> None:
    with pytest.raises(ConfigError) as e:
        sync_config("ddp", **sync)
    assert key in str(e.value) and named in str(e.value), str(e.value)


def test_every_preset_is_a_composition() -> None:
    """Each conf/sync option types to reducer + mixer + scope; the family label the old strategy names used."""
    expect = {
        "ddp": ("allreduce", "none", "ddp"),
        "fp16": ("fp16", "none", "compressed"),
        "powersgd": ("powersgd", "none", "compressed"),
        "topk": ("topk", "none", "compressed"),
        "local_sgd": ("none", "average", "local_sgd"),
        "local_sgd_adaptive": ("none", "average", "local_sgd"),
        "local_sgd_network": ("none", "average", "local_sgd"),
        "diloco": ("none", "diloco", "diloco"),
        "diloco_network": ("none", "diloco", "diloco"),
        "gossip": ("none", "gossip", "gossip"),
        "hierarchical": ("allreduce", "average", "hierarchical"),
        "async_ps": ("none", "async_ps", "async_ps"),
        "vector_avg": ("none", "none", "vector_avg"),
        "hybrid_powersgd": ("powersgd", "none", "hybrid"),
        "layerwise": ("allreduce", "average", "layerwise"),
    }
    presets = sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "sync").glob("*.yaml"))
    assert presets == sorted(expect)
    for name, (reducer, mixer, family) in expect.items():
        c = sync_config(name)
        assert (c.reducer.kind, c.mixer.kind, c.strategy) == (reducer, mixer, family), name
    p = sync_config("powersgd")
    assert (p.reducer.matrix_rank, p.reducer.start_iter, p.reducer.ratio, p.mixer.period) == (4, 4, None, None)
    h = sync_config("hybrid_powersgd")
    assert (h.scope.reducer, h.reducer.matrix_rank, h.label) == ("two_level", 4, "hybrid_powersgd")
    assert sync_config("layerwise").mixer.period == 8 and SyncConfig().strategy == "ddp"


def test_comm_seconds_count_overlapping_collectives_once() -> None:
    """Two buckets in flight at the same time take 3 s of wall time, not 4: time_share can not exceed 1."""
    from ragtrain.sync.comm import CommStats

    stats = CommStats()
    stats.add("grad", 10, start=0.0, end=2.0)
    stats.add("grad", 10, start=1.0, end=3.0)
    stats.add("params", 5, start=2.5, end=4.0)  # overlaps grad too
    stats.add("embeddings", 7)  # bytes only
    assert stats.seconds == {"grad": 3.0, "params": 1.5}
    assert stats.total_seconds() == 4.0 and stats.total_bytes() == 32


def _powersgd_timing(rank: int, world: int, port: int, out: str, sync: SyncConfig) -> None:
    """PowerSGD on gloo with the real hook wrapped: record when each bucket's all-reduces were issued and done."""
    import importlib

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    module = importlib.import_module("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    real, spans = module.powerSGD_hook, []

    def recording_hook(state, bucket):
        issued = STATS.clock()
        fut = real(state, bucket)

        def done(f):
            spans.append((issued, STATS.clock()))
            return f.value()

        return fut.then(done)

    module.powerSGD_hook = recording_hook
    STATS.reset()
    model = _model()
    strategy = build_sync(sync)
    wrapped = strategy.wrap(model, torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(4):
        x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen)
        opt.zero_grad()
        ((wrapped(x) - y) ** 2).mean().backward()
        opt.step()
    if rank == 0:
        torch.save({"spans": spans, "recorded": list(STATS.intervals["grad"])}, out)
    dist.destroy_process_group()


def test_powersgd_on_gloo_times_its_communication(tmp_path: Path) -> None:
    """Every bucket's counted interval covers the real hook from its first all-reduce to its result."""
    out = str(tmp_path / "timing.pt")
    # 1 KB buckets: after DDP's rebuild at step 1 the two layers travel in two buckets
    sync = sync_config("powersgd", reducer={"matrix_rank": 2, "start_iter": 2}, bucket_cap_mb=0.001)
    spawn(_powersgd_timing, (2, _free_port(), out, sync), 2)
    r = torch.load(out, weights_only=True)
    assert len(r["spans"]) == len(r["recorded"]) == 1 + 2 * 3  # step 0: one bucket (DDP's first step), then two
    for (issued, done), (start, end) in zip(sorted(r["spans"]), sorted(r["recorded"])):
        assert start <= issued and end >= done, ((issued, done), (start, end))


def test_async_ps_pulls_are_counted_and_timed(ray_session) -> None:
    """max_staleness=0: every push is followed by a pull of the full parameters, counted as params_pull."""
    from ragtrain.sync.mixers.async_ps import AsyncPS

    STATS.reset()
    model = _model()
    strategy = AsyncPS(MixerConfig(kind="async_ps", max_staleness=0))
    strategy.bind(model)
    params = list(model.parameters())
    for step in range(3):
        with torch.no_grad():
            params[0].add_(0.01)
        strategy.after_step(params, step)
    assert strategy.pulls == 3
    assert STATS.bytes["params_pull"] == 3 * 4 * N_PARAMS == STATS.bytes["params"]
    assert len(STATS.intervals["params_pull"]) == 3 and STATS.seconds["params_pull"] > 0


class _ReverseRegistered(nn.Module):
    """Layers registered in the reverse of their use: DDP's first-step bucket and its rebuilt one differ in order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.second, self.first = nn.Linear(32, 16), nn.Linear(24, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def _topk_grads(rank: int, world: int, port: int, out: str, sync: SyncConfig) -> None:
    """Each step: this rank's raw local gradient (a plain copy of the model) and the gradient DDP applied."""
    import copy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _ReverseRegistered()
    plain = copy.deepcopy(model)
    strategy = build_sync(sync)
    wrapped = strategy.wrap(model, torch.device("cpu"))
    gen = torch.Generator().manual_seed(100 + rank)
    raw, applied = [], []
    for _ in range(4):  # no optimizer step: the weights stay put, only the data changes
        x = torch.randn(8, 24, generator=gen)
        for m in (wrapped, plain):
            m.zero_grad()
            (m(x) ** 2).mean().backward()
        raw.append(torch.cat([p.grad.reshape(-1) for p in plain.parameters()]))
        applied.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    torch.save({"raw": raw, "applied": applied}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_topk_error_feedback_stays_with_its_parameter(tmp_path: Path) -> None:
    """The applied gradients equal top-k with per-parameter error feedback simulated from the raw gradients, also
    after DDP rebuilds its bucket at step 1 (same size, parameters in another order)."""
    out = str(tmp_path / "topk")
    spawn(_topk_grads, (2, _free_port(), out, sync_config("topk", reducer={"ratio": 0.1})), 2)
    runs = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    residual = [torch.zeros_like(runs[0]["raw"][0]) for _ in runs]
    for step in range(4):
        expected = torch.zeros_like(residual[0])
        for r, run in enumerate(runs):  # one bucket holds every parameter: top-k over all of them
            v = run["raw"][step] + residual[r]
            idx = v.abs().topk(max(1, int(0.1 * v.numel())), sorted=False).indices
            expected.index_add_(0, idx, v[idx])
            residual[r] = v.clone()
            residual[r][idx] = 0
        expected /= 2
        for run in runs:
            torch.testing.assert_close(run["applied"][step], expected, atol=1e-6, rtol=1e-5, msg=f"step {step}")
    assert residual[0].abs().sum() > 0  # error feedback carried gradient between steps (not vacuous)


def test_restored_sync_state_moves_to_the_replicas_device() -> None:
    """Checkpoints load on the CPU (a GPU index may change across a restart): the strategy moves its top-k residuals
    and PowerSGD memories to the device wrap() was given. The meta device stands in for a GPU here."""
    from types import SimpleNamespace

    from ragtrain.sync.reducers.powersgd import load_powersgd_state

    strategy = build_sync(sync_config("topk", reducer={"ratio": 0.1}))
    strategy.wrap(nn.Linear(2, 2), torch.device("meta"))  # one process: no DDP, but the device is recorded
    strategy.load_state_dict({"topk_by_param": {"0": torch.ones(3), "2": torch.zeros(2)}})
    assert {k: v.device.type for k, v in strategy.scope.reducer.residuals.items()} == {0: "meta", 2: "meta"}
    saved = {
        "iter": 5,
        "error": {0: torch.ones(4)},
        "p": {0: torch.ones(2, 1)},
        "q": {0: torch.ones(2, 1)},
        "numel_before": 10,
        "numel_after": 4,
    }
    state = SimpleNamespace()
    load_powersgd_state(state, saved, torch.device("meta"))
    assert state.iter == 5 and state.total_numel_after_compression == 4
    assert all(
        t.device.type == "meta"
        for d in (state.error_dict, state.p_memory_dict, state.q_memory_dict)
        for t in d.values()
    )
