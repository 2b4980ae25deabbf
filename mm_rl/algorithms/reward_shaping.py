"""Reward shaping around GRPO: the dynamic-sampling group filter and the overlong-response penalty (DAPO).

- Dynamic sampling (``RLConfig.dynamic_sampling``): a group whose samples all scored the same has zero
  advantage under every group-baseline estimator, so it only dilutes the batch; :func:`filter_zero_variance_groups`
  marks such groups for dropping, and the trainer draws more prompts until the batch is full.
- Overlong penalty (``RLConfig.overlong_buffer``): a response that runs into ``max_tokens`` is usually truncated
  mid-thought; a soft penalty that starts ``buffer_len`` tokens before the limit teaches the policy to finish in
  time without punishing a long but complete answer as hard as a truncated one.
"""

from __future__ import annotations

import torch

from mm_rl.algorithms.advantages import group_stats

__all__ = ["filter_zero_variance_groups", "overlong_penalty"]


def filter_zero_variance_groups(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, int]]:
    """Keep mask ``[batch]`` (bool) that drops every group whose scores are all equal.

    A group of one sample is all-equal (it has no variance) and is dropped too. Scores are compared exactly
    (two scores that differ in any bit count as different). Metrics are Python ints (the caller needs them on
    the host to decide whether to sample more): ``num_groups``, ``num_groups_kept``, ``num_groups_dropped``,
    ``num_samples_kept``, ``num_samples_dropped``.
    """
    stats = group_stats(scores, group_ids)
    keep = ~stats.uniform[stats.inverse]
    num_groups = int(stats.count.numel())
    groups_kept = int((~stats.uniform).sum())
    samples_kept = int(keep.sum())
    metrics = {
        "num_groups": num_groups,
        "num_groups_kept": groups_kept,
        "num_groups_dropped": num_groups - groups_kept,
        "num_samples_kept": samples_kept,
        "num_samples_dropped": int(keep.numel()) - samples_kept,
    }
    return keep, metrics


def overlong_penalty(
    response_lengths: torch.Tensor, max_tokens: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """Per-sequence penalty (<= 0, float32 ``[batch]``) to ADD to the scores.

    ``0`` for ``length <= max_tokens - buffer_len``, then linear down to ``-penalty_factor`` at
    ``length == max_tokens``: ``-penalty_factor * (length - (max_tokens - buffer_len)) / buffer_len``; lengths
    beyond ``max_tokens`` stay at ``-penalty_factor``. Needs ``0 < buffer_len <= max_tokens`` (the caller checks
    ``overlong_buffer.enable``; a zero-length buffer has no ramp and is rejected rather than silently ignored).
    """
    if not 0 < buffer_len <= max_tokens:
        raise ValueError(f"need 0 < buffer_len <= max_tokens, got buffer_len={buffer_len}, max_tokens={max_tokens}")
    start = max_tokens - buffer_len
    excess = (response_lengths.to(torch.float64) - start).clamp(min=0.0, max=float(buffer_len))
    return (-penalty_factor * excess / buffer_len).to(torch.float32)
