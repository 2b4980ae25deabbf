"""Loss aggregation: how a ``[batch, len]`` matrix of per-token losses becomes the scalar that is differentiated.

With ``l_it`` the loss of token ``t`` of sequence ``i``, ``m_it`` the 0/1 response mask, ``T_i = sum_t m_it``
the response length and ``S = {i : T_i > 0}`` the sequences with at least one valid token:

- ``token-mean``: ``sum_{i,t} m_it l_it / sum_{i,t} m_it`` -- every token weighs the same, whatever the length
  of its response (DAPO; the default);
- ``seq-mean-token-sum``: ``mean_{i in S} sum_t m_it l_it`` -- a sequence weighs its token sum (longer responses
  weigh more);
- ``seq-mean-token-mean``: ``mean_{i in S} (sum_t m_it l_it / T_i)`` -- each sequence weighs the same, and inside
  it each token ``1 / T_i`` (the original GRPO objective; short responses' tokens weigh more);
- ``seq-mean-token-sum-norm``: ``mean_{i in S} (sum_t m_it l_it / H)`` with the constant horizon ``H`` = the
  maximum response length (``generate_config.sampling_config.max_tokens``) -- Dr.GRPO's length-unbiased
  normalisation: a constant divisor, so no length bias. The mean over sequences is Dr.GRPO's ``1 / G`` (its
  objective averages the ``G`` responses' token sums divided by the generation budget). verl's mode of the same
  name drops that mean, ``sum_{i,t} m_it l_it / H`` (``H`` its ``loss_scale_factor``, by default the padded
  width of the batch), so its loss grows with the number of sequences in a micro-batch; mm_rl keeps the
  per-sequence mean, whose scale does not depend on the batch size.

Rows with no valid token (micro-batch padding) are left out of the sequence means, so they change nothing.

Micro-batching: by default the denominators (token count, ``|S|``) are this call's. A trainer that accumulates
gradients over micro-batches passes ``denominator`` = the count over the whole mini-batch (valid tokens for
``token-mean``, non-empty sequences for the ``seq-mean-*`` modes) and SUMS the micro-batch losses; the result
is then exactly the mini-batch aggregate.
"""

from __future__ import annotations

import torch

__all__ = ["LOSS_AGG_MODES", "aggregate_loss"]

LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    horizon: int | None = None,
    *,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce ``loss_mat`` ``[batch, len]`` over ``mask`` to a scalar by ``mode`` (formulas in the module doc).

    ``horizon`` is required by ``seq-mean-token-sum-norm`` (the maximum response length; not the padded width
    of this batch, which varies). ``denominator`` overrides the token / sequence count (see the module doc).
    An empty selection gives 0 with the graph intact. Masked entries (even NaN / inf) have no effect on the
    value or the gradient.
    """
    m = mask != 0
    if loss_mat.shape != m.shape or loss_mat.dim() != 2:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(m.shape)} must be the same [batch, len]")
    kept = torch.where(m, loss_mat, torch.zeros_like(loss_mat))
    if mode == "token-mean":
        count = m.sum() if denominator is None else denominator
        return kept.sum() / _at_least_one(count, loss_mat)
    tokens_per_seq = m.sum(dim=-1)
    seq_sum = kept.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sum / tokens_per_seq.clamp(min=1).to(seq_sum.dtype)
    elif mode == "seq-mean-token-sum-norm":
        if horizon is None or horizon <= 0:
            raise ValueError("seq-mean-token-sum-norm needs horizon = the maximum response length (> 0)")
        per_seq = seq_sum / float(horizon)
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {LOSS_AGG_MODES}")
    num_seqs = (tokens_per_seq > 0).sum() if denominator is None else denominator
    return per_seq.sum() / _at_least_one(num_seqs, loss_mat)


def _at_least_one(count: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    count = torch.as_tensor(count, device=like.device)
    return count.to(like.dtype).clamp(min=1)
