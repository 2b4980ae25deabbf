"""The TP x PP (x DP) grid of :class:`~mm_rl.workers.megatron_worker.MegatronWorker` actors, called together.

One placement group holds a bundle per rank (packed onto as few nodes as possible; rank i in bundle i), so the
ranks start together and keep their CPUs / devices. Rank 0 reports its node address and a free port; every rank
joins the process group there. ``run`` calls a method on every rank at once, which is what collective methods
need (the pipeline schedule, the TP gathers of the weight sync): calling ranks one by one would deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mm_rl.workers.megatron_worker import MegatronWorker, RankCoords, WorkerSpec, threads_for


class WorkerGroup:
    """Megatron ranks as Ray actors; ``cpus_per_worker`` (fractions allowed) is each rank's thread budget too.

    ``resources_per_worker`` adds bundle resources (e.g. ``{"GPU": 1}`` or an NPU resource) on accelerators."""

    def __init__(self, spec: WorkerSpec, *, cpus_per_worker: float = 1.0,
                 resources_per_worker: dict[str, float] | None = None, strategy: str = "PACK") -> None:
        import dataclasses

        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.spec = dataclasses.replace(spec, num_threads=threads_for(cpus_per_worker))
        extra = dict(resources_per_worker or {})
        self.placement = placement_group([{"CPU": cpus_per_worker, **extra}] * spec.world_size, strategy=strategy)
        ray.get(self.placement.ready())
        actor = ray.remote(MegatronWorker)
        gpus = extra.pop("GPU", 0)
        self.workers = [
            actor.options(num_cpus=cpus_per_worker, num_gpus=gpus, resources=extra or None,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, rank)).remote(
                self.spec, rank)
            for rank in range(spec.world_size)
        ]
        address, port = ray.get(self.workers[0].rendezvous_address.remote())
        self.coords: list[RankCoords] = self.run("init_distributed", address, port)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` started on every rank; returns the object refs in rank order.

        Large arguments are put into the object store once and shared by all ranks."""
        import ray

        args = tuple(ray.put(a) if _large(a) else a for a in args)
        return [getattr(worker, method).remote(*args, **kwargs) for worker in self.workers]

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method`` on every rank at once; the results in rank order."""
        import ray

        return list(ray.get(self.submit(method, *args, **kwargs)))

    def build(self, mm_dir: str | None, iteration: int | str | None = None) -> None:
        """Every rank builds its stage and loads its mp_rank file from ``mm_dir``."""
        self.run("build", mm_dir, iteration)

    def compute_log_probs(self, micro_batches: Sequence[dict[str, Any]], temperature: float = 1.0) -> list[Any]:
        """Log-probs per micro-batch from the last stage (DP replica 0's; every rank runs the schedule)."""
        results = self.run("compute_log_probs", list(micro_batches), temperature)
        return self.from_last_stage(results)

    def from_last_stage(self, results: Sequence[Any]) -> Any:
        """The result of the last stage's TP-rank 0 in DP replica 0."""
        for coords, result in zip(self.coords, results, strict=True):
            if coords.pp_rank == self.spec.pp - 1 and coords.tp_rank == 0 and coords.dp_rank == 0:
                return result
        raise RuntimeError("no last-stage rank in the group")

    def shutdown(self) -> None:
        """Leave the process group on every rank, then end the actors and free the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            self.run("shutdown")
        finally:
            for worker in self.workers:
                ray.kill(worker)
            remove_placement_group(self.placement)


def _large(value: Any) -> bool:
    """Arguments worth one shared object-store copy (micro-batches, tensors) rather than one per call."""
    return isinstance(value, list | tuple | dict) and len(value) > 0
