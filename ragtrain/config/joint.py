"""The `joint:` group: retriever and generator trained together on the run's index (ragtrain/joint/train.py)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ragtrain.config.registry import Variant
from ragtrain.runtime.errors import check as _check


@dataclass(frozen=True)
class JointLossVariant(Variant):
    """A retriever loss from the generator's answer likelihoods (ragtrain/joint/losses/)."""

    temperature: bool = True  # reads joint.temperature (the generator side's softmax); emdr2 has none


# The registry of `joint.loss`: name -> the class and the facts the checks read (docs/adding-a-variant.md)
JOINT_LOSSES: dict[str, JointLossVariant] = {
    "pdist": JointLossVariant("ragtrain.joint.losses.pdist:PerplexityDistillation"),
    "emdr2": JointLossVariant("ragtrain.joint.losses.emdr2:EMDR2", temperature=False),
    "lsr": JointLossVariant("ragtrain.joint.losses.lsr:ReplugLSR"),
}


class PassageEncoder(str, Enum):
    frozen = "frozen"  # query side only: the stored passage vectors stay valid, no refresh
    trained = "trained"  # the passage side learns too: the live refresh on the index shards keeps the index fresh


@dataclass
class JointConfig:
    """Joint training (stages: [..., index, joint]): per question the top_k passages of the live index, the
    generator's answer log-likelihood given each as the target of the retriever's softmax over their scores
    (`loss`), plus the generator's own NLL on the answer given its top passages."""

    loss: str = "pdist"  # a name in JOINT_LOSSES: pdist | emdr2 | lsr
    passage_encoder: PassageEncoder = PassageEncoder.frozen
    top_k: int = 4  # passages per question scored by the generator (the retriever's softmax runs over them)
    temperature: float = 1.0  # generator side (pdist / lsr): softmax(loglik / temperature)
    retriever_temperature: float = 0.1  # retriever side: softmax(scores / retriever_temperature)
    retriever_weight: float = 1.0  # weight of the joint loss in the total
    generator_weight: float = 1.0  # weight of the generator's per-token NLL in the total
    # the retriever's own optimisation (the generator's is generator.train's lr, weight_decay, warmup_steps and
    # grad_clip): each model is clipped by its own gradient norm, so neither's step depends on the other's gradients
    retriever_lr: float = 2e-5
    retriever_weight_decay: float = 0.01
    retriever_warmup_steps: int = 2  # linear warm-up, then linear decay to 0 at max_steps
    retriever_grad_clip: float = 1.0  # max gradient norm of the encoder's parameters (0 = off)
    max_steps: int = 20
    batch_size: int = 4  # questions per worker per step
    log_every: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        k = "joint."
        _check(self.loss in JOINT_LOSSES, k + "loss", f"must be one of {list(JOINT_LOSSES)}", self.loss)
        _check(self.top_k > 1, k + "top_k", "must be > 1 (a softmax over one passage learns nothing)", self.top_k)
        _check(self.temperature > 0, k + "temperature", "must be > 0", self.temperature)
        readers = [name for name, v in JOINT_LOSSES.items() if v.temperature]
        _check(
            JOINT_LOSSES[self.loss].temperature or self.temperature == 1.0,
            k + "temperature",
            f"applies to joint.loss in {readers} only ({self.loss} has no generator-side temperature)",
            self.temperature,
        )
        _check(self.retriever_temperature > 0, k + "retriever_temperature", "must be > 0", self.retriever_temperature)
        _check(self.retriever_weight >= 0, k + "retriever_weight", "must be >= 0", self.retriever_weight)
        _check(self.generator_weight >= 0, k + "generator_weight", "must be >= 0", self.generator_weight)
        _check(self.retriever_lr > 0, k + "retriever_lr", "must be > 0", self.retriever_lr)
        wd, warmup = self.retriever_weight_decay, self.retriever_warmup_steps
        _check(wd >= 0, k + "retriever_weight_decay", "must be >= 0", wd)
        _check(warmup >= 0, k + "retriever_warmup_steps", "must be >= 0", warmup)
        _check(self.retriever_grad_clip >= 0, k + "retriever_grad_clip", "must be >= 0", self.retriever_grad_clip)
        _check(self.max_steps > 0, k + "max_steps", "must be > 0", self.max_steps)
        _check(self.batch_size > 0, k + "batch_size", "must be > 0", self.batch_size)
        _check(self.log_every > 0, k + "log_every", "must be > 0", self.log_every)
