"""Reward shaping (dynamic-sampling filter, overlong penalty), token placement and masked statistics."""

import pytest
import torch

from mm_rl.algorithms.masked import masked_mean, masked_stats, masked_var
from mm_rl.algorithms.reward_shaping import filter_zero_variance_groups, overlong_penalty
from mm_rl.algorithms.token_level import broadcast_to_tokens, last_valid_index, scores_to_token_level


def test_filter_zero_variance_groups_counts():
    # group 0: (1, 0) kept; group 1: (1, 1) dropped; group 2: (.5, .5) dropped; group 3: one sample, dropped;
    # group 4: (.1, .1, .1 + 1e-6) kept (differs in a bit)
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.2, 0.1, 0.1, 0.1 + 1e-6])
    groups = torch.tensor([0, 1, 0, 1, 2, 2, 3, 4, 4, 4])
    keep, m = filter_zero_variance_groups(scores, groups)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True, False, True, False, False, False, False, True, True, True]
    assert m == {
        "num_groups": 5,
        "num_groups_kept": 2,
        "num_groups_dropped": 3,
        "num_samples_kept": 5,
        "num_samples_dropped": 5,
    }


def test_filter_all_informative_and_all_uniform():
    keep, m = filter_zero_variance_groups(torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([1, 1, 2, 2]))
    assert keep.all() and m["num_groups_dropped"] == 0
    keep, m = filter_zero_variance_groups(torch.tensor([0.9] * 6), torch.tensor([1, 2, 3, 1, 2, 3]))
    assert not keep.any() and m["num_groups_kept"] == 0 and m["num_samples_dropped"] == 6


def test_overlong_penalty_hand_values():
    lengths = torch.tensor([10, 16, 17, 18, 19, 20, 25])
    # max 20, buffer 4: free up to 16, then -1/4 per token down to -1 at 20, capped there
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4, 1.0), expected)
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4, 0.5), expected * 0.5)
    torch.testing.assert_close(
        overlong_penalty(lengths, 20, 20, 2.0), torch.tensor([-1.0, -1.6, -1.7, -1.8, -1.9, -2.0, -2.0])
    )
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 20, 0, 1.0)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 20, 21, 1.0)


def test_scores_to_token_level():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 1]])
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0], [0.0, 0.0, 4.0]])
    assert torch.equal(scores_to_token_level(scores, mask), expected)
    assert last_valid_index(mask).tolist() == [1, 2, -1, 2]
    assert scores_to_token_level(torch.tensor([1, 0, 1, 1]), mask).dtype == torch.float32


def test_broadcast_to_tokens():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    out = broadcast_to_tokens(torch.tensor([0.5, 7.0, -1.0]), mask)
    assert torch.equal(out, torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [-1.0, -1.0, -1.0]]))


def test_masked_reductions():
    x = torch.tensor([[1.0, 3.0, float("nan")], [5.0, float("inf"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(3.0)
    assert masked_mean(x, mask, dim=-1).tolist() == [2.0, 5.0]
    assert masked_var(x, mask).item() == pytest.approx(4.0)  # deviations -2, 0, 2 over n - 1 = 2
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(8 / 3)
    stats = masked_stats(x, mask, "s")
    assert stats["s/max"].item() == 5.0 and stats["s/min"].item() == 1.0
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0
