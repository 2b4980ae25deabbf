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
        (6 / 10 + 9 / 10) / 2
    )


def test_token_mean_uneven_lengths_is_not_mean_of_means():
    loss = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    # token-mean: (4 * 1 + 5) / 5 = 1.8; the mean of the per-sequence means would be (1 + 5) / 2 = 3
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(1.8)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)


def test_aggregation_denominator_for_micro_batches():
    # split the batch in two micro-batches; summing with the global denominators gives the full-batch value
    for mode, denom in (
        ("token-mean", 5),
        ("seq-mean-token-sum", 2),
        ("seq-mean-token-mean", 2),
        ("seq-mean-token-sum-norm", 2),
    ):
        full = aggregate_loss(LOSS, AGG_MASK, mode, horizon=10)
        parts = sum(
            aggregate_loss(LOSS[i : i + 1], AGG_MASK[i : i + 1], mode, horizon=10, denominator=denom) for i in range(3)
        )
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
    for mode, expected in (
        ("seq-mean-token-sum", (row0 + row1) / 2),
        ("seq-mean-token-mean", (row0 / 3 + row1 / 4) / 2),
        ("seq-mean-token-sum-norm", (row0 / 8 + row1 / 8) / 2),
    ):
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
        loss, m = policy_loss(
            logprob, torch.zeros_like(ratios), adv, mask, 0.2, 0.2, 3.0, loss_agg_mode="seq-mean-token-sum"
        )
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
    loss, _ = policy_loss(
        torch.tensor([[math.log(1e8)]]), torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1), 0.2, 0.2, 3.0
    )
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
    cfg = RLConfig(
        loss_agg_mode=mode,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        entropy_coeff=0.01,
        clip_ratio_high=0.28,
    )
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
    cfg = RLConfig(
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="k3",
        entropy_coeff=0.01,
        loss_agg_mode="seq-mean-token-sum-norm",
    )
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


# ---------------------------------------------------------------------------------------- metric names (verl)
def test_ppo_kl_clamps_like_the_loss_and_pg_clipfrac_lower_is_the_dual_clip():
    # log-ratios 25 (clamped to 20 in the ratio) and 0.5; advantages -1 (dual clip: r = e^20 > 3) and +1
    logprob = torch.tensor([[25.0, 0.5]])
    loss, m = policy_loss(logprob, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), 0.2, 0.2, 3.0)
    assert m["ppo_kl"].item() == pytest.approx(-(20.0 + 0.5) / 2)  # verl: mean of -clamp(log-ratio, -20, 20)
    assert m["approx_kl"].item() == pytest.approx(-(25.0 + 0.5) / 2)  # unclamped, as before
    assert m["pg_clipfrac_lower"].item() == m["pg_clipfrac_dual"].item() == pytest.approx(1 / 2)
    assert m["pg_clipfrac_low"].item() == 0.0  # mm_rl's _low is the PPO clip below 1 - eps_low, not the dual one
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    cfg = RLConfig(use_kl_loss=False)
    _, m = actor_loss(logprob, torch.zeros(1, 2), None, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), None, cfg, 2)
    assert {"ppo_kl", "approx_kl", "pg_clipfrac_lower", "pg_clipfrac_dual"} <= set(m)


# ------------------------------------------------------------------------------------------------------ GSPO
def _gspo_inputs():
    # seq 0: log-ratios (0.1, 0.3) -> s = exp(0.2) = 1.2214, A = +1: clipped at 1.2
    # seq 1: log-ratios (0, -0.3, 0.15) -> s = exp(-0.05) = 0.9512, A = -2: inside the band
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -0.7]])
    log_ratio = torch.tensor([[0.1, 0.3, 0.0], [0.0, -0.3, 0.15]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return (old + log_ratio).requires_grad_(True), old, adv, mask


def test_gspo_sequence_ratio_clipped_per_sequence_hand_values():
    logprob, old, adv, mask = _gspo_inputs()
    loss, m = policy_loss(logprob, old, adv, mask, 0.2, 0.2, loss_agg_mode="seq-mean-token-mean", loss_type="gspo")
    s1 = math.exp(-0.05)
    # seq 0: max(-1.2214, -1.2) = -1.2 on both tokens; seq 1: max(2 s1, 2 s1) = 1.9025 on its three tokens
    assert loss.item() == pytest.approx((-1.2 + 2 * s1) / 2, abs=1e-6)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 5) and m["pg_clipfrac_high"].item() == pytest.approx(2 / 5)
    loss.backward()
    # seq 0 clipped: no gradient; seq 1: d/dlp_t (-A s1) = -A s1 / |y_1| (s = exp(mean)), / 2 sequences
    expected = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]) * (2 * s1 / 3 / 2)
    torch.testing.assert_close(logprob.grad, expected, rtol=0, atol=1e-6)


def test_gspo_equals_the_sequence_level_objective_and_ignores_token_outliers():
    """GSPO-token's value and gradient are those of the paper's sequence objective mean_i max(-A s_i, -A clip(s_i))
    with s_i = exp(mean log-ratio): computed here directly, and against the token-level PPO clip."""
    logprob, old, adv, mask = _gspo_inputs()
    loss, _ = policy_loss(logprob, old, adv, mask, 0.2, 0.2, loss_agg_mode="seq-mean-token-mean", loss_type="gspo")
    (grad,) = torch.autograd.grad(loss, logprob)
    direct_lp = logprob.detach().clone().requires_grad_(True)
    seq_losses = []
    for i, length in enumerate((2, 3)):
        s = (direct_lp[i, :length] - old[i, :length]).mean().exp()
        a = adv[i, 0]
        seq_losses.append(torch.maximum(-a * s, -a * s.clamp(0.8, 1.2)))
    direct = torch.stack(seq_losses).mean()
    (direct_grad,) = torch.autograd.grad(direct, direct_lp)
    assert loss.item() == pytest.approx(direct.item(), abs=1e-6)
    torch.testing.assert_close(grad, direct_grad, rtol=0, atol=1e-6)
    # token log-ratios (+0.5, -0.5): PPO clips the first token (r = 1.65), GSPO's s = exp(0) = 1 clips nothing
    lp, zeros, one = torch.tensor([[0.5, -0.5]]), torch.zeros(1, 2), torch.ones(1, 2)
    _, ppo = policy_loss(lp, zeros, one, one, 0.2, 0.2)
    gspo_loss, gspo = policy_loss(lp, zeros, one, one, 0.2, 0.2, loss_agg_mode="seq-mean-token-mean", loss_type="gspo")
    assert ppo["pg_clipfrac"].item() == 0.5 and gspo["pg_clipfrac"].item() == 0.0
    assert gspo_loss.item() == pytest.approx(-1.0)


# ----------------------------------------------------------------------------------------------------- CISPO
def test_cispo_clipped_weight_is_a_constant_and_every_token_keeps_its_gradient():
    # ratios 1.5, 0.5, 1.1 with A = 1, -1, 2 and eps 0.2 / 0.28: weights 1.28, 0.8, 1.1
    lp = torch.tensor([[-1.0, -2.0, -0.5, 9.0]], requires_grad=True)
    old = lp.detach() - torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1), 0.0]])
    adv = torch.tensor([[1.0, -1.0, 2.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = policy_loss(lp, old, adv, mask, 0.2, 0.28, loss_type="cispo")
    # -w * A * logprob: 1.28 * 1 * 1 = 1.28; -0.8 * -1 * -2 = -1.6; -1.1 * 2 * -0.5 = 1.1; token mean over 3
    assert loss.item() == pytest.approx((1.28 - 1.6 + 1.1) / 3, abs=1e-6)
    assert (m["pg_clipfrac"].item(), m["pg_clipfrac_high"].item(), m["pg_clipfrac_low"].item()) == pytest.approx(
        (2 / 3, 1 / 3, 1 / 3)
    )
    loss.backward()
    # stop-gradient: d/dlp = -w * A (the ratio inside w gives nothing), also on the two clipped tokens
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.28, 0.8, -2.2, 0.0]]) / 3, rtol=0, atol=1e-6)
    ppo_lp = lp.detach().clone().requires_grad_(True)
    policy_loss(ppo_lp, old, adv, mask, 0.2, 0.28)[0].backward()
    assert ppo_lp.grad[0, 0] == 0 and ppo_lp.grad[0, 1] == 0  # PPO drops the gradient of both clipped tokens
    # clip_ratio_low >= 1: no lower bound (the paper's setting), the 0.5 ratio is its own weight
    lp.grad = None
    loss, m = policy_loss(lp, old, adv, mask, 1.0, 0.28, loss_type="cispo")
    assert loss.item() == pytest.approx((1.28 - 1.0 + 1.1) / 3, abs=1e-6) and m["pg_clipfrac_low"].item() == 0.0
    with pytest.raises(ValueError, match="clip_ratio_low"):
        policy_loss(lp, old, adv, mask, 1.0, 0.28)  # a PPO band needs 1 - eps_low > 0


# ------------------------------------------------------------------------------------------------------ SAPO
def test_sapo_soft_gate_hand_values_and_gradient():
    # token 0: r = 1, A = +1, tau_pos 1: gate = 4 sigmoid(0) = 2, loss -2, gradient -A * 4 s (1 - s) r = -1
    # token 1: r = 1.5, A = -1, tau_neg 1.05: gate = (4 / 1.05) sigmoid(0.525), loss +gate
    lp = torch.tensor([[0.0, math.log(1.5)]], requires_grad=True)
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    loss, m = policy_loss(lp, torch.zeros(1, 2), adv, mask, loss_type="sapo", tau_pos=1.0, tau_neg=1.05)
    sig = 1 / (1 + math.exp(-1.05 * 0.5))
    assert loss.item() == pytest.approx((-2.0 + 4 / 1.05 * sig) / 2, abs=1e-6)
    assert "pg_clipfrac" not in m and {"pg_loss", "ppo_kl"} <= set(m)  # no hard clip to count
    loss.backward()
    # d gate / d logprob = 4 sigmoid (1 - sigmoid) r, whatever tau: -1 at r = 1; +4 s (1 - s) 1.5 for A = -1
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 4 * sig * (1 - sig) * 1.5]]) / 2, rtol=0, atol=1e-6)
    # at r = 1 the gradient is the unclipped PPO one (-A r); away from 1 it is that times 4 s (1 - s) < 1:
    # r = e, A = 1: s = sigmoid(e - 1) = 0.8479, factor 0.5158 (PPO would clip it to 0; SAPO attenuates)
    far = torch.tensor([[1.0]], requires_grad=True)
    policy_loss(far, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), loss_type="sapo")[0].backward()
    s = 1 / (1 + math.exp(-(math.e - 1)))
    assert far.grad.item() == pytest.approx(-4 * s * (1 - s) * math.e, rel=1e-5)
    assert 4 * s * (1 - s) == pytest.approx(0.5158, abs=1e-4)
    with pytest.raises(ValueError, match="tau"):
        policy_loss(lp, torch.zeros(1, 2), adv, mask, loss_type="sapo", tau_neg=0.0)


@pytest.mark.parametrize("loss_type", ["ppo_clip", "gspo", "cispo", "sapo"])
def test_every_policy_loss_ignores_masked_tokens_and_follows_the_config(loss_type):
    gen = torch.Generator().manual_seed(5)
    mask = (torch.arange(5) < torch.tensor([[5], [2], [0]])).long()
    old = -torch.rand(3, 5, generator=gen)
    logprob = old + 0.2 * torch.randn(3, 5, generator=gen)
    adv = torch.randn(3, 5, generator=gen)
    cfg = RLConfig(policy_loss=loss_type, use_kl_loss=False, loss_agg_mode="seq-mean-token-mean")
    base = _loss_and_grads(logprob, old, None, adv, torch.zeros(3, 5), mask, cfg)
    garbage = [t.clone() for t in (logprob, old, adv)]
    for t, v in zip(garbage, (float("nan"), float("inf"), 1e6), strict=True):
        t[mask == 0] = v
    other = _loss_and_grads(garbage[0], garbage[1], None, garbage[2], torch.zeros(3, 5), mask, cfg)
    assert torch.equal(base[0], other[0]) and torch.equal(base[1], other[1])  # loss, logprob gradient
    assert (base[1][mask == 0] == 0).all() and torch.isfinite(base[0])
    direct = policy_loss(logprob, old, adv, mask, loss_agg_mode="seq-mean-token-mean", loss_type=loss_type)[0]
    assert base[0].item() == pytest.approx(direct.item(), abs=1e-7)
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss(logprob, old, adv, mask, loss_type="grpo")
