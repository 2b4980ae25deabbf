"""Loss aggregation, the clipped policy loss and the actor loss: hand values, gradients, masking."""

import math

import pytest
import torch

from mm_rl.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss
from mm_rl.algorithms.policy_loss import actor_loss, policy_loss
from mm_rl.config.schema import RLConfig

# ------------------------------------------------------------------------------------------- aggregation
# rows of length 3, 2 and 0 (an all-padding row); the 99s are under the mask
LOSS = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 5.0, 99.0, 99.0], [99.0, 99.0, 99.0, 99.0]])
AGG_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


def test_aggregation_hand_values():
    assert aggregate_loss(LOSS, AGG_MASK, "token-mean").item() == pytest.approx(15 / 5)
    assert aggregate_loss(LOSS, AGG_MASK, "seq-mean-token-sum").item() == pytest.approx((6 + 9) / 2)
    assert aggregate_loss(LOSS, AGG_MASK, "seq-mean-token-mean").item() == pytest.approx((6 / 3 + 9 / 2) / 2)
    assert aggregate_loss(LOSS, AGG_MASK, "seq-mean-token-sum-norm", horizon=10).item() == pytest.approx(
        (6 / 10 + 9 / 10) / 2)


def test_token_mean_uneven_lengths_is_not_mean_of_means():
    loss = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    # token-mean: (4 * 1 + 5) / 5 = 1.8; the mean of the per-sequence means would be (1 + 5) / 2 = 3
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(1.8)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)


def test_aggregation_denominator_for_micro_batches():
    # split the batch in two micro-batches; summing with the global denominators gives the full-batch value
    for mode, denom in (("token-mean", 5), ("seq-mean-token-sum", 2), ("seq-mean-token-mean", 2),
                        ("seq-mean-token-sum-norm", 2)):
        full = aggregate_loss(LOSS, AGG_MASK, mode, horizon=10)
        parts = sum(aggregate_loss(LOSS[i:i + 1], AGG_MASK[i:i + 1], mode, horizon=10, denominator=denom)
                    for i in range(3))
        assert parts.item() == pytest.approx(full.item()), mode


def test_aggregation_empty_and_errors():
    x = torch.ones(2, 3, requires_grad=True)
    for mode in LOSS_AGG_MODES:
        out = aggregate_loss(x, torch.zeros(2, 3), mode, horizon=3)
        assert out.item() == 0.0
        out.backward()
    with pytest.raises(ValueError, match="horizon"):
        aggregate_loss(LOSS, AGG_MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        aggregate_loss(LOSS, AGG_MASK, "sum")


# ------------------------------------------------------------------------------------------- policy loss
# (ratio, advantage) per valid token, clip_ratio_low 0.2, clip_ratio_high 0.28, clip_ratio_c 3:
#   t1 (1.1,  1)  unclipped      -> -1.1
#   t2 (1.5,  1)  clipped high   -> -1.28         (no gradient)
#   t3 (0.5, -1)  clipped low    ->  0.8          (no gradient)
#   t4 (4.0, -1)  dual clip      ->  min(4, 3) = 3 (no gradient)
#   t5 (0.9, -2)  unclipped      ->  1.8
#   t6 (0.5,  2)  unclipped (A > 0 is only clipped above) -> -1.0
#   t7 (1.0, .5)  unclipped      -> -0.5
# row 0 = t1 t2 t3 (+ 1 pad), row 1 = t4 t5 t6 t7
RATIOS = torch.tensor([[1.1, 1.5, 0.5, 1.0], [4.0, 0.9, 0.5, 1.0]])
ADV = torch.tensor([[1.0, 1.0, -1.0, 0.0], [-1.0, -2.0, 2.0, 0.5]])
PG_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
TOKEN_LOSS = [[-1.1, -1.28, 0.8], [3.0, 1.8, -1.0, -0.5]]
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}


def _inputs():
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.7, -2.2, -0.1]])
    logprob = (old + RATIOS.log()).clone().requires_grad_(True)
    return logprob, old


def test_policy_loss_hand_values_and_metrics():
    logprob, old = _inputs()
    loss, m = policy_loss(logprob, old, ADV, PG_MASK, **CLIP, loss_agg_mode="token-mean")
    row0, row1 = sum(TOKEN_LOSS[0]), sum(TOKEN_LOSS[1])
    assert loss.item() == pytest.approx((row0 + row1) / 7, abs=1e-6)
    assert m["pg_loss"].item() == pytest.approx(loss.item())
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 7)
    assert m["pg_clipfrac_high"].item() == pytest.approx(1 / 7)
    assert m["pg_clipfrac_low"].item() == pytest.approx(1 / 7)
    assert m["pg_clipfrac_dual"].item() == pytest.approx(1 / 7)
    logs = [math.log(r) for r in (1.1, 1.5, 0.5, 4.0, 0.9, 0.5, 1.0)]
    assert m["ppo_kl"].item() == pytest.approx(-sum(logs) / 7, abs=1e-6)
    for mode, expected in (("seq-mean-token-sum", (row0 + row1) / 2),
                           ("seq-mean-token-mean", (row0 / 3 + row1 / 4) / 2),
                           ("seq-mean-token-sum-norm", (row0 / 8 + row1 / 8) / 2)):
        loss, _ = policy_loss(logprob, old, ADV, PG_MASK, **CLIP, loss_agg_mode=mode, horizon=8)
        assert loss.item() == pytest.approx(expected, abs=1e-6), mode


def test_policy_loss_gradient_zero_exactly_where_clipped():
    logprob, old = _inputs()
    loss, _ = policy_loss(logprob, old, ADV, PG_MASK, **CLIP)
    loss.backward()
    g = logprob.grad
    # d(-A r)/d logprob = -A r, divided by the 7 valid tokens
    expected = torch.tensor([[-1.1, 0.0, 0.0, 0.0], [0.0, 1.8, -1.0, -0.5]]) / 7
    torch.testing.assert_close(g, expected, rtol=0, atol=1e-6)
    assert (g[0, 1:] == 0).all() and g[1, 0] == 0  # clipped high, clipped low, pad, dual clip
    assert (g[0, 0] != 0) and (g[1, 1:] != 0).all()


def test_dual_clip_bounds_negative_advantage_loss():
    ratios = torch.tensor([[0.1, 1.0, 2.0, 3.5, 10.0, 1e3, 1e8]])
    mask = torch.ones_like(ratios)
    for a in (-0.5, -1.0, -4.0):
        adv = torch.full_like(ratios, a)
        logprob = ratios.log().requires_grad_(True)
        loss, m = policy_loss(logprob, torch.zeros_like(ratios), adv, mask, 0.2, 0.2, 3.0,
                              loss_agg_mode="seq-mean-token-sum")
        per_token = []
        for r in ratios[0].tolist():
            ppo = max(-a * r, -a * min(max(r, 0.8), 1.2))
            per_token.append(min(ppo, -a * 3.0))
        assert loss.item() == pytest.approx(sum(per_token), rel=1e-6)
        assert max(per_token) <= 3.0 * abs(a) + 1e-9
        loss.backward()
        g = logprob.grad[0]
        assert (g[3:] == 0).all() and g[0] == 0  # ratio > c: constant loss; ratio 0.1: clipped low
        assert (g[1:3] != 0).all()
        assert m["pg_clipfrac_dual"].item() == pytest.approx(4 / 7)
        assert m["pg_clipfrac_low"].item() == pytest.approx(1 / 7)
    # without the dual clip (PPO alone) the loss would be unbounded: check against the single-token value
    loss, _ = policy_loss(torch.tensor([[math.log(1e8)]]), torch.zeros(1, 1), torch.tensor([[-1.0]]),
                          torch.ones(1, 1), 0.2, 0.2, 3.0)
    assert loss.item() == pytest.approx(3.0)


def test_clip_higher_asymmetric_bounds():
    # A > 0: ratio 1.25 is clipped with high 0.2, not with high 0.28
    logprob = torch.tensor([[math.log(1.25)]])
    zero, one, mask = torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    loss, m = policy_loss(logprob, zero, one, mask, 0.2, 0.2, 3.0)
    assert loss.item() == pytest.approx(-1.2) and m["pg_clipfrac_high"].item() == 1.0
    loss, m = policy_loss(logprob, zero, one, mask, 0.2, 0.28, 3.0)
    assert loss.item() == pytest.approx(-1.25) and m["pg_clipfrac"].item() == 0.0
    # A < 0: ratio 0.75 is clipped with low 0.2 (bound 0.8) -> loss 0.8
    loss, m = policy_loss(torch.tensor([[math.log(0.75)]]), zero, -one, mask, 0.2, 0.28, 3.0)
    assert loss.item() == pytest.approx(0.8) and m["pg_clipfrac_low"].item() == 1.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logprob, zero, one, mask, 0.2, 0.2, 1.0)


def _loss_and_grads(logprob, old, ref, adv, entropy, mask, cfg):
    lp = logprob.clone().requires_grad_(True)
    ent = entropy.clone().requires_grad_(True)
    loss, _ = actor_loss(lp, old, ref, adv, mask, ent, cfg, max_response_len=6)
    loss.backward()
    return loss.detach(), lp.grad, ent.grad


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_tokens_have_no_effect(mode):
    gen = torch.Generator().manual_seed(3)
    shape = (4, 6)
    mask = (torch.arange(6) < torch.tensor([[6], [2], [4], [0]])).long()
    old = -torch.rand(shape, generator=gen) * 2
    logprob = old + 0.3 * torch.randn(shape, generator=gen)
    ref = old + 0.3 * torch.randn(shape, generator=gen)
    adv = torch.randn(shape, generator=gen)
    entropy = torch.rand(shape, generator=gen)
    cfg = RLConfig(loss_agg_mode=mode, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
                   entropy_coeff=0.01, clip_ratio_high=0.28)
    base = _loss_and_grads(logprob, old, ref, adv, entropy, mask, cfg)
    pad = mask == 0
    garbage = [t.clone() for t in (logprob, old, ref, adv, entropy)]
    for t, v in zip(garbage, (50.0, float("-inf"), float("nan"), 1e6, float("inf")), strict=True):
        t[pad] = v
    other = _loss_and_grads(*garbage, mask, cfg)
    for a, b in zip(base, other, strict=True):
        assert torch.equal(a, b)
    assert (base[1][pad] == 0).all() and torch.isfinite(base[0])


def test_actor_loss_hand_values():
    # ratio 1 everywhere: pg = token mean of -A = mean(-1, 1) = 0; log(pi / ref) = (0.2, -0.4)
    logprob = torch.tensor([[-1.0, -2.0, -5.0]], requires_grad=True)
    old = logprob.detach().clone()
    ref = torch.tensor([[-1.2, -1.6, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 3.0]])
    mask = torch.tensor([[1, 1, 0]])
    entropy = torch.tensor([[1.0, 2.0, 7.0]])
    cfg = RLConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1", entropy_coeff=0.01)
    loss, m = actor_loss(logprob, old, ref, adv, mask, entropy, cfg, max_response_len=3)
    assert m["pg_loss"].item() == pytest.approx(0.0, abs=1e-7)
    assert m["kl_loss"].item() == pytest.approx((0.2 - 0.4) / 2, abs=1e-6)
    assert m["entropy"].item() == pytest.approx(1.5)
    assert m["approx_kl"].item() == pytest.approx(0.0, abs=1e-7)
    assert loss.item() == pytest.approx(0.0 + 0.1 * -0.1 - 0.01 * 1.5, abs=1e-6)
    assert m["loss"].item() == pytest.approx(loss.item())
    assert {"pg_clipfrac", "pg_clipfrac_high", "pg_clipfrac_low", "pg_clipfrac_dual"} <= set(m)
    # k3 and seq-mean-token-sum-norm (horizon 4): every term is sum / 4
    cfg = RLConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", entropy_coeff=0.01,
                   loss_agg_mode="seq-mean-token-sum-norm")
    k3 = (math.exp(-0.2) + 0.2 - 1) + (math.exp(0.4) - 0.4 - 1)
    loss, m = actor_loss(logprob, old, ref, adv, mask, entropy, cfg, max_response_len=4)
    assert m["kl_loss"].item() == pytest.approx(k3 / 4, abs=1e-6)
    assert loss.item() == pytest.approx(0.0 + 0.1 * k3 / 4 - 0.01 * 3.0 / 4, abs=1e-6)
    # kl off: reported, not in the loss; no entropy coefficient, no entropy given
    cfg = RLConfig(use_kl_loss=False, entropy_coeff=0.0)
    loss, m = actor_loss(logprob, old, ref, adv, mask, None, cfg, max_response_len=3)
    assert loss.item() == pytest.approx(0.0, abs=1e-7) and "kl_loss" in m and "entropy" not in m
    loss, m = actor_loss(logprob, old, None, adv, mask, None, cfg, max_response_len=3)
    assert "kl_loss" not in m


def test_actor_loss_requirements():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logprob"):
        actor_loss(x, x, None, x, torch.ones(1, 2), None, RLConfig(use_kl_loss=True), 2)
    with pytest.raises(ValueError, match="entropy"):
        actor_loss(x, x, x, x, torch.ones(1, 2), None, RLConfig(entropy_coeff=0.1), 2)
