"""The clipped policy-gradient surrogate (PPO clip with DAPO clip-higher and dual clip) and the full actor loss.

Per valid token, with ``r = exp(logprob - old_logprob)`` (``old_logprob`` from the policy that generated the
rollout, so ``r`` is the importance ratio of the current policy to it) and advantage ``A``:

    L_clip = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
    L      = min(L_clip, -A * clip_ratio_c)   if A < 0   (dual clip)
    L      = L_clip                           otherwise

Clip-higher (``clip_ratio_high > clip_ratio_low``) lets the probability of a rare good token grow further in one
update than a common one's may shrink, which keeps entropy from collapsing. The dual clip bounds the loss of a
negative-advantage token at ``clip_ratio_c * |A|`` however large ``r`` got (a token the rollout policy found
unlikely but the current one likes), so one stale token cannot blow up the update; in that branch the loss is a
constant and the token gives no gradient. In the PPO-clipped branch the gradient is 0 too.

Clip-fraction metrics (fractions of the valid tokens of the call, detached):

- ``pg_clipfrac``: the PPO-clipped branch was taken, ``-A * clip(r) > -A * r`` strictly; equivalently
  ``(A > 0 and r > 1 + clip_ratio_high) or (A < 0 and r < 1 - clip_ratio_low)`` -- the tokens whose gradient
  the clip removed;
- ``pg_clipfrac_high``: the ``A > 0`` part (ratio above ``1 + clip_ratio_high``);
- ``pg_clipfrac_low``: the ``A < 0`` part (ratio below ``1 - clip_ratio_low``);
  so ``pg_clipfrac == pg_clipfrac_high + pg_clipfrac_low``;
- ``pg_clipfrac_dual``: ``A < 0`` and the dual bound was taken, ``L_clip > -A * clip_ratio_c`` (``r >
  clip_ratio_c``); disjoint from ``pg_clipfrac``.

``ppo_kl`` is ``mean(old_logprob - logprob)`` over valid tokens: the k1 estimate of ``KL(pi_old || pi)`` on
samples of ``pi_old`` (approx_kl).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mm_rl.algorithms.aggregation import aggregate_loss
from mm_rl.algorithms.kl import kl_penalty
from mm_rl.algorithms.masked import masked_mean

if TYPE_CHECKING:
    from mm_rl.config.schema import RLConfig

__all__ = ["actor_loss", "policy_loss"]

# exp() beyond this overflows; any token this far off-policy is clipped (or has ~0 gradient) anyway.
_LOG_RATIO_BOUND = 20.0


def _work(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``t`` with masked entries replaced by 0 (so they reach neither values nor gradients), at least float32."""
    t = t.to(torch.promote_types(t.dtype, torch.float32))
    return torch.where(mask, t, torch.zeros_like(t))


def policy_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                clip_ratio_c: float = 3.0, loss_agg_mode: str = "token-mean", *, horizon: int | None = None,
                denominator: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss (module doc), aggregated by ``loss_agg_mode`` (see ``aggregation``).

    ``logprob`` carries the gradient; ``old_logprob`` and ``advantages`` are treated as constants. ``horizon``
    and ``denominator`` are passed to :func:`~mm_rl.algorithms.aggregation.aggregate_loss`. Computed in at least
    float32. Returns ``(loss, metrics)`` with ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_high``,
    ``pg_clipfrac_low``, ``pg_clipfrac_dual`` and ``ppo_kl``.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c}")
    if not (0.0 <= clip_ratio_low < 1.0 and clip_ratio_high >= 0.0):
        raise ValueError(f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got {clip_ratio_low}, "
                         f"{clip_ratio_high}")
    mask = response_mask != 0
    lp = _work(logprob, mask)
    old = _work(old_logprob.detach(), mask)
    adv = _work(advantages.detach(), mask)

    log_ratio = lp - old
    ratio = log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp()
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_bound = -adv * clip_ratio_c
    negative = adv < 0
    loss_mat = torch.where(negative, torch.minimum(loss_ppo, loss_bound), loss_ppo)
    loss = aggregate_loss(loss_mat, mask, loss_agg_mode, horizon, denominator=denominator)

    with torch.no_grad():
        clipped = (loss_clipped > loss_unclipped) & mask
        metrics = {
            "pg_loss": loss.detach(),
            "pg_clipfrac": masked_mean(clipped.float(), mask),
            "pg_clipfrac_high": masked_mean((clipped & (adv > 0)).float(), mask),
            "pg_clipfrac_low": masked_mean((clipped & negative).float(), mask),
            "pg_clipfrac_dual": masked_mean((negative & (loss_ppo > loss_bound) & mask).float(), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
        }
    return loss, metrics


def actor_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, ref_logprob: torch.Tensor | None,
               advantages: torch.Tensor, response_mask: torch.Tensor, entropy: torch.Tensor | None,
               cfg: RLConfig, max_response_len: int, *, denominator: float | torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's loss: ``pg_loss + kl_loss_coef * kl_loss - entropy_coeff * entropy_loss``.

    Every term is aggregated with ``cfg.loss_agg_mode`` (``max_response_len`` is the horizon of
    ``seq-mean-token-sum-norm``; ``denominator`` as in ``aggregate_loss``):

    - ``pg_loss``: :func:`policy_loss` with ``cfg.clip_ratio_low / _high / _c``;
    - ``kl_loss``: ``kl_penalty(logprob, ref_logprob, cfg.kl_loss_type)``, in the loss only when
      ``cfg.use_kl_loss`` (which then needs ``ref_logprob``); reported whenever ``ref_logprob`` is given;
    - entropy bonus: the per-token ``entropy`` aggregated, in the loss when ``cfg.entropy_coeff != 0`` (which
      then needs ``entropy``).

    Metrics: ``loss``, ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_high``, ``pg_clipfrac_low``,
    ``pg_clipfrac_dual``, ``approx_kl`` (= policy_loss's ``ppo_kl``), ``kl_loss`` (when ``ref_logprob`` is
    given; the aggregated value the coefficient multiplies) and ``entropy`` (when given; the token mean over
    valid tokens, readable in nats whatever the aggregation mode).
    """
    mask = response_mask != 0
    if cfg.use_kl_loss and ref_logprob is None:
        raise ValueError("use_kl_loss needs ref_logprob")
    if cfg.entropy_coeff != 0 and entropy is None:
        raise ValueError("entropy_coeff != 0 needs the per-token entropy")
    loss, metrics = policy_loss(logprob, old_logprob, advantages, response_mask, cfg.clip_ratio_low,
                                cfg.clip_ratio_high, cfg.clip_ratio_c, cfg.loss_agg_mode,
                                horizon=max_response_len, denominator=denominator)
    metrics["approx_kl"] = metrics.pop("ppo_kl")

    if ref_logprob is not None:
        kl_mat = kl_penalty(_work(logprob, mask), _work(ref_logprob.detach(), mask), cfg.kl_loss_type)
        kl_loss = aggregate_loss(kl_mat, mask, cfg.loss_agg_mode, max_response_len, denominator=denominator)
        metrics["kl_loss"] = kl_loss.detach()
        if cfg.use_kl_loss:
            loss = loss + cfg.kl_loss_coef * kl_loss

    if entropy is not None:
        ent = _work(entropy, mask)
        metrics["entropy"] = masked_mean(ent.detach(), mask)
        if cfg.entropy_coeff != 0:
            ent_loss = aggregate_loss(ent, mask, cfg.loss_agg_mode, max_response_len, denominator=denominator)
            loss = loss - cfg.entropy_coeff * ent_loss

    metrics["loss"] = loss.detach()
    return loss, metrics
