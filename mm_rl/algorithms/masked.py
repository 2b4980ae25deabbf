"""Reductions over a 0/1 mask.

Every function selects with ``torch.where(mask, values, 0)`` rather than multiplying by the mask, so a NaN or
inf under ``mask == 0`` (padding produced by a model, a log-prob of a pad token) can never leak into a result
or a gradient: ``0 * inf`` would be NaN, a ``where`` is not.
"""

from __future__ import annotations

import torch

__all__ = ["masked_max", "masked_mean", "masked_min", "masked_stats", "masked_sum", "masked_var"]


def _bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set, over ``dim`` (all elements when ``None``)."""
    selected = torch.where(_bool(mask), values, torch.zeros_like(values))
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set; 0 (not NaN) where nothing is selected."""
    count = _bool(mask).sum() if dim is None else _bool(mask).sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the selected elements (all dimensions pooled).

    ``unbiased`` divides by ``n - 1`` (Bessel), else by ``n``; fewer than two (unbiased) or no selected elements
    give 0.
    """
    m = _bool(mask)
    n = m.sum()
    centred = values - masked_mean(values, m)
    ss = masked_sum(centred * centred, m)
    denom = (n - 1) if unbiased else n
    return ss / denom.clamp(min=1).to(values.dtype)


def _masked_extreme(values: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    m = _bool(mask)
    if values.numel() == 0:
        return values.new_zeros(())
    fill = float("-inf") if largest else float("inf")
    filled = values.masked_fill(~m, fill)
    extreme = filled.max() if largest else filled.min()
    return torch.where(m.any(), extreme, extreme.new_zeros(()))


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Largest selected element; 0 when nothing is selected (no host synchronisation)."""
    return _masked_extreme(values, mask, largest=True)


def masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Smallest selected element; 0 when nothing is selected (no host synchronisation)."""
    return _masked_extreme(values, mask, largest=False)


def masked_stats(values: torch.Tensor, mask: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """``{prefix}/mean``, ``/std`` (population, divides by n), ``/max`` and ``/min`` over the selected elements.

    For logging, e.g. ``masked_stats(advantages, response_mask, "critic/advantages")``; detached, and all 0
    when nothing is selected.
    """
    v = values.detach()
    return {
        f"{prefix}/mean": masked_mean(v, mask),
        f"{prefix}/std": masked_var(v, mask, unbiased=False).sqrt(),
        f"{prefix}/max": masked_max(v, mask),
        f"{prefix}/min": masked_min(v, mask),
    }
