"""Each model of joint training its own optimisation (ragtrain/joint/optim.py): its own clip norm, weight decay,
warm-up and learning rate, so the retriever's step does not depend on the generator's gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ragtrain.joint.optim import build_optimizer, clip_and_step
from ragtrain.runtime.errors import ConfigError
from tests.conftest import typed

SETTINGS = [
    "joint.retriever_lr=0.01",
    "joint.retriever_weight_decay=0.1",
    "joint.retriever_warmup_steps=4",
    "joint.retriever_grad_clip=0.5",
    "generator.train.lr=0.002",
    "generator.train.weight_decay=0.0",
    "generator.train.warmup_steps=2",
    "generator.train.grad_clip=1.0",
]


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(4, 3), nn.Linear(5, 2)  # stand-ins: the groups know nothing of what they hold


def _step(cfg, generator_scale: float) -> tuple[list[torch.Tensor], dict[str, float]]:
    """One optimizer step with the same retriever gradients (above its clip norm) and the generator's scaled."""
    encoder, generator = _models()
    optim, sched = build_optimizer(encoder, generator, cfg, steps=10)
    g = torch.Generator().manual_seed(1)
    for p in encoder.parameters():
        p.grad = 10 * torch.randn(p.shape, generator=g)
    for p in generator.parameters():
        p.grad = generator_scale * torch.randn(p.shape, generator=g)
    norms = clip_and_step(optim, sched)
    return [p.detach().clone() for p in encoder.parameters()], norms


def test_a_huge_generator_gradient_leaves_the_retrievers_update_as_a_tiny_one_does(tmp_path) -> None:
    cfg = typed([f"output_dir={tmp_path}", *SETTINGS])
    tiny, tiny_norms = _step(cfg, 1e-6)
    huge, huge_norms = _step(cfg, 1e6)
    assert huge_norms["grad_norm/generator"] > 1e12 * tiny_norms["grad_norm/generator"]
    assert huge_norms["grad_norm/retriever"] == tiny_norms["grad_norm/retriever"] > cfg.joint.retriever_grad_clip
    for a, b in zip(tiny, huge):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    moved = _models()[0]
    assert any((a - p).abs().max() > 0 for a, p in zip(tiny, moved.parameters()))  # the retriever did step


def test_each_group_has_its_own_learning_rate_weight_decay_and_warm_up(tmp_path) -> None:
    cfg = typed([f"output_dir={tmp_path}", *SETTINGS])
    encoder, generator = _models()
    optim, sched = build_optimizer(encoder, generator, cfg, steps=10)
    retriever, gen = optim.param_groups
    assert retriever["params"] == list(encoder.parameters())
    assert (retriever["weight_decay"], gen["weight_decay"]) == (0.1, 0.0)
    assert (retriever["grad_clip"], gen["grad_clip"]) == (0.5, 1.0)
    lrs = []
    for _ in range(4):
        lrs.append(sched.get_last_lr())
        optim.step()
        sched.step()
    # warm-up: the retriever over 4 steps, the generator over 2, then each decays linearly to 0 at step 10
    assert [r for r, _ in lrs] == pytest.approx([0.01 * s / 4 for s in (1, 2, 3, 4)])
    assert [g for _, g in lrs] == pytest.approx([0.002 / 2, 0.002, 0.002 * 8 / 8, 0.002 * 7 / 8])


@pytest.mark.parametrize("key", ["retriever_weight_decay", "retriever_warmup_steps", "retriever_grad_clip"])
def test_a_negative_setting_is_refused_naming_its_key(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^joint\.{key} must be >= 0, got -1"):
        typed([f"joint.{key}=-1"])
