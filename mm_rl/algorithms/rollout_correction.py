"""Rollout-vs-training correction: importance-sampling weights from the engine's log-probs to the old policy's.

The rollout engine samples from ``pi_engine`` (bf16 vLLM kernels, another attention implementation, MoE routing,
or weights one version behind with ``one_step_off_policy``), while the PPO ratio is taken against ``pi_old``, the
actor's own recomputation before the update. The samples are therefore off-policy for ``pi_old`` and the gradient
is biased. With the per-token log-ratio ``d_t = log pi_old(y_t) - log pi_engine(y_t)`` (both constants: no
gradient flows through a weight) the importance weight of a valid token is

- ``token``:    ``rho_t = exp(d_t)``;
- ``sequence``: ``rho_i = exp(sum_t d_t)`` over the sequence's valid tokens (the product of its token ratios,
  the exact sequence-level weight), the same value on every token of the sequence;

each exponent bounded to ``[-20, 20]`` first (no overflow to inf). With the threshold ``C``:

- ``truncate`` (TIS): ``w = min(rho, C)``, every token kept;
- ``mask`` (MIS): ``w = rho`` where ``rho <= C`` and ``w = 0`` where ``rho > C``: such a token (``token``) or
  every token of such a sequence (``sequence``) drops out of the policy-gradient term.

The policy loss matrix is multiplied by ``w`` before aggregation (see ``policy_loss``); a masked token keeps its
place in the aggregation's denominator, as in the estimator ``E[1{rho <= C} rho f]``. No lower bound is applied:
a small weight only shrinks a token's contribution.

Metrics (prefix ``rollout_corr/``, names and meanings as in verl's rollout correction; detached 0-dim tensors;
"valid" = ``response_mask`` set):

- ``rollout_is_mean`` / ``rollout_is_max``: mean over valid tokens / max of ``rho`` before truncation or masking;
- ``rollout_is_ratio_fraction_high``: fraction of weights above ``C`` (of valid tokens for ``token``, of
  non-empty sequences for ``sequence``): the truncated share under TIS;
- ``rollout_rs_masked_fraction`` (mask mode): fraction of valid tokens left out;
- ``kl``: ``mean(log pi_engine - log pi_old)``, the k1 estimate of ``KL(pi_engine || pi_old)`` on the engine's
  samples; ``k3_kl``: ``mean(exp(d) - d - 1)``, the non-negative k3 estimate of the same;
- ``chi2_token``: ``mean(rho_t^2) - 1``, ``chi2_seq``: ``mean_i(rho_i^2) - 1`` over non-empty sequences (the
  chi-square divergence of ``pi_old`` from ``pi_engine``, the variance of the weights).

:func:`resolve_rollout_is` turns ``RLConfig.rollout_correction.rollout_is`` (``auto`` included) into the level the
trainer and the loss use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mm_rl.algorithms.masked import masked_max, masked_mean

if TYPE_CHECKING:
    from mm_rl.config.schema import RLConfig

__all__ = ["ROLLOUT_IS_LEVELS", "ROLLOUT_IS_MODES", "resolve_rollout_is", "rollout_is_weights"]

ROLLOUT_IS_LEVELS: tuple[str, ...] = ("token", "sequence")
ROLLOUT_IS_MODES: tuple[str, ...] = ("truncate", "mask")
_LOG_BOUND = 20.0  # exp(20) ~ 4.9e8: a weight this large is truncated or masked anyway, and stays finite


def resolve_rollout_is(rl: RLConfig) -> str:
    """The correction level in force: ``"off"``, ``"token"`` or ``"sequence"`` (``rollout_is: null`` is off).

    ``auto`` is off for an on-policy step (the engine holds the weights the actor recomputes with, only kernels
    differ) and ``token`` with ``one_step_off_policy`` (the rollouts are one weight version behind). In
    ``bypass_mode`` the old log-probs ARE the engine's, so ``auto`` resolves to off: there is nothing left to
    correct (the PPO ratio is then taken against the engine directly).
    """
    rc = rl.rollout_correction
    if rc.rollout_is is None:
        return "off"
    if rc.rollout_is != "auto":
        return rc.rollout_is
    return "token" if rl.one_step_off_policy and not rc.bypass_mode else "off"


def rollout_is_weights(
    old_logprob: torch.Tensor,
    engine_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
    mode: str = "truncate",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(w, metrics)``: the ``[batch, len]`` correction weights (module doc) and their metrics.

    ``w`` is detached, at least float32, and exactly 0 where ``response_mask`` is 0 (or the token is masked).
    Masked positions of the inputs (even NaN / inf) have no effect.
    """
    if level not in ROLLOUT_IS_LEVELS or mode not in ROLLOUT_IS_MODES:
        raise ValueError(
            f"rollout correction level {level!r} / mode {mode!r}: expected one of "
            f"{ROLLOUT_IS_LEVELS} / {ROLLOUT_IS_MODES}"
        )
    if threshold <= 1.0:
        raise ValueError(f"rollout_is_threshold must be > 1, got {threshold}")
    mask = response_mask != 0
    with torch.no_grad():
        log_ratio = _masked_log_ratio(old_logprob, engine_logprob, mask)
        seq_log = log_ratio.sum(dim=-1).clamp(-_LOG_BOUND, _LOG_BOUND)
        token_log = log_ratio.clamp(-_LOG_BOUND, _LOG_BOUND)
        rho = (token_log if level == "token" else seq_log.unsqueeze(-1).expand_as(log_ratio)).exp()
        high = (rho > threshold) & mask
        kept = rho.clamp(max=threshold) if mode == "truncate" else torch.where(high, torch.zeros_like(rho), rho)
        weights = torch.where(mask, kept, torch.zeros_like(kept))
        metrics = _weight_metrics(rho, high, mask, level, mode) | _mismatch_metrics(log_ratio, seq_log, mask)
    return weights, metrics


def _masked_log_ratio(old: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``old - engine`` in at least float32, 0 (not NaN) where masked."""
    dtype = torch.promote_types(torch.promote_types(old.dtype, engine.dtype), torch.float32)
    diff = old.detach().to(dtype) - engine.detach().to(device=old.device, dtype=dtype)
    return torch.where(mask, diff, torch.zeros_like(diff))


def _weight_metrics(
    rho: torch.Tensor, high: torch.Tensor, mask: torch.Tensor, level: str, mode: str
) -> dict[str, torch.Tensor]:
    """Mean / max of the raw weights and the share above the threshold (per token, or per sequence)."""
    if level == "token":
        fraction_high = masked_mean(high.float(), mask)
    else:
        non_empty = mask.any(dim=-1)
        fraction_high = masked_mean(high.any(dim=-1).float(), non_empty)
    out = {
        "rollout_corr/rollout_is_mean": masked_mean(rho, mask),
        "rollout_corr/rollout_is_max": masked_max(rho, mask),
        "rollout_corr/rollout_is_ratio_fraction_high": fraction_high,
    }
    if mode == "mask":
        out["rollout_corr/rollout_rs_masked_fraction"] = masked_mean(high.float(), mask)
    return out


def _mismatch_metrics(log_ratio: torch.Tensor, seq_log: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """KL (k1, k3) and chi-square between the engine's and the old policy over the valid tokens (``log_ratio``
    unbounded, ``seq_log`` bounded); written as means of ``x - 1`` so that an empty selection gives 0."""
    bounded = log_ratio.clamp(-_LOG_BOUND, _LOG_BOUND)
    return {
        "rollout_corr/kl": masked_mean(-log_ratio, mask),
        "rollout_corr/k3_kl": masked_mean(bounded.exp() - bounded - 1.0, mask),
        "rollout_corr/chi2_token": masked_mean((2.0 * bounded).exp() - 1.0, mask),
        "rollout_corr/chi2_seq": masked_mean((2.0 * seq_log).exp() - 1.0, mask.any(dim=-1)),
    }
