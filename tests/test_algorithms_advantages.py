"""Advantage estimators: hand-computed values, exact zeros for uniform groups, permutation invariance."""

import math
import statistics

import pytest
import torch

from mm_rl.algorithms.advantages import (
    advantage_stats,
    compute_advantages,
    group_stats,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

# Two interleaved groups: id 7 = samples 0, 2, 4 with scores (1, 0, 0); id 3 = samples 1, 3, 5 with (.5, .5, 1).
SCORES = torch.tensor([1.0, 0.5, 0.0, 0.5, 0.0, 1.0])
GROUPS = torch.tensor([7, 3, 7, 3, 7, 3])
# uneven response lengths 3, 1, 2, 4, 1, 2 in a width of 4
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])


def test_grpo_hand_values():
    # group 7: mean 1/3, deviations (2/3, -1/3, -1/3), unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3
    # group 3: mean 2/3, deviations (-1/6, -1/6, 1/3), unbiased var (1/36 + 1/36 + 1/9) / 2 = 1/12
    eps = 1e-6
    s7, s3 = math.sqrt(1 / 3) + eps, math.sqrt(1 / 12) + eps
    expected = torch.tensor([(2 / 3) / s7, (-1 / 6) / s3, (-1 / 3) / s7, (-1 / 6) / s3, (-1 / 3) / s7, (1 / 3) / s3])
    adv = grpo_advantages(SCORES, GROUPS, epsilon=eps)
    assert adv.shape == (6,) and adv.dtype == torch.float32
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    # the familiar numbers: 2/sqrt(3) and -1/sqrt(3)
    assert abs(adv[0].item() - 1.1547005) < 1e-5 and abs(adv[2].item() + 0.5773503) < 1e-5


def test_dr_grpo_hand_values():
    expected = torch.tensor([2 / 3, -1 / 6, -1 / 3, -1 / 6, -1 / 3, 1 / 3])
    torch.testing.assert_close(grpo_advantages(SCORES, GROUPS, norm_by_std=False), expected, rtol=0, atol=1e-7)


def test_rloo_hand_values():
    # sample 0: 1 - mean(0, 0) = 1; sample 2: 0 - mean(1, 0) = -0.5; sample 1: .5 - mean(.5, 1) = -.25;
    # sample 5: 1 - mean(.5, .5) = .5
    expected = torch.tensor([1.0, -0.25, -0.5, -0.25, -0.5, 0.5])
    torch.testing.assert_close(rloo_advantages(SCORES, GROUPS), expected, rtol=0, atol=1e-7)


def test_token_level_broadcast_and_mask():
    adv = grpo_advantages(SCORES, GROUPS, response_mask=MASK, norm_by_std=False)
    seq = torch.tensor([2 / 3, -1 / 6, -1 / 3, -1 / 6, -1 / 3, 1 / 3])
    expected = seq.unsqueeze(1) * MASK
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)
    assert (adv[MASK == 0] == 0).all()
    # the dispatcher gives the same token-level result
    torch.testing.assert_close(
        compute_advantages("grpo", SCORES, MASK, GROUPS, norm_by_std=False), expected, rtol=0, atol=1e-7
    )
    torch.testing.assert_close(
        compute_advantages("rloo", SCORES, MASK, GROUPS),
        torch.tensor([1.0, -0.25, -0.5, -0.25, -0.5, 0.5]).unsqueeze(1) * MASK,
        rtol=0,
        atol=1e-7,
    )


def test_token_level_rewards_are_summed_over_the_mask():
    token_rewards = torch.zeros(6, 4)
    token_rewards[0, 2] = 1.0  # sample 0 scores 1 on its last valid token
    token_rewards[1, 0] = 0.25
    token_rewards[1, 3] = 99.0  # under the mask: ignored
    token_rewards[1, 0] += 0.25
    token_rewards[3, 0], token_rewards[3, 3] = 0.25, 0.25
    token_rewards[5, 1] = 1.0
    adv = grpo_advantages(token_rewards, GROUPS, response_mask=MASK, norm_by_std=False)
    seq = torch.tensor([2 / 3, -1 / 6, -1 / 3, -1 / 6, -1 / 3, 1 / 3])
    torch.testing.assert_close(adv, seq.unsqueeze(1) * MASK, rtol=0, atol=1e-7)


def test_float_rounding_makes_naive_centering_nonzero():
    # why uniform groups are zeroed explicitly: naive centering leaves rounding residue, which the division by
    # (std + eps) with std ~ 1e-8 then amplifies
    assert sum([0.1, 0.1, 0.1]) / 3 != 0.1
    x = torch.full((3,), 0.9)
    assert (x - x.mean()).abs().max() > 0


@pytest.mark.parametrize(
    "values", [[0.1, 0.1, 0.1], [0.9] * 5, [0.9] * 3, [0.1] * 7, [1.0] * 4, [0.0] * 2, [0.7] * 7, [0.3]]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_uniform_group_is_exactly_zero(values, dtype):
    # the uniform group interleaved with an informative one
    n = len(values)
    scores = torch.tensor(values + [0.0, 1.0, 0.5], dtype=dtype)[torch.arange(n + 3).roll(1)]
    groups = torch.tensor([5] * n + [9, 9, 9])[torch.arange(n + 3).roll(1)]
    uniform = groups == 5
    mask = torch.ones(n + 3, 3)
    for adv in (
        grpo_advantages(scores, groups),
        grpo_advantages(scores, groups, norm_by_std=False),
        grpo_advantages(scores, groups, epsilon=0.0),
        rloo_advantages(scores, groups),
        compute_advantages("grpo", scores, mask, groups),
        compute_advantages("rloo", scores, mask, groups),
        reinforce_pp_advantages(scores, mask, groups, shift_mean=False),
    ):
        assert (adv[uniform] == 0.0).all(), adv
        assert (adv[~uniform] != 0.0).any()
        assert torch.isfinite(adv).all()


def test_group_of_one_is_zero_not_nan():
    scores = torch.tensor([0.3, 1.0, 0.0])
    groups = torch.tensor([0, 1, 1])
    for adv in (grpo_advantages(scores, groups), rloo_advantages(scores, groups)):
        assert adv[0] == 0.0 and torch.isfinite(adv).all()
    only = grpo_advantages(torch.tensor([0.7]), torch.tensor([4]))
    assert only.tolist() == [0.0]
    r = reinforce_pp_advantages(torch.tensor([0.7]), torch.ones(1, 3), torch.tensor([4]))
    assert torch.isfinite(r).all() and (r == 0).all()


def test_grpo_groups_have_zero_mean():
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(40, generator=gen)
    groups = torch.randint(0, 6, (40,), generator=gen)
    for adv in (
        grpo_advantages(scores, groups),
        grpo_advantages(scores, groups, norm_by_std=False),
        rloo_advantages(scores, groups),
    ):
        for g in groups.unique():
            assert abs(adv[groups == g].double().sum().item()) < 1e-5


def test_grpo_unit_std_per_group():
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(24, generator=gen)
    groups = torch.arange(24) % 3
    adv = grpo_advantages(scores, groups, epsilon=0.0)
    for g in range(3):
        assert abs(adv[groups == g].double().std().item() - 1.0) < 1e-5


def test_permutation_invariance_is_exact():
    gen = torch.Generator().manual_seed(2)
    scores = torch.rand(32, generator=gen)
    scores[:8] = 0.1  # some uniform groups as well
    groups = torch.randint(0, 5, (32,), generator=gen)
    groups[:8] = 11
    lengths = torch.randint(1, 7, (32,), generator=gen)
    mask = (torch.arange(6) < lengths.unsqueeze(1)).long()
    perm = torch.randperm(32, generator=gen)
    for name in ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        adv = compute_advantages(name, scores, mask, groups)
        adv_perm = compute_advantages(name, scores[perm], mask[perm], groups[perm])
        assert torch.equal(adv_perm, adv[perm]), name
    # relabelling the groups changes nothing either
    relabelled = compute_advantages("grpo", scores, mask, groups * 13 + 100)
    assert torch.equal(relabelled, compute_advantages("grpo", scores, mask, groups))


def test_reinforce_pp_with_group_baseline_hand_values():
    # groups (0, 0) scores (1, 0) and (1, 1) scores (1, 1); lengths 2, 1, 1, 2
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 1]])
    # baseline 0.5 for group 0, 1 for group 1; gamma 1 -> every token gets r - b:
    tokens = [0.5, 0.5, -0.5, 0.0, 0.0, 0.0]
    mean, std = statistics.fmean(tokens), statistics.stdev(tokens)  # stdev: unbiased (n - 1)
    eps = 1e-6
    w = [(t - mean) / (std + eps) for t in tokens]
    expected = torch.tensor([[w[0], w[1]], [w[2], 0.0], [w[3], 0.0], [w[4], w[5]]])
    adv = reinforce_pp_advantages(scores, mask, groups, epsilon=eps)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        compute_advantages("reinforce_plus_plus_baseline", scores, mask, groups), expected, rtol=0, atol=1e-6
    )
    # without shifting the mean only the scale changes, and the uniform group stays exactly 0
    no_shift = reinforce_pp_advantages(scores, mask, groups, epsilon=eps, shift_mean=False)
    expected_ns = torch.tensor([[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0], [0.0, 0.0]]) / (std + eps)
    torch.testing.assert_close(no_shift, expected_ns, rtol=0, atol=1e-6)
    assert (no_shift[2:] == 0).all()


def test_plain_reinforce_pp_whitens_returns_without_a_group_baseline():
    """verl's reinforce_plus_plus: no baseline, so the groups of the test above give other numbers."""
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 1]])
    # gamma 1: every valid token gets its sequence's score: 1, 1 | 0 | 1 | 1, 1 -> mean 5/6
    tokens = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    mean, std = statistics.fmean(tokens), statistics.stdev(tokens)  # unbiased, as verl's masked_whiten
    w = [(t - mean) / (std + 1e-6) for t in tokens]
    expected = torch.tensor([[w[0], w[1]], [w[2], 0.0], [w[3], 0.0], [w[4], w[5]]])
    adv = compute_advantages("reinforce_plus_plus", scores, mask, groups)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    assert abs(w[0] - 0.4082473) < 1e-5 and abs(w[2] + 2.0412370) < 1e-5  # 1/sqrt(6), -5/sqrt(6)
    # the group ids play no part: relabel them all as one group, or as six
    for other in (torch.zeros(4, dtype=torch.long), torch.arange(4)):
        assert torch.equal(compute_advantages("reinforce_plus_plus", scores, mask, other), adv)


def test_grpo_biased_std_hand_values():
    # same groups as test_grpo_hand_values, population std: group 7 sqrt(2/9), group 3 sqrt(1/18)
    eps = 1e-6
    s7, s3 = math.sqrt(2 / 9) + eps, math.sqrt(1 / 18) + eps
    expected = torch.tensor([(2 / 3) / s7, (-1 / 6) / s3, (-1 / 3) / s7, (-1 / 6) / s3, (-1 / 3) / s7, (1 / 3) / s3])
    adv = grpo_advantages(SCORES, GROUPS, epsilon=eps, unbiased_std=False)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    assert abs(adv[0].item() - math.sqrt(2)) < 1e-5  # (2/3) / sqrt(2/9)
    token = compute_advantages("grpo", SCORES, MASK, GROUPS, epsilon=eps, unbiased_std=False)
    torch.testing.assert_close(token, expected.unsqueeze(1) * MASK, rtol=0, atol=1e-6)
    # the default is the unbiased std (verl, TRL): larger by sqrt(n / (n - 1)) = sqrt(3 / 2)
    default = grpo_advantages(SCORES, GROUPS, epsilon=0.0)
    torch.testing.assert_close(
        grpo_advantages(SCORES, GROUPS, epsilon=0.0, unbiased_std=False), default * math.sqrt(3 / 2), rtol=1e-6, atol=0
    )
    # uniform groups and groups of one stay exactly 0
    assert grpo_advantages(torch.tensor([0.3, 0.3, 0.7]), torch.tensor([1, 1, 2]), unbiased_std=False).tolist() == [
        0.0,
        0.0,
        0.0,
    ]


def test_reinforce_pp_discounted_returns_hand_values():
    # one sequence, no baseline, reward 1 on the last of 3 valid tokens, gamma 0.5 -> returns 0.25, 0.5, 1
    mask = torch.tensor([[1, 1, 1, 0]])
    returns = [0.25, 0.5, 1.0]
    mean, std = statistics.fmean(returns), statistics.stdev(returns)
    expected = torch.tensor([[(g - mean) / (std + 1e-6) for g in returns] + [0.0]])
    adv = reinforce_pp_advantages(torch.tensor([1.0]), mask, gamma=0.5)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    # token-level rewards: 1 at t=0 and 2 at t=2, gamma 0.5 -> returns 1 + 0.25 * 2 = 1.5, 0.5 * 2 = 1, 2
    rewards = torch.tensor([[1.0, 0.0, 2.0, 5.0]])  # 5.0 is under the mask
    returns = [1.5, 1.0, 2.0]
    mean, std = statistics.fmean(returns), statistics.stdev(returns)
    expected = torch.tensor([[(g - mean) / (std + 1e-6) for g in returns] + [0.0]])
    torch.testing.assert_close(reinforce_pp_advantages(rewards, mask, gamma=0.5), expected, rtol=0, atol=1e-6)


def test_reinforce_pp_token_rewards_baseline_uses_sequence_totals():
    # totals 3 and 1 in one group -> baseline 2, subtracted on each row's last valid token; gamma 1
    rewards = torch.tensor([[1.0, 2.0], [1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    returns = [3.0 - 2.0, 2.0 - 2.0, 1.0 - 2.0]  # row 0: (1 + 2 - 2, 2 - 2); row 1: 1 - 2
    mean, std = statistics.fmean(returns), statistics.stdev(returns)
    w = [(g - mean) / (std + 1e-6) for g in returns]
    expected = torch.tensor([[w[0], w[1]], [w[2], 0.0]])
    adv = reinforce_pp_advantages(rewards, mask, torch.tensor([0, 0]))
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)


def test_group_stats_values():
    stats = group_stats(SCORES, GROUPS)
    # groups are ordered by id: row 0 is id 3, row 1 is id 7
    assert stats.inverse.tolist() == [1, 0, 1, 0, 1, 0]
    assert stats.count.tolist() == [3, 3]
    torch.testing.assert_close(stats.mean, torch.tensor([2 / 3, 1 / 3], dtype=torch.float64))
    torch.testing.assert_close(stats.std, torch.tensor([math.sqrt(1 / 12), math.sqrt(1 / 3)], dtype=torch.float64))
    assert stats.uniform.tolist() == [False, False]


def test_advantage_stats_over_valid_tokens():
    adv = torch.tensor([[1.0, -1.0, 9.0], [3.0, 0.0, -7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    stats = advantage_stats(adv, mask)
    # valid: 1, -1, 3 -> mean 1, population std sqrt((0 + 4 + 4) / 3)
    assert stats["advantages/mean"].item() == pytest.approx(1.0)
    assert stats["advantages/std"].item() == pytest.approx(math.sqrt(8 / 3))
    assert stats["advantages/max"].item() == 3.0 and stats["advantages/min"].item() == -1.0
    empty = advantage_stats(adv, torch.zeros_like(mask), prefix="x")
    assert all(v.item() == 0.0 for v in empty.values()) and set(empty) == {"x/mean", "x/std", "x/max", "x/min"}


def test_errors():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("gae", SCORES, MASK, GROUPS)
    with pytest.raises(ValueError, match="must match"):
        grpo_advantages(SCORES, GROUPS[:3])
