"""Each joint loss: its value and its gradient w.r.t. the retriever's scores against hand-worked numbers, a numpy
reference from the formulas in docs/joint-training.md, and torch.autograd.gradcheck in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ragtrain.config.joint import JOINT_LOSSES, JointConfig
from ragtrain.joint.losses.base import JointLoss, build_loss
from ragtrain.joint.losses.emdr2 import EMDR2
from ragtrain.joint.losses.lsr import ReplugLSR
from ragtrain.joint.losses.pdist import PerplexityDistillation
from ragtrain.runtime.errors import ConfigError

# One question, two passages, equal retriever scores (p_R = [1/2, 1/2]); the generator's answer probability is 0.6
# with passage 1 and 0.2 with passage 2, so its posterior over the passages is [3/4, 1/4].
HAND_SCORES = [[0.0, 0.0]]
HAND_LOGLIK = [[math.log(0.6), math.log(0.2)]]
HAND = {
    # KL([3/4, 1/4] || [1/2, 1/2]) = 3/4 ln(3/2) + 1/4 ln(1/2); gradient p_R - p_LM
    "pdist": (0.75 * math.log(1.5) + 0.25 * math.log(0.5), [-0.25, 0.25]),
    # -ln(1/2 * 0.6 + 1/2 * 0.2) = -ln 0.4; gradient p_R - posterior = [1/2 - 3/4, 1/2 - 1/4]
    "emdr2": (-math.log(0.4), [-0.25, 0.25]),
    # KL([1/2, 1/2] || [3/4, 1/4]) = 1/2 ln(2/3) + 1/2 ln 2; gradient P_j (ln P_j - ln Q_j - KL)
    "lsr": (
        0.5 * math.log(2 / 3) + 0.5 * math.log(2),
        [0.5 * (math.log(2 / 3) - (0.5 * math.log(2 / 3) + 0.5 * math.log(2))),
         0.5 * (math.log(2) - (0.5 * math.log(2 / 3) + 0.5 * math.log(2)))],
    ),
}  # fmt: skip


def _loss(name: str, tau: float = 1.0, theta: float = 1.0) -> JointLoss:
    """The loss a run with joint.loss=name and these temperatures trains with."""
    return build_loss(JointConfig(loss=name, temperature=tau, retriever_temperature=theta))


def _value_and_grad(loss, scores, loglik) -> tuple[float, np.ndarray]:
    s = torch.tensor(scores, dtype=torch.float64, requires_grad=True)
    value = loss(s, torch.tensor(loglik, dtype=torch.float64))
    value.backward()
    return value.item(), s.grad.numpy()


@pytest.mark.parametrize("name", sorted(HAND))
def test_hand_worked_case(name: str) -> None:
    value, grad = _value_and_grad(_loss(name), HAND_SCORES, HAND_LOGLIK)
    assert value == pytest.approx(HAND[name][0], abs=1e-12)
    np.testing.assert_allclose(grad[0], HAND[name][1], atol=1e-12)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _numpy_reference(name: str, s: np.ndarray, ll: np.ndarray, tau: float, theta: float) -> tuple[float, np.ndarray]:
    """Value and d/ds of the batch-mean loss, from the formulas (derived by hand, not by autograd)."""
    b = s.shape[0]
    p = _softmax(s / theta)
    if name == "pdist":
        t = _softmax(ll / tau)
        per_q = (t * (np.log(t) - np.log(p))).sum(-1)
        grad = (p - t) / theta
    elif name == "lsr":
        q = _softmax(ll / tau)
        per_q = (p * (np.log(p) - np.log(q))).sum(-1)
        grad = p * (np.log(p) - np.log(q) - per_q[:, None]) / theta
    else:
        joint = p * np.exp(ll)
        per_q = -np.log(joint.sum(-1))
        grad = (p - joint / joint.sum(-1, keepdims=True)) / theta
    return per_q.mean(), grad / b


@pytest.mark.parametrize("name", sorted(JOINT_LOSSES))
@pytest.mark.parametrize("tau,theta", [(1.0, 1.0), (0.5, 0.1), (2.0, 3.0)])
def test_matches_the_formula_on_a_random_batch(name: str, tau: float, theta: float) -> None:
    rng = np.random.default_rng(0)
    s, ll = rng.normal(size=(3, 5)), -rng.uniform(0.5, 12, size=(3, 5))
    tau = 1.0 if name == "emdr2" else tau  # emdr2 has no generator-side temperature
    value, grad = _value_and_grad(_loss(name, tau, theta), s.tolist(), ll.tolist())
    ref_value, ref_grad = _numpy_reference(name, s, ll, tau, theta)
    assert value == pytest.approx(ref_value, rel=1e-10)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("name", sorted(JOINT_LOSSES))
def test_gradcheck_float64(name: str) -> None:
    torch.manual_seed(0)
    s = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    ll = -torch.rand(2, 4, dtype=torch.float64) * 10
    loss = _loss(name, 1.0 if name == "emdr2" else 0.7, 0.3)
    assert torch.autograd.gradcheck(lambda x: loss(x, ll), (s,))


@pytest.mark.parametrize("name", sorted(JOINT_LOSSES))
def test_the_generator_likelihoods_are_a_target(name: str) -> None:
    """No gradient reaches the generator through these losses (it trains on its own loss)."""
    s = torch.randn(2, 3, requires_grad=True)
    ll = (-torch.rand(2, 3) * 5).requires_grad_()
    _loss(name)(s, ll).backward()
    assert ll.grad is None and s.grad is not None and s.grad.abs().sum() > 0


def test_lsr_and_pdist_are_the_two_directions_of_one_kl() -> None:
    """With equal temperatures, pdist = KL(Q || P) and lsr = KL(P || Q) (REPLUG's direction): they differ."""
    s, ll = torch.tensor([[2.0, 0.0, -1.0]]), torch.tensor([[-1.0, -0.5, -4.0]])
    p, q = torch.softmax(s, -1), torch.softmax(ll, -1)
    assert PerplexityDistillation()(s, ll).item() == pytest.approx((q * (q / p).log()).sum().item(), rel=1e-6)
    assert ReplugLSR()(s, ll).item() == pytest.approx((p * (p / q).log()).sum().item(), rel=1e-6)
    assert ReplugLSR()(s, ll).item() != pytest.approx(PerplexityDistillation()(s, ll).item(), rel=1e-3)


def test_registry_and_bad_names() -> None:
    """The config refuses a name the registry lacks, naming its names, and a temperature the loss would ignore."""
    assert set(JOINT_LOSSES) == {"pdist", "emdr2", "lsr"} and JOINT_LOSSES["emdr2"].load() is EMDR2
    with pytest.raises(ConfigError, match=r"joint.loss must be one of \['pdist', 'emdr2', 'lsr'\], got 'loop'"):
        JointConfig(loss="loop")
    with pytest.raises(ConfigError, match=r"joint.temperature applies to joint.loss in \['pdist', 'lsr'\] only"):
        JointConfig(loss="emdr2", temperature=0.5)
    with pytest.raises(ConfigError, match="must be > 0"):
        JointConfig(loss="pdist", retriever_temperature=0.0)
    with pytest.raises(ValueError, match=r"\[batch, k\]"):
        _loss("pdist")(torch.zeros(2, 3), torch.zeros(2, 4))
