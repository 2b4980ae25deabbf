"""KL estimators, KL in the reward and the KL-coefficient controllers."""

import math

import pytest
import torch

from mm_rl.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    kl_penalty,
    make_kl_controller,
)
from mm_rl.config.schema import KlControlConfig

LOGP = torch.tensor([-1.0, -2.0])
REF = torch.tensor([-1.5, -1.0])  # d = logp - ref = (0.5, -1.0)


def test_estimators_hand_values():
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k1"), torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(kl_penalty(LOGP, REF, "abs"), torch.tensor([0.5, 1.0]))
    for kind in ("k2", "mse"):
        torch.testing.assert_close(kl_penalty(LOGP, REF, kind), torch.tensor([0.125, 0.5]))
    # k3 = exp(ref - logp) - (ref - logp) - 1
    k3 = torch.tensor([math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1])
    for kind in ("k3", "low_var_kl"):
        torch.testing.assert_close(kl_penalty(LOGP, REF, kind), k3)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(LOGP, REF, "k4")


def test_k3_nonnegative_and_clamped():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(1000, generator=gen) * 5
    ref = torch.randn(1000, generator=gen) * 5
    k3 = kl_penalty(logp, ref, "k3")
    assert (k3 >= 0).all() and (k3 <= 10).all()
    # far apart in either direction: clamped to 10, finite, no gradient
    logp = torch.tensor([0.0, -100.0, -30.0, 30.0], requires_grad=True)
    ref = torch.tensor([0.0, 0.0, 0.0, 0.0])
    out = kl_penalty(logp, ref, "low_var_kl")
    assert out.tolist()[1:] == [10.0, 10.0, 10.0] and out[0].item() == 0.0
    out.sum().backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad[1:] == 0).all()


def test_k3_gradient_inside_the_clamp():
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
    logp = torch.tensor([-1.0], requires_grad=True)
    kl_penalty(logp, torch.tensor([-1.5]), "k3").sum().backward()
    assert logp.grad.item() == pytest.approx(1 - math.exp(-0.5))


def test_apply_kl_in_reward_hand_values():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, 5.0]], requires_grad=True)
    ref = torch.tensor([[-1.2, -0.6, -1.0], [-2.3, -1.9, 0.0]])
    # k1 per token: row 0 (0.2, -0.4, 0), row 1 (0.3, -0.1, masked)
    rewards, m = apply_kl_in_reward(scores, logp, ref, mask, kl_coef=0.5, kind="k1")
    expected = torch.tensor([[-0.1, 0.2, 1.0], [-0.15, 0.55, 0.0]])
    torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-6)
    assert not rewards.requires_grad
    # kl metric: mean over sequences of the per-sequence token mean: ((-0.2 / 3) + (0.2 / 2)) / 2
    assert m["kl"].item() == pytest.approx((-0.2 / 3 + 0.2 / 2) / 2, abs=1e-6)
    assert m["kl_coef"].item() == pytest.approx(0.5)


def test_adaptive_controller_hand_values_and_direction():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    ctl.update(current_kl=2.0, n_steps=10)  # error clipped to +0.2 -> x (1 + 0.2 * 10 / 100)
    assert ctl.value == pytest.approx(0.1 * 1.02)
    ctl.update(current_kl=0.95, n_steps=10)  # error -0.05 -> x (1 - 0.05 * 0.1)
    assert ctl.value == pytest.approx(0.1 * 1.02 * 0.995)
    ctl.update(current_kl=0.0, n_steps=100)  # error clipped to -0.2 -> x 0.8
    assert ctl.value == pytest.approx(0.1 * 1.02 * 0.995 * 0.8)
    # KL above target: the coefficient only grows; below: only shrinks; at target: unchanged
    up, down, same = (AdaptiveKLController(0.1, 0.05, 1000) for _ in range(3))
    for _ in range(20):
        up.update(0.2, 16)
        down.update(0.01, 16)
        same.update(0.05, 16)
    assert up.value > 0.1 > down.value and same.value == pytest.approx(0.1)


def test_adaptive_controller_closes_the_loop():
    # a toy system whose KL is inversely proportional to the coefficient: the controller drives it to target
    ctl = AdaptiveKLController(0.01, target_kl=0.1, horizon=50)
    kl = lambda coef: 0.002 / coef
    for _ in range(500):
        ctl.update(kl(ctl.value), n_steps=8)
    assert kl(ctl.value) == pytest.approx(0.1, rel=0.01)


def test_controllers_checkpoint():
    ctl = AdaptiveKLController(0.1, 0.05, 100)
    ctl.update(1.0, 10)
    state = ctl.state_dict()
    fresh = AdaptiveKLController(0.1, 0.05, 100)
    fresh.load_state_dict(state)
    assert fresh.value == ctl.value
    fixed = FixedKLController(0.3)
    fixed.update(100.0, 10)
    assert fixed.value == 0.3
    other = FixedKLController(0.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.3
    with pytest.raises(ValueError, match="cannot load"):
        other.load_state_dict(state)


def test_make_kl_controller_from_config():
    fixed = make_kl_controller(KlControlConfig(type="fixed", kl_coef=0.02))
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.02
    adaptive = make_kl_controller(KlControlConfig(type="adaptive", kl_coef=0.02, target_kl=0.5, horizon=7))
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.02, 0.5, 7)
