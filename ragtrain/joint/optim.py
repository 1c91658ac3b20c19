"""Each model of joint training its own optimisation: one AdamW with one parameter group per model (the retriever's
encoder first, the generator second), each with its own learning rate, weight decay, warm-up and gradient clip norm
(`joint.retriever_*`; the generator's from `generator.train`). Adam's update is per parameter, so two groups are
two independent optimizers; one optimizer and one schedule keep the checkpoint to the harness's one of each.

Each group is clipped by its own gradient norm: with one norm over both models, a large generator gradient would
shrink the retriever's step (and the other way round)."""

from __future__ import annotations

import torch
from torch import nn

from ragtrain.config import Config
from ragtrain.train.schedule import warmup_linear_decay

GROUPS = ("retriever", "generator")  # the parameter groups' order


def build_optimizer(
    encoder: nn.Module, generator: nn.Module, cfg: Config, steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over both models, a group each (its clip norm kept in the group as `grad_clip`), and the linear
    warm-up / decay schedule with each group's own warm-up."""
    j, t = cfg.joint, cfg.generator.train
    settings = [
        (encoder, j.retriever_lr, j.retriever_weight_decay, j.retriever_warmup_steps, j.retriever_grad_clip),
        (generator, t.lr, t.weight_decay, t.warmup_steps, t.grad_clip),
    ]
    groups = [
        {"params": [p for p in m.parameters() if p.requires_grad], "lr": lr, "weight_decay": wd, "grad_clip": clip}
        for m, lr, wd, _, clip in settings
    ]
    optim = torch.optim.AdamW(groups)
    # a warm-up as long as training would never reach the decay: at most steps - 1 (as the generator stage's)
    warmups = [min(w, steps - 1) if steps > 1 else 0 for _, _, _, w, _ in settings]
    return optim, warmup_linear_decay(optim, warmups, steps)


def clip_and_step(optim: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler) -> dict[str, float]:
    """Clip each group by its own norm, step, clear the gradients, advance the schedule; returns each group's
    gradient norm before clipping (`grad_norm/<group>`)."""
    norms = {}
    for name, group in zip(GROUPS, optim.param_groups):
        params = [p for p in group["params"] if p.grad is not None]
        clip = group["grad_clip"] if group["grad_clip"] > 0 else float("inf")  # inf: measured, never scaled
        norms[f"grad_norm/{name}"] = float(torch.nn.utils.clip_grad_norm_(params, clip)) if params else 0.0
    optim.step()
    optim.zero_grad(set_to_none=True)
    sched.step()
    return norms
