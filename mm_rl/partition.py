"""Even shares of weighted items: the one load-balancing rule the trainer's DP shards and the rollout engine
replicas' prompt splits both use."""

from __future__ import annotations

from collections.abc import Sequence


def largest_first(costs: Sequence[int], parts: int) -> list[list[int]]:
    """The item indices of each of ``parts`` parts, their cost totals as even as a largest-first greedy makes them:
    items by falling cost (ties: lower index first), each onto the lightest part (ties: fewer items, then the lower
    part); every part in index order. Deterministic for the same costs."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    loads, members = [0] * parts, [[] for _ in range(parts)]  # type: list[int], list[list[int]]
    for item in sorted(range(len(costs)), key=lambda i: -costs[i]):
        lightest = min(range(parts), key=lambda k: (loads[k], len(members[k])))
        members[lightest].append(item)
        loads[lightest] += costs[item]
    return [sorted(chosen) for chosen in members]
