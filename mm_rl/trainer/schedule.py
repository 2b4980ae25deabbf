"""The order of the weight sync and the memory switches around each rollout.

Colocated mode (verl's order; the device holds at most one side's large state at a time). Every engine replica
is switched alike, and only the ranks on a device that holds a replica (``shared_bundles``) offload:

1. the actor offloads what the sync does not read (``offload_train_grad`` / ``offload_train_optimizer``, and with
   ``offload_train_param`` a colocated reference model's weights);
2. the engine takes back the memory of its weights, and the actor's weights are synced into it;
3. the actor offloads its parameters (``offload_train_param``) and hands its allocator's free blocks back (the
   sync's gather buffers too);
4. the engine takes back its KV cache, into the memory the actor freed.

Before training the engine sleeps at level 2 (weights dropped, not copied to the host: the next sync rewrites all
of them) and the actor loads its state back; under LoRA at level 1 (weights kept on the host), so that each sync
after the first sends only the adapted linears. At start-up the engine is started and put to sleep before the actor
builds its model (:meth:`RolloutSchedule.engine_started`): vLLM refuses to start unless ``gpu_memory_utilization``
of the device is free. On a CPU-only machine engine and actor share host memory, so the trainer runs the separate
schedule there (only the sync); the colocated one is the same calls, and tests check their order.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from mm_rl.sync.driver import SyncReport, bucket_bytes_of, sync_weights

if TYPE_CHECKING:
    from mm_rl.config.schema import ActorConfig, GenerateConfig
    from mm_rl.sync.transport import SyncRoute
    from mm_rl.workers.group import WorkerGroup


class RolloutSchedule:
    """The order of the sync and the memory switches around each rollout (see the module docstring)."""

    def __init__(
        self,
        group: WorkerGroup,
        rollouts: Sequence[Any],
        generate: GenerateConfig,
        actor: ActorConfig,
        sleep_level: int = 2,
        route: SyncRoute | None = None,
        reference: WorkerGroup | None = None,
        shared_bundles: Collection[int] | None = None,
    ) -> None:
        self.group, self.rollouts, self.generate, self.actor = group, list(rollouts), generate, actor
        self.reference = reference  # a colocated reference model: its weights leave with the actor's parameters
        self.shared_bundles = shared_bundles  # the bundles (devices) that hold an engine replica; None: all
        self.sleep_level, self.route = sleep_level, route  # route: device to device (else the object store)
        self.offloaded_bytes = 0  # what the actor (and reference) ranks freed on their devices for the last rollout
        self.engines_current = False  # every replica holds the actor's weights as they are now
        self.engines_synced = False  # every replica holds weights of a sync (their frozen part is current)

    def weights_changed(self) -> None:
        """The actor's weights moved (an optimizer step, a checkpoint load): the next rollout syncs them."""
        self.engines_current = False

    @property
    def offload_switches(self) -> dict[str, bool]:
        return {
            "params": self.actor.offload_train_param,
            "grads": self.actor.offload_train_grad,
            "optimizer": self.actor.offload_train_optimizer,
        }

    def engine_started(self) -> None:
        """Colocated: the freshly started engine replicas sleep before the actor's model takes the devices."""
        if self.generate.colocate:
            self._engines("sleep", self.sleep_level)

    def _engines(self, method: str, *args: Any) -> None:
        """``method`` on every engine replica at once."""
        import ray

        ray.get([getattr(rollout, method).remote(*args) for rollout in self.rollouts])

    def before_rollout(self) -> SyncReport:
        """Colocated: offload what the sync does not read, engine weights back, sync, offload the parameters, engine
        KV cache back (see the module docstring). Separate: only the sync, and none when the replicas already hold
        the actor's weights (validation synced them, and no update came since; a level-2 sleep drops them)."""
        if self.engines_current and not self.generate.colocate:
            return SyncReport()
        switches, freed, shared = self.offload_switches, 0, self.shared_bundles
        if self.generate.colocate:
            freed += self.group.offload(
                params=False, grads=switches["grads"], optimizer=switches["optimizer"], bundles=shared
            )
            if self.reference is not None and switches["params"]:
                freed += self.reference.offload(params=True, grads=False, optimizer=False, bundles=shared)
            self._engines("wake_up", ["weights"])
        report = sync_weights(
            self.group,
            self.rollouts,
            bucket_bytes_of(self.generate),
            route=self.route,
            trained_only=self.engines_synced,
        )
        self.engines_current = self.engines_synced = True
        if self.generate.colocate:
            freed += self.group.offload(params=switches["params"], grads=False, optimizer=False, bundles=shared)
            self.offloaded_bytes = freed
            self._engines("wake_up", ["kv_cache"])
        return report

    def before_training(self) -> None:
        """Put the engine to sleep and bring the actor's offloaded state back (colocated; else nothing)."""
        if not self.generate.colocate:
            return
        self._engines("sleep", self.sleep_level)
        self.engines_current = self.engines_current and self.sleep_level < 2  # level 1 keeps them on the host
        self.engines_synced = self.engines_synced and self.sleep_level < 2
        self.group.onload(**self.offload_switches, bundles=self.shared_bundles)
        if self.reference is not None and self.actor.offload_train_param:
            self.reference.onload(params=True, grads=False, optimizer=False, bundles=self.shared_bundles)
