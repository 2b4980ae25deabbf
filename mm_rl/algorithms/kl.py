"""KL between the policy and the reference model: per-token estimators, KL in the reward, coefficient control.

The sampled token ``x ~ pi`` gives ``log pi(x)`` (``logprob``) and ``log pi_ref(x)`` (``ref_logprob``); with
``d = logprob - ref_logprob`` the estimators of ``KL(pi || pi_ref)`` (Schulman, "Approximating KL divergence") are

- ``k1`` (``"k1"``): ``d`` -- unbiased, high variance, can be negative;
- ``abs``: ``|d|``;
- ``k2`` (``"k2"`` / ``"mse"``): ``0.5 * d^2`` -- biased, low variance, >= 0;
- ``k3`` (``"k3"`` / ``"low_var_kl"``): ``exp(-d) + d - 1`` -- unbiased, low variance, >= 0 (``e^x >= 1 + x``);
  clamped to ``[-10, 10]`` as a loss term so one badly off-policy token cannot dominate a step.

Two ways to use it: as a loss term (``RLConfig.use_kl_loss``, see ``policy_loss.actor_loss``) or subtracted
from the token rewards (``RLConfig.use_kl_in_reward``, :func:`apply_kl_in_reward`) with a coefficient from a
:class:`FixedKLController` or an :class:`AdaptiveKLController`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mm_rl.algorithms.masked import masked_mean

if TYPE_CHECKING:
    from mm_rl.config.schema import KlControlConfig

__all__ = [
    "KL_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_in_reward",
    "kl_penalty",
    "make_kl_controller",
]

KL_KINDS: tuple[str, ...] = ("k1", "abs", "k2", "mse", "k3", "low_var_kl")
# exp() of a log-ratio beyond this would overflow float32 / bf16 long before the [-10, 10] clamp applies.
_LOG_RATIO_BOUND = 20.0
_K3_BOUND = 10.0


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of ``KL(pi || pi_ref)`` from the sampled tokens' log-probs (see the module doc).

    Elementwise; differentiable in ``logprob``. For ``k3`` the log-ratio ``ref - logprob`` is clamped to
    ``[-20, 20]`` before ``exp`` (no overflow to inf, whose gradient would be NaN) and the estimate to
    ``[-10, 10]``; the clamps zero the gradient outside them.
    """
    d = logprob - ref_logprob
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("k2", "mse"):
        return 0.5 * d.square()
    if kind in ("k3", "low_var_kl"):
        log_ratio = (-d).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        return (log_ratio.exp() - log_ratio - 1).clamp(-_K3_BOUND, _K3_BOUND)
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_KINDS}")


def apply_kl_in_reward(
    token_level_scores: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``rewards_t = scores_t - kl_coef * KL_t`` on valid tokens (0 on masked ones), no gradient.

    Returns ``(token_level_rewards, metrics)`` with ``kl`` -- the batch mean over sequences of each sequence's
    mean per-token KL, the value to feed ``controller.update(kl, n_steps=batch_size)`` -- and ``kl_coef``.
    ``kind`` defaults to ``k1`` (the classic per-token penalty whose sum over a sequence is the sequence KL).
    """
    mask = response_mask != 0
    with torch.no_grad():
        kl = torch.where(mask, kl_penalty(logprob.detach(), ref_logprob.detach(), kind), 0.0)
        rewards = torch.where(mask, token_level_scores - kl_coef * kl, torch.zeros_like(token_level_scores))
        seq_kl = masked_mean(kl, mask, dim=-1)
        has_tokens = mask.any(dim=-1)
        current_kl = masked_mean(seq_kl, has_tokens)
    metrics = {"kl": current_kl, "kl_coef": torch.tensor(float(kl_coef))}
    return rewards, metrics


class FixedKLController:
    """A constant KL coefficient; ``update`` does nothing. Checkpointable like the adaptive one."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (same signature as :meth:`AdaptiveKLController.update`)."""

    def state_dict(self) -> dict[str, Any]:
        """The coefficient, tagged with the controller type."""
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the coefficient saved by :meth:`state_dict`."""
        _check_type(state, "fixed")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller of the KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Prefs").

    ``update(current_kl, n_steps)``: ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)`` and
    ``value *= 1 + e * n_steps / horizon`` -- the coefficient grows while the measured KL is above the target
    and shrinks while below, by at most 20% per ``horizon`` samples. ``n_steps`` is the number of samples the
    KL was measured on (the batch size).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl ({target_kl}) and horizon ({horizon}) must be > 0")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards keeping ``current_kl`` at the target (see the class doc)."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        """The current coefficient (the only state; target and horizon come from the config)."""
        return {"type": "adaptive", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the coefficient saved by :meth:`state_dict`."""
        _check_type(state, "adaptive")
        self.value = float(state["value"])


def _check_type(state: dict[str, Any], expected: str) -> None:
    if state.get("type", expected) != expected:
        raise ValueError(f"KL controller state of type {state['type']!r} cannot load into a {expected} controller")


def make_kl_controller(kl_ctrl: KlControlConfig) -> FixedKLController | AdaptiveKLController:
    """The controller ``RLConfig.kl_ctrl`` (a ``KlControlConfig``: type, kl_coef, target_kl, horizon) describes."""
    if kl_ctrl.type == "fixed":
        return FixedKLController(kl_ctrl.kl_coef)
    if kl_ctrl.type == "adaptive":
        return AdaptiveKLController(kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)
    raise ValueError(f"unknown KL controller type {kl_ctrl.type!r}; expected 'fixed' or 'adaptive'")
