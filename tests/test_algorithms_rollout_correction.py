"""Rollout-vs-training correction: a deliberate engine mismatch corrected to hand-computed losses (token / sequence,
truncated / masked), its metrics, exactness when off, the resolver, and how maxima reach the step's metrics."""

import math

import pytest
import torch

from mm_rl.algorithms.policy_loss import actor_loss
from mm_rl.algorithms.rollout_correction import resolve_rollout_is, rollout_is_weights
from mm_rl.config.schema import RLConfig, RolloutCorrectionConfig

# Two sequences (lengths 2 and 3, then a padding column). The current policy equals the old one (ratio 1), so the
# uncorrected token loss is -A: (-1, -1 | 1, 1, 1). The engine's log-probs are perturbed so that the weights
# rho = pi_old / pi_engine are (3, 0.5 | 1.5, 1.2, 0.9): per sequence 3 * 0.5 = 1.5 and 1.5 * 1.2 * 0.9 = 1.62.
RHO = [[3.0, 0.5, 1.0, 1.0], [1.5, 1.2, 0.9, 1.0]]
OLD = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.7, -1.1, -0.3, 0.0]])
ENGINE = OLD - torch.tensor(RHO).log()
ENGINE[:, 3] = float("nan")  # under the mask: must not matter
ADV = torch.tensor([[1.0, 1.0, 0.0, 0.0], [-1.0, -1.0, -1.0, 0.0]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
C = 1.6  # only the token weight 3 and the sequence weight 1.62 exceed it

# token-mean over the 5 valid tokens of w * (-A):
HAND = {
    ("token", "truncate"): (-1.6 - 0.5 + 1.5 + 1.2 + 0.9) / 5,  # 3 -> 1.6
    ("token", "mask"): (-0.0 - 0.5 + 1.5 + 1.2 + 0.9) / 5,  # the weight-3 token dropped
    ("sequence", "truncate"): (-1.5 * 2 + 1.6 * 3) / 5,  # 1.62 -> 1.6 on the second sequence's tokens
    ("sequence", "mask"): (-1.5 * 2 + 0.0 * 3) / 5,  # the second sequence dropped
}
UNCORRECTED = (-2.0 + 3.0) / 5


def _cfg(level, mode="truncate", threshold=C, **rl):
    return RLConfig(
        use_kl_loss=False,
        rollout_correction=RolloutCorrectionConfig(
            rollout_is=level, rollout_is_mode=mode, rollout_is_threshold=threshold
        ),
        **rl,
    )


def _loss(cfg, engine=ENGINE):
    logprob = OLD.clone().requires_grad_(True)
    loss, metrics = actor_loss(logprob, OLD, None, ADV, MASK, None, cfg, 4, engine_logprob=engine)
    loss.backward()
    return loss, logprob.grad, metrics


@pytest.mark.parametrize("level,mode", list(HAND))
def test_a_perturbed_engine_is_corrected_to_the_hand_value(level, mode):
    loss, grad, m = _loss(_cfg(level, mode))
    assert loss.item() == pytest.approx(HAND[level, mode], abs=1e-6)
    assert m["pg_loss"].item() == pytest.approx(HAND[level, mode], abs=1e-6)
    weights, _ = rollout_is_weights(OLD, ENGINE, MASK, level, mode, C)
    # ratio 1, unclipped: d/dlogprob (-A r w) = -A w, over 5 tokens; the weights are constants
    torch.testing.assert_close(grad, -ADV * weights / 5, rtol=0, atol=1e-6)
    assert (grad[MASK == 0] == 0).all() and weights.requires_grad is False
    assert loss.item() != pytest.approx(UNCORRECTED, abs=1e-3)


def test_weights_and_metrics_hand_values():
    w, m = rollout_is_weights(OLD, ENGINE, MASK, "token", "truncate", C)
    torch.testing.assert_close(w, torch.tensor([[1.6, 0.5, 0.0, 0.0], [1.5, 1.2, 0.9, 0.0]]), rtol=0, atol=1e-6)
    assert m["rollout_corr/rollout_is_mean"].item() == pytest.approx((3 + 0.5 + 1.5 + 1.2 + 0.9) / 5, abs=1e-6)
    assert m["rollout_corr/rollout_is_max"].item() == pytest.approx(3.0, abs=1e-5)  # before truncation
    assert m["rollout_corr/rollout_is_ratio_fraction_high"].item() == pytest.approx(1 / 5)
    assert "rollout_corr/rollout_rs_masked_fraction" not in m
    logs = [math.log(r) for r in (3, 0.5, 1.5, 1.2, 0.9)]
    assert m["rollout_corr/kl"].item() == pytest.approx(-sum(logs) / 5, abs=1e-6)  # mean(engine - old)
    assert m["rollout_corr/k3_kl"].item() == pytest.approx(sum(math.exp(d) - d - 1 for d in logs) / 5, abs=1e-6)
    assert m["rollout_corr/chi2_token"].item() == pytest.approx((9 + 0.25 + 2.25 + 1.44 + 0.81) / 5 - 1, abs=1e-5)
    assert m["rollout_corr/chi2_seq"].item() == pytest.approx((1.5**2 + 1.62**2) / 2 - 1, abs=1e-5)

    w, m = rollout_is_weights(OLD, ENGINE, MASK, "sequence", "mask", C)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]), rtol=0, atol=1e-6)
    assert m["rollout_corr/rollout_is_mean"].item() == pytest.approx((1.5 * 2 + 1.62 * 3) / 5, abs=1e-6)
    assert m["rollout_corr/rollout_is_max"].item() == pytest.approx(1.62, abs=1e-5)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"].item() == pytest.approx(1 / 2)  # of sequences
    assert m["rollout_corr/rollout_rs_masked_fraction"].item() == pytest.approx(3 / 5)  # of tokens
    assert all(torch.isfinite(v) for v in m.values())


def test_off_by_default_and_bit_identical_when_off():
    cfg = RLConfig(use_kl_loss=False)
    assert cfg.rollout_correction.rollout_is == "auto" and resolve_rollout_is(cfg) == "off"
    plain_loss, plain_grad, plain_m = _loss(cfg, engine=None)
    loss, grad, m = _loss(cfg)  # the engine's log-probs are given but the correction is off: ignored
    assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)
    assert loss.item() == pytest.approx(UNCORRECTED, abs=1e-6)
    assert not any(k.startswith("rollout_corr/") for k in m) and set(m) == set(plain_m)
    # on, with an engine that agrees exactly: every weight is 1.0 and nothing changes, bit for bit
    for level, mode in HAND:
        same_loss, same_grad, _ = _loss(_cfg(level, mode), engine=OLD.clone())
        assert torch.equal(same_loss, plain_loss) and torch.equal(same_grad, plain_grad)


def test_resolver_auto_is_off_unless_one_step_off_policy():
    def rl(level="auto", bypass=False, one_step=False):
        return RLConfig(
            one_step_off_policy=one_step,
            rollout_correction=RolloutCorrectionConfig(rollout_is=level, bypass_mode=bypass),
        )

    assert resolve_rollout_is(rl()) == "off"
    assert resolve_rollout_is(rl(one_step=True)) == "token"
    assert resolve_rollout_is(rl(one_step=True, bypass=True)) == "off"  # old = engine: nothing to correct
    assert resolve_rollout_is(rl(None, one_step=True)) == "off"
    assert resolve_rollout_is(rl("sequence")) == "sequence" and resolve_rollout_is(rl("token")) == "token"
    # auto under one_step_off_policy is token-level truncation
    cfg = RLConfig(
        use_kl_loss=False, one_step_off_policy=True, rollout_correction=RolloutCorrectionConfig(rollout_is_threshold=C)
    )
    assert _loss(cfg)[0].item() == pytest.approx(HAND["token", "truncate"], abs=1e-6)


def test_on_without_the_engine_log_probs_is_an_error():
    with pytest.raises(ValueError, match="engine"):
        _loss(_cfg("token"), engine=None)
    with pytest.raises(ValueError, match="threshold"):
        rollout_is_weights(OLD, ENGINE, MASK, "token", "truncate", 1.0)


def test_huge_mismatch_stays_finite():
    engine = OLD - 100.0  # rho = e^100 per token: bounded to e^20 before exp, then truncated / masked
    for level, mode in HAND:
        w, m = rollout_is_weights(OLD, engine, MASK, level, mode, C)
        assert torch.isfinite(w).all() and all(torch.isfinite(v) for v in m.values())
        assert w.max().item() == pytest.approx(C if mode == "truncate" else 0.0)  # every weight is e^20 > C


def test_micro_batch_maxima_are_reduced_by_max(monkeypatch):
    """The step's ``rollout_corr/rollout_is_max`` is the largest of its micro-batches', not their mean."""
    from megatron.core import parallel_state

    from mm_rl.workers.training import reduce_over_replicas

    monkeypatch.setattr(parallel_state, "get_data_parallel_group", lambda with_context_parallel=False: None)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    collected = [
        {
            "loss": torch.tensor(0.5),
            "rollout_corr/rollout_is_mean": torch.tensor(1.0),
            "rollout_corr/rollout_is_max": torch.tensor(3.0),
        },
        {
            "loss": torch.tensor(0.25),
            "rollout_corr/rollout_is_mean": torch.tensor(2.0),
            "rollout_corr/rollout_is_max": torch.tensor(1.5),
        },
    ]
    assert reduce_over_replicas(collected) == {
        "loss": 0.75,
        "rollout_corr/rollout_is_mean": 1.5,
        "rollout_corr/rollout_is_max": 3.0,
    }
