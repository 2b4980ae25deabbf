"""The order of the weight sync and the memory switches around each rollout.

Colocated mode (verl's order; the device holds at most one side's large state at a time):

1. the actor offloads what the sync does not read (``offload_train_grad`` / ``offload_train_optimizer``, and with
   ``offload_train_param`` a colocated reference model's weights);
2. the engine takes back the memory of its weights, and the actor's weights are synced into it;
3. the actor offloads its parameters (``offload_train_param``) and hands its allocator's free blocks back (the
   sync's gather buffers too);
4. the engine takes back its KV cache, into the memory the actor freed.

Before training the engine sleeps at level 2 (weights dropped, not copied to the host: the next sync rewrites all
of them) and the actor loads its state back. At start-up the engine is started and put to sleep before the actor
builds its model (:meth:`RolloutSchedule.engine_started`): vLLM refuses to start unless ``gpu_memory_utilization``
of the device is free. On a CPU-only machine engine and actor share host memory, so the trainer runs the separate
schedule there (only the sync); the colocated one is the same calls, and tests check their order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mm_rl.sync.driver import SyncReport, bucket_bytes_of, sync_weights

if TYPE_CHECKING:
    from mm_rl.config.schema import ActorConfig, GenerateConfig
    from mm_rl.workers.group import WorkerGroup


class RolloutSchedule:
    """The order of the sync and the memory switches around each rollout (see the module docstring).

    ``events`` records what the driver did, in order, for logs and tests."""

    def __init__(self, group: WorkerGroup, rollout: Any, generate: GenerateConfig, actor: ActorConfig,
                 sleep_level: int = 2, collective: str | None = None, reference: WorkerGroup | None = None) -> None:
        self.group, self.rollout, self.generate, self.actor = group, rollout, generate, actor
        self.reference = reference  # a colocated reference model: its weights leave with the actor's parameters
        self.sleep_level, self.collective = sleep_level, collective
        self.events: list[str] = []
        self.offloaded_bytes = 0  # what the actor (and reference) ranks freed on their devices for the last rollout

    @property
    def offload_switches(self) -> dict[str, bool]:
        return {"params": self.actor.offload_train_param, "grads": self.actor.offload_train_grad,
                "optimizer": self.actor.offload_train_optimizer}

    def engine_started(self) -> None:
        """Colocated: the freshly started engine sleeps before the actor's model takes the device."""
        import ray

        if self.generate.colocate:
            ray.get(self.rollout.sleep.remote(self.sleep_level))
            self.events.append("engine.sleep")

    def before_rollout(self) -> SyncReport:
        """Colocated: offload what the sync does not read, engine weights back, sync, offload the parameters, engine
        KV cache back (see the module docstring). Separate: only the sync."""
        import ray

        switches, freed = self.offload_switches, 0
        if self.generate.colocate:
            freed += self.group.offload(params=False, grads=switches["grads"], optimizer=switches["optimizer"])
            self.events.append("actor.offload(grads, optimizer)")
            if self.reference is not None and switches["params"]:
                freed += self.reference.offload(params=True, grads=False, optimizer=False)
                self.events.append("reference.offload")
            ray.get(self.rollout.wake_up.remote(["weights"]))
            self.events.append("engine.wake_up(weights)")
        report = sync_weights(self.group, self.rollout, bucket_bytes_of(self.generate), collective=self.collective)
        self.events.append("sync")
        if self.generate.colocate:
            freed += self.group.offload(params=switches["params"], grads=False, optimizer=False)
            self.events.append("actor.offload(params)")
            self.offloaded_bytes = freed
            ray.get(self.rollout.wake_up.remote(["kv_cache"]))
            self.events.append("engine.wake_up(kv_cache)")
        return report

    def before_training(self) -> None:
        """Put the engine to sleep and bring the actor's offloaded state back (colocated; else nothing)."""
        import ray

        if not self.generate.colocate:
            return
        ray.get(self.rollout.sleep.remote(self.sleep_level))
        self.events.append("engine.sleep")
        self.group.onload(**self.offload_switches)
        self.events.append("actor.onload")
        if self.reference is not None and self.actor.offload_train_param:
            self.reference.onload(params=True, grads=False, optimizer=False)
            self.events.append("reference.onload")
