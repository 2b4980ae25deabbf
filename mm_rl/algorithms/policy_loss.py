"""Policy-gradient losses (PPO clip, GSPO, CISPO, SAPO) and the full actor loss.

Per valid token ``t`` of sequence ``i``, with ``r = exp(logprob - old_logprob)`` (``old_logprob`` from the policy
that generated the rollout, so ``r`` is the importance ratio of the current policy to it), advantage ``A`` and
``eps_low = clip_ratio_low``, ``eps_high = clip_ratio_high``, ``RLConfig.policy_loss`` selects the loss matrix:

- ``ppo_clip`` (default; PPO with DAPO clip-higher and dual clip)::

      L_clip = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))
      L      = min(L_clip, -A * clip_ratio_c)   if A < 0   (dual clip)
      L      = L_clip                           otherwise

  Clip-higher (``eps_high > eps_low``) lets the probability of a rare good token grow further in one update than
  a common one's may shrink, which keeps entropy from collapsing. The dual clip bounds the loss of a
  negative-advantage token at ``clip_ratio_c * |A|`` however large ``r`` got, so one stale token cannot blow up
  the update; in that branch and in the PPO-clipped branch the token gives no gradient.

- ``gspo`` (Group Sequence Policy Optimization, arXiv 2507.18071): one ratio per sequence, the geometric mean of
  its token ratios ``s_i = exp(mean_t (logprob - old_logprob))``, clipped per sequence:
  ``L = max(-A * s_i, -A * clip(s_i, 1 - eps_low, 1 + eps_high))``. Written in the paper's GSPO-token form,
  ``s_it = sg(s_i) * pi(y_t) / sg(pi(y_t))`` (value ``s_i``, gradient ``s_i * grad log pi(y_t)``), which with a
  sequence-constant advantage equals GSPO exactly in value and gradient under ``seq-mean-token-mean``. The paper
  clips at ``eps_low = 3e-4``, ``eps_high = 4e-4``: a sequence ratio moves far less than a token ratio.

- ``cispo`` (MiniMax-M1, arXiv 2506.13585): the clipped IS weight as a constant on EVERY token,
  ``L = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logprob``, gradient ``-clip(r) * A * grad log pi``: unlike
  PPO, a token whose ratio left the band keeps its gradient (weighted by the bound). ``eps_low >= 1`` means no
  lower bound (the paper's setting). The loss VALUE is a log-prob sum, not comparable with a PPO ``pg_loss``.

- ``sapo`` (Soft Adaptive Policy Optimization, arXiv 2511.20347): a smooth gate instead of the hard clip,
  ``L = -A * (4 / tau) * sigmoid(tau * (r - 1))`` with ``tau = tau_pos`` where ``A > 0`` and ``tau_neg``
  otherwise; at ``r = 1`` its gradient equals the unclipped PPO gradient, further away it decays smoothly
  (faster for ``A <= 0`` with ``tau_neg > tau_pos``).

The matrix is multiplied by the rollout-correction weights when given (``is_weights``, see
``rollout_correction``), then aggregated by ``loss_agg_mode`` (see ``aggregation``).

Metrics (fractions of the valid tokens of the call, detached):

- ``pg_clipfrac`` (ppo_clip, gspo, cispo): the clip changed the token: for ppo_clip / gspo the clipped branch was
  taken, ``-A * clip(r) > -A * r`` strictly, i.e. ``(A > 0 and r > 1 + eps_high) or (A < 0 and r < 1 - eps_low)``
  (``s_i`` for gspo) -- the tokens whose gradient the clip removed; for cispo the weight was clipped
  (``r`` outside the band, whatever the sign of ``A``);
- ``pg_clipfrac_high`` / ``pg_clipfrac_low``: its part above ``1 + eps_high`` / below ``1 - eps_low`` (for
  ppo_clip and gspo that is the ``A > 0`` / ``A < 0`` part); ``pg_clipfrac == pg_clipfrac_high + pg_clipfrac_low``;
- ``pg_clipfrac_dual`` (ppo_clip): ``A < 0`` and the dual bound was taken, ``L_clip > -A * clip_ratio_c``;
  disjoint from ``pg_clipfrac``. ``pg_clipfrac_lower`` is the same number under verl's name (verl's "lower" is the
  dual clip, not mm_rl's ``pg_clipfrac_low``);
- ``ppo_kl``: ``mean(old_logprob - logprob)`` with the log-ratio clamped to ``[-20, 20]`` as the loss clamps it
  (verl's ``ppo_kl``); ``approx_kl``: the same mean unclamped. Both are the k1 estimate of ``KL(pi_old || pi)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mm_rl.algorithms.aggregation import aggregate_loss
from mm_rl.algorithms.kl import kl_penalty
from mm_rl.algorithms.masked import masked_mean
from mm_rl.algorithms.rollout_correction import resolve_rollout_is, rollout_is_weights

if TYPE_CHECKING:
    from mm_rl.config.schema import RLConfig

__all__ = ["POLICY_LOSSES", "actor_loss", "policy_loss"]

POLICY_LOSSES: tuple[str, ...] = ("ppo_clip", "gspo", "cispo", "sapo")
Metrics = dict[str, torch.Tensor]

# exp() beyond this overflows; any token this far off-policy is clipped (or has ~0 gradient) anyway.
_LOG_RATIO_BOUND = 20.0


def _work(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``t`` with masked entries replaced by 0 (so they reach neither values nor gradients), at least float32."""
    t = t.to(torch.promote_types(t.dtype, torch.float32))
    return torch.where(mask, t, torch.zeros_like(t))


def _check_params(
    loss_type: str, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float, tau_pos: float, tau_neg: float
) -> None:
    """Each loss's own bounds: a ratio band needs ``1 - eps_low > 0`` (CISPO's weight may have no lower bound)."""
    if loss_type not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {loss_type!r}; expected one of {POLICY_LOSSES}")
    if loss_type == "ppo_clip" and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c}")
    low_ok = clip_ratio_low >= 0.0 and (clip_ratio_low < 1.0 or loss_type == "cispo")
    if loss_type != "sapo" and not (low_ok and clip_ratio_high >= 0.0):
        raise ValueError(
            f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got {clip_ratio_low}, {clip_ratio_high}"
        )
    if loss_type == "sapo" and not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"SAPO needs tau_pos > 0 and tau_neg > 0, got {tau_pos}, {tau_neg}")


def _ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp()


def _clip_fractions(clipped: torch.Tensor, high: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """``pg_clipfrac`` and its ``_high`` / ``_low`` parts over the valid tokens."""
    clipped = clipped & mask
    return {
        "pg_clipfrac": masked_mean(clipped.float(), mask),
        "pg_clipfrac_high": masked_mean((clipped & high).float(), mask),
        "pg_clipfrac_low": masked_mean((clipped & ~high).float(), mask),
    }


def _ppo_clip(
    log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, low: float, high: float, c: float
) -> tuple[torch.Tensor, Metrics]:
    """PPO clip + dual clip loss matrix (module doc) and its clip fractions."""
    ratio = _ratio(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_bound = -adv * c
    negative = adv < 0
    loss_mat = torch.where(negative, torch.minimum(loss_ppo, loss_bound), loss_ppo)
    with torch.no_grad():
        metrics = _clip_fractions(loss_clipped > loss_unclipped, adv > 0, mask)
        dual = masked_mean((negative & (loss_ppo > loss_bound) & mask).float(), mask)
        metrics |= {"pg_clipfrac_dual": dual, "pg_clipfrac_lower": dual}
    return loss_mat, metrics


def _gspo(
    lp: torch.Tensor, log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token loss matrix: the sequence ratio on every token, its gradient through each token's log-prob."""
    lengths = mask.sum(dim=-1).clamp(min=1).to(log_ratio.dtype)
    seq_log_ratio = (log_ratio.sum(dim=-1) / lengths).detach()
    s = (lp - lp.detach() + seq_log_ratio.unsqueeze(-1)).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp()
    loss_unclipped = -adv * s
    loss_clipped = -adv * s.clamp(1.0 - low, 1.0 + high)
    with torch.no_grad():
        metrics = _clip_fractions(loss_clipped > loss_unclipped, adv > 0, mask)
    return torch.maximum(loss_unclipped, loss_clipped), metrics


def _cispo(
    lp: torch.Tensor, log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, Metrics]:
    """CISPO loss matrix: ``-sg(clip(r)) * A * logprob`` on every valid token."""
    ratio = _ratio(log_ratio).detach()
    weight = ratio.clamp(min=1.0 - low, max=1.0 + high)
    with torch.no_grad():
        above = ratio > 1.0 + high
        metrics = _clip_fractions(above | (ratio < 1.0 - low), above, mask)
    return -weight * adv * lp, metrics


def _sapo(log_ratio: torch.Tensor, adv: torch.Tensor, tau_pos: float, tau_neg: float) -> tuple[torch.Tensor, Metrics]:
    """SAPO loss matrix: ``-A * (4 / tau) * sigmoid(tau * (r - 1))``, ``tau`` by the sign of ``A``."""
    ratio = _ratio(log_ratio)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -adv * gate, {}


def policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    *,
    horizon: int | None = None,
    denominator: float | torch.Tensor | None = None,
    loss_type: str = "ppo_clip",
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """The ``loss_type`` policy loss (module doc), times ``is_weights`` when given, aggregated by ``loss_agg_mode``.

    ``logprob`` carries the gradient; ``old_logprob``, ``advantages`` and ``is_weights`` are treated as
    constants. ``horizon`` and ``denominator`` are passed to
    :func:`~mm_rl.algorithms.aggregation.aggregate_loss`. Computed in at least float32. Returns ``(loss,
    metrics)`` with ``pg_loss``, ``ppo_kl``, ``approx_kl`` and the loss's clip fractions (module doc).
    """
    _check_params(loss_type, clip_ratio_low, clip_ratio_high, clip_ratio_c, tau_pos, tau_neg)
    mask = response_mask != 0
    lp = _work(logprob, mask)
    adv = _work(advantages.detach(), mask)
    log_ratio = lp - _work(old_logprob.detach(), mask)
    if loss_type == "ppo_clip":
        loss_mat, metrics = _ppo_clip(log_ratio, adv, mask, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    elif loss_type == "gspo":
        loss_mat, metrics = _gspo(lp, log_ratio, adv, mask, clip_ratio_low, clip_ratio_high)
    elif loss_type == "cispo":
        loss_mat, metrics = _cispo(lp, log_ratio, adv, mask, clip_ratio_low, clip_ratio_high)
    else:
        loss_mat, metrics = _sapo(log_ratio, adv, tau_pos, tau_neg)
    if is_weights is not None:
        loss_mat = loss_mat * _work(is_weights.detach(), mask)
    loss = aggregate_loss(loss_mat, mask, loss_agg_mode, horizon, denominator=denominator)
    with torch.no_grad():
        bounded = log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        metrics = {
            "pg_loss": loss.detach(),
            **metrics,
            "ppo_kl": masked_mean(-bounded, mask),
            "approx_kl": masked_mean(-log_ratio, mask),
        }
    return loss, metrics


def _correction(
    old_logprob: torch.Tensor, engine_logprob: torch.Tensor | None, response_mask: torch.Tensor, cfg: RLConfig
) -> tuple[torch.Tensor | None, Metrics]:
    """The rollout-correction weights in force (None when off) and their metrics."""
    level = resolve_rollout_is(cfg)
    if level == "off":
        return None, {}
    if engine_logprob is None:
        raise ValueError(f"rollout_correction (level {level!r}) needs the engine's log-probs (engine_logprob)")
    rc = cfg.rollout_correction
    return rollout_is_weights(
        old_logprob, engine_logprob, response_mask, level, rc.rollout_is_mode, rc.rollout_is_threshold
    )


def actor_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    ref_logprob: torch.Tensor | None,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    entropy: torch.Tensor | None,
    cfg: RLConfig,
    max_response_len: int,
    *,
    denominator: float | torch.Tensor | None = None,
    engine_logprob: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """The actor's loss: ``pg_loss + kl_loss_coef * kl_loss - entropy_coeff * entropy_loss``.

    Every term is aggregated with ``cfg.loss_agg_mode`` (``max_response_len`` is the horizon of
    ``seq-mean-token-sum-norm``; ``denominator`` as in ``aggregate_loss``):

    - ``pg_loss``: :func:`policy_loss` of kind ``cfg.policy_loss`` with ``cfg.clip_ratio_low / _high / _c`` and
      ``cfg.tau_pos / tau_neg``, weighted by the rollout correction when it is in force
      (:func:`~mm_rl.algorithms.rollout_correction.resolve_rollout_is`; it then needs ``engine_logprob``, the
      engine's log-probs of the sampled tokens aligned like ``old_logprob``). With the correction off,
      ``engine_logprob`` is ignored and the result is exactly the uncorrected one;
    - ``kl_loss``: ``kl_penalty(logprob, ref_logprob, cfg.kl_loss_type)``, in the loss only when
      ``cfg.use_kl_loss`` (which then needs ``ref_logprob``); reported whenever ``ref_logprob`` is given;
    - entropy bonus: the per-token ``entropy`` aggregated, in the loss when ``cfg.entropy_coeff != 0`` (which
      then needs ``entropy``).

    The correction weights only the policy-gradient term: the KL and entropy terms regularise the current policy
    and keep every token. Metrics: ``loss``, policy_loss's (``pg_loss``, clip fractions, ``ppo_kl``,
    ``approx_kl``), the correction's ``rollout_corr/*`` when in force, ``kl_loss`` (when ``ref_logprob`` is given;
    the aggregated value the coefficient multiplies) and ``entropy`` (when given; the token mean over valid
    tokens, readable in nats whatever the aggregation mode).
    """
    mask = response_mask != 0
    if cfg.use_kl_loss and ref_logprob is None:
        raise ValueError("use_kl_loss needs ref_logprob")
    if cfg.entropy_coeff != 0 and entropy is None:
        raise ValueError("entropy_coeff != 0 needs the per-token entropy")
    is_weights, correction_metrics = _correction(old_logprob, engine_logprob, response_mask, cfg)
    loss, metrics = policy_loss(
        logprob,
        old_logprob,
        advantages,
        response_mask,
        cfg.clip_ratio_low,
        cfg.clip_ratio_high,
        cfg.clip_ratio_c,
        cfg.loss_agg_mode,
        horizon=max_response_len,
        denominator=denominator,
        loss_type=cfg.policy_loss,
        tau_pos=cfg.tau_pos,
        tau_neg=cfg.tau_neg,
        is_weights=is_weights,
    )
    metrics.update(correction_metrics)

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
