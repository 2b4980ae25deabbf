"""Per-sequence values placed on response tokens.

Outcome rewards are per sequence; the token-level pipeline (KL in reward, REINFORCE++ returns, the loss) works
on ``[batch, response_len]``. Two placements exist: the reward *event* sits on the last response token (where
the episode ends), and a sequence *advantage* applies to every response token.
"""

from __future__ import annotations

import torch

__all__ = ["broadcast_to_tokens", "last_valid_index", "scores_to_token_level"]


def last_valid_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last set position of each row of ``response_mask``; -1 for a row with none set.

    Works for non-contiguous masks too (the last set position, not ``sum - 1``).
    """
    m = response_mask != 0
    positions = torch.arange(1, m.shape[-1] + 1, device=m.device)
    return (m * positions).amax(dim=-1) - 1


def scores_to_token_level(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[batch]`` scores -> ``[batch, len]`` token rewards: the score on each row's last valid token, 0 elsewhere.

    Summing the result over the response recovers the score, so a token-level estimator that sums or discounts
    rewards sees the outcome at the step where the response ended. A row without valid tokens gets all zeros.
    The dtype is the scores' (float32 for integer scores).
    """
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    out = torch.zeros(response_mask.shape, dtype=dtype, device=response_mask.device)
    last = last_valid_index(response_mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = scores.to(device=out.device, dtype=dtype)[rows]
    return out


def broadcast_to_tokens(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[batch]`` values -> ``[batch, len]``: each row's value on every valid token, exactly 0 where masked."""
    m = response_mask != 0
    expanded = values.unsqueeze(-1).expand(m.shape)
    return torch.where(m, expanded, torch.zeros_like(expanded))
