"""The retriever loss does not depend on the worker count: 2 gloo workers x B == 1 worker x 2B (loss and grads)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ragtrain.config.retriever import RetrieverConfig, TinyEncoderConfig
from ragtrain.embed.model import build_encoder
from ragtrain.retriever.loss import contrastive_loss
from ragtrain.retriever.train import QPEncoder
from tests.conftest import spawn

B, H, VOCAB = 4, 2, 1000  # per-worker batch, hard negatives per query


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _texts(n: int, gen: torch.Generator, max_len: int = 12) -> list[torch.Tensor]:
    return [
        torch.randint(5, VOCAB, (int(torch.randint(3, max_len, (1,), generator=gen)),), generator=gen) for _ in range(n)
    ]


def _pad(seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence of THIS batch (so 1 and 2 workers pad differently, as in real training)."""
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return {"input_ids": ids, "attention_mask": mask}


def global_batch():
    """2B queries, their positives (id i) and H negatives each (ids 1000 + ...); query 0 has a second gold
    passage that is the positive of query B + 1, i.e. it lives on the OTHER worker: it must be masked, not a
    negative."""
    gen = torch.Generator().manual_seed(1)
    n = 2 * B
    q, pos, neg = _texts(n, gen), _texts(n, gen, 20), _texts(n * H, gen, 20)
    gold = [[i] for i in range(n)]
    gold[0].append(B + 1)
    neg_ids = [1000 + j for j in range(n * H)]
    return q, pos, neg, gold, neg_ids


def _step(rank: int, world: int, port: int, out: str) -> None:
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg = RetrieverConfig(
        model="tiny", tiny=TinyEncoderConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    )
    model = QPEncoder(build_encoder(cfg))
    encoder = model.encoder
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    q, pos, neg, gold, neg_ids = global_batch()
    b = len(q) // world
    sl = slice(rank * b, (rank + 1) * b)
    mine_neg = slice(rank * b * H, (rank + 1) * b * H)
    p_ids = list(range(len(q)))[sl] + neg_ids[mine_neg]
    golds = gold[sl]
    gmax = max(len(g) for g in gold)
    q_gold = torch.tensor([g + [-1] * (gmax - len(g)) for g in golds])
    q_emb, p_emb = model(_pad(q[sl]), _pad(pos[sl] + neg[mine_neg]))
    loss = contrastive_loss(q_emb, p_emb, 0.05, q_gold, torch.tensor(p_ids))
    loss.backward()  # DDP averages the gradients across workers here
    global_loss = loss.detach().clone()
    if world > 1:
        dist.all_reduce(global_loss)
        global_loss /= world
    if rank == 0:
        grads = {k: p.grad.clone() for k, p in encoder.named_parameters() if p.grad is not None}
        torch.save({"loss": global_loss, "grads": grads}, out)
    if world > 1:
        dist.destroy_process_group()


def _run(world: int, tmp: Path) -> dict:
    out = str(tmp / f"w{world}.pt")
    if world == 1:
        _step(0, 1, 0, out)
    else:
        spawn(_step, (world, _free_port(), out), world)
    return torch.load(out, weights_only=True)


def test_two_workers_equal_one_worker_with_double_batch(tmp_path: Path) -> None:
    one, two = _run(1, tmp_path), _run(2, tmp_path)
    torch.testing.assert_close(two["loss"], one["loss"], atol=1e-5, rtol=0)
    assert set(one["grads"]) == set(two["grads"]) and len(one["grads"]) > 10
    for k in one["grads"]:
        torch.testing.assert_close(two["grads"][k], one["grads"][k], atol=1e-5, rtol=1e-5, msg=lambda m: f"{k}: {m}")
    # The comparison is not vacuous: the gradients are far from zero.
    assert max(g.abs().max().item() for g in one["grads"].values()) > 1e-3


def test_gold_masking_changes_loss() -> None:
    """A second gold passage in the batch is masked, not scored as a negative."""
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(2, 8), dim=-1)
    p = torch.nn.functional.normalize(torch.randn(2, 8), dim=-1)
    q_gold = torch.tensor([[0, 1], [1, -1]])
    masked = contrastive_loss(q, p, 0.1, q_gold, torch.tensor([0, 1]))
    plain = contrastive_loss(q, p, 0.1)
    # Query 0 sees only its positive after masking: loss term 0 exactly; query 1 is unchanged.
    s = q @ p.T / 0.1
    expected = (0 + torch.nn.functional.cross_entropy(s[1:], torch.tensor([1]))) / 2
    torch.testing.assert_close(masked, expected)
    assert not torch.isclose(masked, plain)


@pytest.mark.parametrize("temperature", [0.05, 1.0])
def test_loss_matches_cross_entropy_definition(temperature: float) -> None:
    torch.manual_seed(0)
    q, p = torch.randn(3, 5), torch.randn(6, 5)
    s = q @ p.T / temperature
    expected = -torch.log_softmax(s, dim=1)[torch.arange(3), torch.arange(3)].mean()
    torch.testing.assert_close(contrastive_loss(q, p, temperature), expected)


def _tiny_qp():
    torch.manual_seed(0)
    cfg = RetrieverConfig(
        model="tiny", tiny=TinyEncoderConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    )
    return QPEncoder(build_encoder(cfg))


def _rank_inputs(r: int, world: int):
    """Rank r's slice of `global_batch`: query texts, its passages (positives then negatives), their ids, golds."""
    q, pos, neg, gold, neg_ids = global_batch()
    b = len(q) // world
    sl, negs = slice(r * b, (r + 1) * b), slice(r * b * H, (r + 1) * b * H)
    gmax = max(len(g) for g in gold)
    q_gold = torch.tensor([g + [-1] * (gmax - len(g)) for g in gold[sl]])
    return _pad(q[sl]), _pad(pos[sl] + neg[negs]), torch.tensor(list(range(len(q)))[sl] + neg_ids[negs]), q_gold


def _local_step(rank: int, world: int, port: int, out: str) -> None:
    """A replica that trains apart (gossip): no DDP, gradient_groups from the strategy; save its own gradients."""
    from ragtrain.sync.composed import build_sync
    from tests.conftest import sync_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _tiny_qp()
    groups = build_sync(sync_config("gossip")).gradient_groups(0)
    q, p, p_ids, q_gold = _rank_inputs(rank, world)
    q_emb, p_emb = model(q, p)
    loss = contrastive_loss(q_emb, p_emb, 0.05, q_gold, p_ids, grad_groups=groups)
    loss.backward()
    torch.save(
        {
            "groups": groups,
            "loss": loss.detach(),
            "grads": {k: p.grad.clone() for k, p in model.encoder.named_parameters() if p.grad is not None},
        },
        f"{out}.{rank}",
    )
    dist.destroy_process_group()


def test_replicas_that_train_apart_get_the_gradient_of_their_own_loss(tmp_path: Path) -> None:
    """gossip / local SGD / vector_avg: each worker's gradient == the single-process gradient of ITS loss, with the
    other worker's passages as constant negatives (not the sum of both workers' passage-side gradients)."""
    out = str(tmp_path / "local")
    spawn(_local_step, (2, _free_port(), out), 2)
    for r in range(2):
        got = torch.load(f"{out}.{r}", weights_only=True)
        assert got["groups"] == [[0], [1]]
        model = _tiny_qp()
        q, p, p_ids, q_gold = _rank_inputs(r, 2)
        _, other_p, other_ids, _ = _rank_inputs(1 - r, 2)
        q_emb, p_emb = model(q, p)
        with torch.no_grad():
            _, other_emb = model(q, other_p)
        # one process, own passages first (its positives stay at rows 0..B-1), the other worker's as constants
        ref = contrastive_loss(q_emb, torch.cat([p_emb, other_emb]), 0.05, q_gold, torch.cat([p_ids, other_ids]))
        ref.backward()
        torch.testing.assert_close(got["loss"], ref.detach(), atol=1e-5, rtol=0)
        grads = {k: p.grad for k, p in model.encoder.named_parameters() if p.grad is not None}
        assert set(grads) == set(got["grads"]) and len(grads) > 10
        for k in grads:
            torch.testing.assert_close(
                got["grads"][k], grads[k], atol=1e-5, rtol=1e-5, msg=lambda m: f"rank {r} {k}: {m}"
            )


GROUPS = [[0, 1], [2]]  # hierarchical: ranks 0, 1 on one node, rank 2 alone on another


def _group_step(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(2, 4, generator=gen, requires_grad=True)
    p = torch.randn(2, 4, generator=gen, requires_grad=True)
    contrastive_loss(q, p, 0.5, grad_groups=GROUPS).backward()
    torch.save({"q": q.detach(), "p": p.detach(), "q_grad": q.grad, "p_grad": p.grad}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_hierarchical_gradients_flow_inside_the_node_only(tmp_path: Path) -> None:
    """A rank's passages get the gradient of the losses of its node's ranks only (single-process reference)."""
    out = str(tmp_path / "group")
    spawn(_group_step, (3, _free_port(), out), 3)
    got = [torch.load(f"{out}.{r}", weights_only=True) for r in range(3)]
    q = [g["q"].clone().requires_grad_() for g in got]
    p = [g["p"].clone().requires_grad_() for g in got]
    total = 0
    for r in range(3):  # rank r's loss: its queries vs every passage, other nodes' passages constant
        mine = next(g for g in GROUPS if r in g)
        p_all = torch.cat([p[j] if j in mine else p[j].detach() for j in range(3)])
        scores = q[r] @ p_all.T / 0.5
        total = total + torch.nn.functional.cross_entropy(scores, torch.arange(2) + 2 * r)
    total.backward()
    for r in range(3):
        torch.testing.assert_close(got[r]["q_grad"], q[r].grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got[r]["p_grad"], p[r].grad, atol=1e-6, rtol=1e-5)
    assert got[2]["p_grad"].abs().sum() > 0  # rank 2 still learns from its own queries


def test_strategies_name_whose_gradients_they_average() -> None:
    """DDP-like strategies: every rank; replicas that train apart: their own rank; local SGD switches after warm-up."""
    from ragtrain.sync.composed import build_sync
    from tests.conftest import sync_config

    # hierarchical and hybrid on one node are DDP
    for name in ("ddp", "fp16", "powersgd", "topk", "hierarchical", "hybrid_powersgd"):
        assert build_sync(sync_config(name)).gradient_groups(5) is None
    for name in ("gossip", "vector_avg", "local_sgd", "layerwise"):  # layer-wise: the lower layers train apart
        assert build_sync(sync_config(name)).gradient_groups(5) == [[0]]
    local = build_sync(sync_config("local_sgd", mixer={"warmup_steps": 2}))
    assert [local.gradient_groups(s) for s in range(4)] == [None, None, [[0]], [[0]]]
