"""Reward scoring on Ray: a pool of ``RewardWorker`` actors, each scoring a contiguous chunk of the batch.

Grading runs in separate processes because sympy-based checking of free-form answers can be slow and must not
hold the trainer's interpreter; a function that raises on a sample scores it 0 and is counted in the metrics,
the batch goes on. The function travels as its ``module:function`` path (checked in the driver first, so a bad
path fails with a clear ImportError before any actor starts); each actor imports it itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mm_rl.config.schema import MultiTurnConfig, RewardConfig
from mm_rl.rewards import RewardFn, load_reward_function, reward_metrics, score_batch
from mm_rl.tools.runner import ToolRequest, ToolResult, ToolRunner


@dataclass
class RewardResult:
    """Scores of a batch in input order, the per-sample components and how many samples failed."""

    scores: list[float]
    components: dict[str, list[float]]
    n_errors: int

    @property
    def metrics(self) -> dict[str, float]:
        return reward_metrics(self.scores, self.components, self.n_errors)

    @classmethod
    def merge(cls, parts: Sequence[RewardResult]) -> RewardResult:
        """Concatenate chunk results; a component missing from a chunk counts 0 for its samples."""
        names = sorted({name for part in parts for name in part.components})
        components = {
            name: [v for part in parts for v in part.components.get(name, [0.0] * len(part.scores))] for name in names
        }
        return cls([s for part in parts for s in part.scores], components, sum(part.n_errors for part in parts))


class RewardWorker:
    """Scores batches with one reward function and, in a multi-turn job, runs the rollout's tool calls; plain
    class, wrapped with ``ray.remote`` by the pool."""

    def __init__(self, function: str | RewardFn, tools: MultiTurnConfig | None = None, **kwargs: Any) -> None:
        self.fn = load_reward_function(function) if isinstance(function, str) else function
        self.kwargs = kwargs
        self.tools = ToolRunner(tools.tools, tools.tool_timeout, tools.max_tool_output_chars) if tools else None

    def ready(self) -> bool:
        return True

    def score(self, responses: Sequence[str], truths: Sequence[str]) -> RewardResult:
        return RewardResult(*score_batch(self.fn, responses, truths, **self.kwargs))

    def run_tools(self, requests: Sequence[ToolRequest]) -> list[ToolResult]:
        if self.tools is None:
            raise RuntimeError("this worker was started without tools (rl_config.multi_turn.enable is off)")
        return self.tools.run(requests)


@dataclass
class RayTools:
    """The multi-turn loop's tool executor on the reward / tool workers (it travels to the engine's process, which
    calls the workers directly): a batch of calls split into contiguous chunks, one per worker."""

    workers: list[Any]

    def run(self, requests: Sequence[ToolRequest]) -> list[ToolResult]:
        import ray

        if not requests:
            return []
        bounds = chunk_bounds(len(requests), len(self.workers))
        calls = [w.run_tools.remote(list(requests[a:b])) for w, (a, b) in zip(self.workers, bounds, strict=False)]
        return [result for part in ray.get(calls) for result in part]


def reward_kwargs(config: RewardConfig) -> dict[str, Any]:
    """The keyword arguments the configured function receives (filtered to its signature when called)."""
    return {
        "accuracy_weight": config.accuracy_weight,
        "format_weight": config.format_weight,
        "numeric_tolerance": config.numeric_tolerance,
    }


def chunk_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal, non-empty [start, end) ranges covering ``total`` items."""
    parts = max(1, min(parts, total))
    size, extra = divmod(total, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class RewardPool:
    """``config.num_workers`` Ray actors scoring a batch in parallel; needs ``ray.init`` done by the caller.

    ``num_cpus`` per actor is small by default: grading is short bursts between rollout and training, and a
    whole CPU per reward actor would starve the actor and rollout placements on small machines.
    """

    def __init__(self, config: RewardConfig, num_cpus: float = 0.25, tools: MultiTurnConfig | None = None) -> None:
        """``tools``: a multi-turn job's settings; the workers run its tool calls too (:meth:`tool_executor`)."""
        import ray

        if config.num_workers < 1:
            raise ValueError(f"reward num_workers must be >= 1, got {config.num_workers}")
        load_reward_function(config.function)  # fail here, clearly, rather than inside an actor
        actor = ray.remote(RewardWorker).options(num_cpus=num_cpus)
        self.workers = [
            actor.remote(config.function, tools, **reward_kwargs(config)) for _ in range(config.num_workers)
        ]

    def tool_executor(self) -> RayTools:
        return RayTools(list(self.workers))

    def started(self) -> None:
        """Wait until every worker has started (they start in the background; a score call would wait too)."""
        import ray

        ray.get([worker.ready.remote() for worker in self.workers])

    def score(self, responses: Sequence[str], truths: Sequence[str]) -> RewardResult:
        import ray

        if len(responses) != len(truths):
            raise ValueError(f"{len(responses)} responses but {len(truths)} ground truths")
        if not responses:
            return RewardResult([], {}, 0)
        bounds = chunk_bounds(len(responses), len(self.workers))
        futures = [
            worker.score.remote(list(responses[a:b]), list(truths[a:b]))
            for worker, (a, b) in zip(self.workers, bounds, strict=False)
        ]
        return RewardResult.merge(ray.get(futures))

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
