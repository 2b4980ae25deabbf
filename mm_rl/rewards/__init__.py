"""Rewards: rule reward functions, loading a ``module:function`` path, and batch scoring that survives errors.

A reward function takes ``(response, ground_truth, **kwargs)`` and returns a number or a dict with a ``score``
key and any number of components (``accuracy``, ``format``...). ``score_batch`` runs one over a batch: a sample
whose function raises, or returns something that is not a finite number, scores 0 and is counted, so one odd
response never stops a training step. Nothing here imports Ray (see ``mm_rl.rewards.worker``).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float | dict[str, float]]


def load_reward_function(path: str) -> RewardFn:
    """Import ``package.module:function``; errors name the path and what was wrong with it."""
    from mm_rl.imports import import_attribute

    target = import_attribute(path, "reward function", "mm_rl.rewards.geo3k:compute_score", "module:function")
    if not callable(target):
        raise TypeError(f"reward function {path!r} is a {type(target).__name__}, not callable")
    return target


def accepted_kwargs(fn: RewardFn, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``fn`` accepts, so the config's weights reach the built-in reward while a
    custom ``f(response, ground_truth)`` still works; a function with ``**kwargs`` gets them all."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: pass nothing extra
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(kwargs)
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in names}


def _as_components(result: Any) -> dict[str, float]:
    """``{"score": ..., other components}`` from a number or a dict; raises on anything not finite."""
    values = dict(result) if isinstance(result, dict) else {"score": result}
    if "score" not in values:
        raise ValueError(f"reward dict has no 'score' key: {sorted(values)}")
    out = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"reward component {key!r} is {value!r}, not a finite number")
        out[str(key)] = float(value)
    return out


def score_batch(
    fn: RewardFn, responses: Sequence[str], truths: Sequence[str], **kwargs: Any
) -> tuple[list[float], dict[str, list[float]], int]:
    """(scores, components by name, number of failed samples) for a batch; failed samples score 0 everywhere."""
    if len(responses) != len(truths):
        raise ValueError(f"{len(responses)} responses but {len(truths)} ground truths")
    kwargs = accepted_kwargs(fn, kwargs)
    results: list[dict[str, float] | None] = []
    first_error: tuple[int, BaseException] | None = None
    for index, (response, truth) in enumerate(zip(responses, truths, strict=True)):
        try:
            results.append(_as_components(fn(response, truth, **kwargs)))
        except Exception as error:
            results.append(None)
            first_error = first_error or (index, error)
    n_errors = sum(r is None for r in results)
    if first_error is not None:
        logger.warning(
            "reward function failed on %d of %d samples (scored 0); first, sample %d: %r",
            n_errors,
            len(results),
            *first_error,
        )
    names = sorted({key for r in results if r for key in r} - {"score"})
    scores = [r["score"] if r else 0.0 for r in results]
    components = {name: [r.get(name, 0.0) if r else 0.0 for r in results] for name in names}
    return scores, components, n_errors


def reward_metrics(scores: Sequence[float], components: dict[str, list[float]], n_errors: int) -> dict[str, float]:
    """Batch means for logging: ``reward/score``, ``reward/<component>`` and ``reward/errors``."""
    count = max(len(scores), 1)
    metrics = {"reward/score": sum(scores) / count, "reward/errors": float(n_errors)}
    metrics.update({f"reward/{name}": sum(values) / count for name, values in components.items()})
    return metrics
