"""Several engine replicas serve one rollout: how a batch's prompts are split over them and put back together.

A step's prompts go to the replicas by whole requests (the n samples of a prompt stay on one replica: they share
its prefix cache and its image encoding), balanced by expected tokens with a largest-first greedy, each share kept
in request order. Each replica's sampler is seeded from (the batch's seed, replica), so a resumed run splits and
samples exactly as the uninterrupted one did. The outputs come back in request order, each naming its replica, and
the batch's metrics add up the replicas' counts (wall time: the slowest replica's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mm_rl.partition import largest_first
from mm_rl.rollout.base import RolloutMetrics, RolloutOutputs

if TYPE_CHECKING:
    from mm_rl.rollout.base import RolloutRequest, SamplingSpec


def expected_tokens(request: RolloutRequest, sampling: SamplingSpec) -> int:
    """What a request costs an engine, as far as the driver can tell before generating: its prompt (prefilled once,
    the n samples share the prefix) and n responses at the length limit."""
    return len(request.prompt_ids) + sampling.n * sampling.max_tokens


def split_requests(requests: Sequence[RolloutRequest], sampling: SamplingSpec, replicas: int) -> list[list[int]]:
    """The request indices each replica generates: largest expected cost first onto the least-loaded replica,
    every share in request order (:func:`mm_rl.partition.largest_first`). Deterministic for the same requests."""
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    return largest_first([expected_tokens(request, sampling) for request in requests], replicas)


def replica_seed(seed: int, replica: int) -> int:
    """The sampling seed of ``replica`` for a batch seeded ``seed`` (replica 0 keeps it: one replica samples as a
    single engine does)."""
    return seed if replica == 0 else (seed * 1_000_003 + replica * 7_919) % (2**31 - 1)


def merge_outputs(shares: Sequence[Sequence[int]], results: Sequence[RolloutOutputs | None]) -> RolloutOutputs:
    """The replicas' outputs in request order (``results[r]`` answers ``shares[r]``, None for an empty share), each
    output's ``replica`` set; the metrics summed, wall time the slowest replica's."""
    total = sum(len(share) for share in shares)
    placed: list = [None] * total
    metrics = RolloutMetrics(replicas=len(shares))
    walls = []
    for replica, (share, outputs) in enumerate(zip(shares, results, strict=True)):
        if not share:
            continue
        if outputs is None or len(outputs) != len(share):
            raise RuntimeError(
                f"rollout engine {replica} answered {0 if outputs is None else len(outputs)} of "
                f"its {len(share)} prompts"
            )
        for index, output in zip(share, outputs, strict=True):
            placed[index] = dataclasses.replace(output, replica=replica)
        _add(metrics, outputs.metrics)
        walls.append(outputs.metrics.wall_s)
    metrics.wall_s = max(walls, default=0.0)
    metrics.replica_prompts_min = min(len(share) for share in shares)
    metrics.replica_wall_spread = max(walls) / min(walls) if walls and min(walls) > 0 else 1.0
    return RolloutOutputs(placed, metrics)


_NOT_SUMMED = {"wall_s", "replicas", "replica_prompts_min", "replica_wall_spread"}


def _add(into: RolloutMetrics, other: RolloutMetrics) -> None:
    for field in dataclasses.fields(RolloutMetrics):
        if field.name not in _NOT_SUMMED:
            setattr(into, field.name, getattr(into, field.name) + getattr(other, field.name))
