"""Advantage estimators for outcome rewards: GRPO (and Dr.GRPO), RLOO and REINFORCE++ with or without a group baseline.

Each prompt is sampled ``n`` times; ``group_ids[i]`` names the prompt of sample ``i`` (the samples of a group may
lie anywhere in the batch). The estimators differ in the baseline and the scale:

- GRPO: ``A_i = (r_i - mean_g) / (std_g + epsilon)``, ``std_g`` the unbiased (Bessel, ``n - 1``) standard
  deviation of the group's rewards, as verl and TRL take it (``unbiased_std=False``: the population std, ``n``).
  ``norm_by_std=False`` gives Dr.GRPO: ``A_i = r_i - mean_g``.
- RLOO: ``A_i = r_i - mean_{j in g, j != i} r_j = n / (n - 1) * (r_i - mean_g)``.
- REINFORCE++ (``reinforce_plus_plus``, verl's meaning): the (discounted) return-to-go of the token rewards is
  taken per token and whitened over all valid tokens of the batch; no group baseline.
- REINFORCE++ with baseline (``reinforce_plus_plus_baseline``): the group mean of the sequence rewards is
  subtracted at the last response token first, then as above.

Exactness: a group whose rewards are all equal (a group of size 1 included) carries no learning signal, and
GRPO / RLOO give it EXACTLY 0.0 advantage: such groups are detected by comparing the group's max and min score
and their advantages are set to 0 explicitly, because ``r - mean`` is not 0 in floating point in general
(in float32 the mean of three 0.1 is not 0.1). All group statistics are computed in float64, from the group's
scores in sorted order, so the result is also bit-identical under any permutation of the batch.

Results are token-level ``[batch, response_len]``: the sequence advantage on every valid token, exactly 0
where ``response_mask`` is 0. The GRPO / RLOO functions return the ``[batch]`` sequence advantages when no
``response_mask`` is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mm_rl.algorithms.masked import masked_stats
from mm_rl.algorithms.token_level import broadcast_to_tokens, scores_to_token_level

__all__ = [
    "ESTIMATORS",
    "GroupStats",
    "advantage_stats",
    "compute_advantages",
    "group_stats",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sequence_scores",
]

ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
_F64 = torch.float64


@dataclass(frozen=True)
class GroupStats:
    """Per-group statistics of per-sample scores (all float64; ``[G]`` unless noted).

    ``inverse`` ``[batch]`` maps each sample to its group row ``0..G-1`` (groups ordered by id); ``count`` is the
    group size; ``std`` the unbiased standard deviation (0 for a group of one); ``uniform`` is True where all the
    group's scores are equal (always for a group of one).
    """

    inverse: torch.Tensor
    count: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    uniform: torch.Tensor


def _out_dtype(scores: torch.Tensor) -> torch.dtype:
    """Advantages are at least float32 (bf16 scores would round the advantage)."""
    if scores.is_floating_point():
        return torch.promote_types(scores.dtype, torch.float32)
    return torch.float32


def _check_group_ids(scores: torch.Tensor, group_ids: torch.Tensor) -> None:
    if scores.dim() != 1:
        raise ValueError(f"per-sequence scores must be [batch], got shape {tuple(scores.shape)}")
    if group_ids.shape != scores.shape:
        raise ValueError(f"group_ids {tuple(group_ids.shape)} must match scores {tuple(scores.shape)}")
    if group_ids.is_floating_point():
        raise ValueError("group_ids must be an integer tensor")


def group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> GroupStats:
    """Mean, unbiased std, size and all-equal flag of each group, in float64.

    The scores are laid out as a ``[G, max_group_size]`` matrix, each row holding its group's scores sorted
    ascending (zero padded), and reduced row-wise: the same group contents give the same bits wherever the
    samples sit in the batch.
    """
    _check_group_ids(scores, group_ids)
    values = scores.detach().to(_F64)
    n = values.shape[0]
    if n == 0:
        empty = values.new_zeros(0)
        return GroupStats(group_ids.new_zeros(0), group_ids.new_zeros(0), empty, empty, empty.bool())
    _, inverse, count = torch.unique(group_ids, return_inverse=True, return_counts=True)
    num_groups = count.shape[0]
    by_value = torch.argsort(values, stable=True)
    order = by_value[torch.argsort(inverse[by_value], stable=True)]
    row = inverse[order]
    start = torch.cumsum(count, 0) - count
    col = torch.arange(n, device=values.device) - start[row]
    width = int(count.max())
    mat = values.new_zeros(num_groups, width)
    valid = torch.zeros(num_groups, width, dtype=torch.bool, device=values.device)
    mat[row, col] = values[order]
    valid[row, col] = True
    mean = mat.sum(dim=1) / count.to(_F64)
    centred = torch.where(valid, mat - mean.unsqueeze(1), torch.zeros_like(mat))
    var = (centred * centred).sum(dim=1) / (count - 1).clamp(min=1).to(_F64)
    high = mat.masked_fill(~valid, float("-inf")).amax(dim=1)
    low = mat.masked_fill(~valid, float("inf")).amin(dim=1)
    return GroupStats(inverse=inverse, count=count, mean=mean, std=var.sqrt(), uniform=high == low)


def sequence_scores(rewards: torch.Tensor, response_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[batch]`` scores as given, or ``[batch, len]`` token rewards summed over the valid tokens."""
    if rewards.dim() == 1:
        return rewards
    if rewards.dim() != 2 or response_mask is None:
        raise ValueError("token-level rewards must be [batch, len] and come with a response_mask")
    return torch.where(response_mask != 0, rewards, torch.zeros_like(rewards)).sum(dim=-1)


def _finish(
    seq_adv64: torch.Tensor, stats: GroupStats, dtype: torch.dtype, response_mask: torch.Tensor | None
) -> torch.Tensor:
    """Zero uniform groups exactly, cast, and broadcast over the response when a mask is given."""
    seq_adv64 = torch.where(stats.uniform[stats.inverse], torch.zeros_like(seq_adv64), seq_adv64)
    seq_adv = seq_adv64.to(dtype)
    return seq_adv if response_mask is None else broadcast_to_tokens(seq_adv, response_mask)


def grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    response_mask: torch.Tensor | None = None,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
    unbiased_std: bool = True,
) -> torch.Tensor:
    """GRPO outcome advantage ``(r_i - mean_g) / (std_g + epsilon)``; Dr.GRPO ``r_i - mean_g`` without std.

    ``scores`` is ``[batch]`` or token rewards ``[batch, len]`` (summed over ``response_mask``). ``std_g`` is
    unbiased (``n - 1``) by default, as verl (``torch.std``) and TRL take it; ``unbiased_std=False`` divides by
    ``n`` (population std: advantages larger by ``sqrt(n / (n - 1))``). Dr.GRPO (``norm_by_std=False``) drops
    the division, which otherwise up-weights prompts whose group is nearly uniform (too easy or too hard).
    All-equal groups and groups of one give exactly 0. Returns ``[batch, len]`` when ``response_mask`` is given
    (0 on masked tokens), else ``[batch]``.
    """
    seq = sequence_scores(scores, response_mask)
    stats = group_stats(seq, group_ids)
    adv = seq.detach().to(_F64) - stats.mean[stats.inverse]
    if norm_by_std:
        std = stats.std if unbiased_std else _population_std(stats)
        adv = adv / (std[stats.inverse] + epsilon)
    return _finish(adv, stats, _out_dtype(seq), response_mask)


def _population_std(stats: GroupStats) -> torch.Tensor:
    """The groups' std with divisor ``n`` from the unbiased one (``n - 1``); 0 for a group of one."""
    n = stats.count.to(_F64)
    return stats.std * ((n - 1).clamp(min=0) / n).sqrt()


def rloo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, *, response_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE leave-one-out: ``A_i = r_i - (sum_g - r_i) / (n - 1) = n / (n - 1) * (r_i - mean_g)``.

    The baseline of each sample is the mean of the OTHER samples of its group, so it is independent of the
    sample's own action (unbiased). Groups of one (no other sample) and all-equal groups give exactly 0.
    Shapes as for :func:`grpo_advantages`.
    """
    seq = sequence_scores(scores, response_mask)
    stats = group_stats(seq, group_ids)
    n = stats.count.to(_F64)[stats.inverse]
    adv = (seq.detach().to(_F64) - stats.mean[stats.inverse]) * n / (n - 1).clamp(min=1)
    return _finish(adv, stats, _out_dtype(seq), response_mask)


def _returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t'}`` with ``t'`` the next VALID position (masked positions are skipped)."""
    if gamma == 1.0:
        kept = torch.where(mask, rewards, torch.zeros_like(rewards))
        return kept.flip(-1).cumsum(-1).flip(-1)
    running = rewards.new_zeros(rewards.shape[0])
    out = torch.zeros_like(rewards)
    for t in range(rewards.shape[-1] - 1, -1, -1):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        out[:, t] = running
    return out


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    *,
    gamma: float = 1.0,
    epsilon: float = 1e-6,
    shift_mean: bool = True,
) -> torch.Tensor:
    """REINFORCE++ token advantages, with the per-group mean baseline when ``group_ids`` is given.

    Steps (float64 throughout):

    1. token rewards ``r``: ``[batch]`` scores are placed on the last valid token, ``[batch, len]`` are used as
       is (masked);
    2. baseline: ``b_g`` = group mean of the per-sample total reward ``sum_t r_t``, subtracted at the last valid
       token (skipped when ``group_ids`` is None: plain REINFORCE++);
    3. return-to-go per valid token ``G_t = sum_{k >= t, valid} gamma^(#valid steps from t to k) * r_k``; with
       ``gamma = 1`` and an outcome reward every token gets ``r - b_g``;
    4. batch whitening over all valid tokens: ``A = (G - mean) / (std + epsilon)``, mean and unbiased std over
       the valid tokens of the batch (``shift_mean=False`` divides only).

    With ``shift_mean=True`` (the published method) a group with all-equal rewards is NOT exactly 0 after
    whitening: it is moved by ``-mean / std`` like every token. ``shift_mean=False`` keeps such groups at
    exactly 0 for ``[batch]`` scores (the group baseline already centres each group). Returns
    ``[batch, len]``, 0 on masked tokens.
    """
    mask = response_mask != 0
    if rewards.dim() == 1:
        token_rewards = scores_to_token_level(rewards, mask)
    elif rewards.shape == mask.shape:
        token_rewards = rewards
    else:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [batch] or match the mask {tuple(mask.shape)}")
    dtype = _out_dtype(token_rewards)
    r = torch.where(mask, token_rewards.detach().to(_F64), torch.zeros((), dtype=_F64, device=mask.device))
    if group_ids is not None:
        totals = r.sum(dim=-1)
        stats = group_stats(totals, group_ids)
        # an all-equal group's mean IS each member's total; using the total itself makes r - b exactly 0
        baseline = torch.where(stats.uniform[stats.inverse], totals, stats.mean[stats.inverse])
        r = r - scores_to_token_level(baseline, mask)
    returns = _returns_to_go(r, mask, gamma)
    valid = torch.sort(returns[mask]).values  # sorted: bit-identical under batch permutations
    count = valid.numel()
    if count == 0:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    mean = valid.sum() / count
    std = ((valid - mean) ** 2).sum().div(max(count - 1, 1)).sqrt()
    centred = returns - mean if shift_mean else returns
    adv = centred / (std + epsilon)
    return torch.where(mask, adv, torch.zeros_like(adv)).to(dtype)


def compute_advantages(
    estimator: str,
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
    gamma: float = 1.0,
    unbiased_std: bool = True,
) -> torch.Tensor:
    """Token-level ``[batch, len]`` advantages by name (:data:`ESTIMATORS`, verl's names and meanings).

    ``scores`` is ``[batch]`` (outcome scores) or ``[batch, len]`` token rewards (e.g. after KL in reward).
    ``epsilon``, ``norm_by_std`` and ``unbiased_std`` map to ``RLConfig.adv_epsilon`` / ``norm_adv_by_std`` /
    ``grpo_std`` (the last two GRPO-only); ``gamma`` is REINFORCE++-only. ``reinforce_plus_plus`` ignores
    ``group_ids`` (no baseline); ``reinforce_plus_plus_baseline`` subtracts each group's mean.
    """
    if estimator == "grpo":
        return grpo_advantages(
            scores,
            group_ids,
            response_mask=response_mask,
            epsilon=epsilon,
            norm_by_std=norm_by_std,
            unbiased_std=unbiased_std,
        )
    if estimator == "rloo":
        return rloo_advantages(scores, group_ids, response_mask=response_mask)
    if estimator == "reinforce_plus_plus":
        return reinforce_pp_advantages(scores, response_mask, None, gamma=gamma, epsilon=epsilon)
    if estimator == "reinforce_plus_plus_baseline":
        return reinforce_pp_advantages(scores, response_mask, group_ids, gamma=gamma, epsilon=epsilon)
    raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {ESTIMATORS}")


def advantage_stats(
    advantages: torch.Tensor, response_mask: torch.Tensor, prefix: str = "advantages"
) -> dict[str, torch.Tensor]:
    """``{prefix}/mean``, ``/std`` (population), ``/max``, ``/min`` over the valid tokens (detached)."""
    return masked_stats(advantages, response_mask, prefix)
