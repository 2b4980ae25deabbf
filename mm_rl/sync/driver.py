"""The driver side of the weight sync: join the transports once, start a sync on every rank, check its report.

The ranks' half (TP gather, merge, HF names, buckets, send) is :mod:`mm_rl.sync.sender`; the transports are
:mod:`mm_rl.sync.transport`. The driver never holds a tensor: it hands each stage's sender a picklable sink
factory and collects the senders' statistics.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from mm_rl.sync.transport import CollectiveSink, ObjectStoreSink

if TYPE_CHECKING:
    from mm_rl.config.schema import GenerateConfig
    from mm_rl.sync.sender import SyncStats


class SenderGroup(Protocol):
    """What the sync needs of a group of Megatron ranks (``mm_rl.workers.group.WorkerGroup`` is one): their grid
    coordinates and a call of a method on every rank at once."""

    coords: Sequence[Any]

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...


@dataclass
class SyncReport:
    """A whole sync: every stage's sender statistics and the wall time seen by the caller."""

    stages: list[SyncStats] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def tensors(self) -> int:
        return sum(s.tensors for s in self.stages)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.stages)

    @property
    def names(self) -> list[str]:
        return [name for s in self.stages for name in s.names]

    @property
    def applied(self) -> int:
        return sum(s.applied for s in self.stages)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def bucket_bytes_of(generate: GenerateConfig) -> int:
    """``generate_config.sync_bucket_mb`` in bytes."""
    return int(generate.sync_bucket_mb) << 20


def join_collective(group: SenderGroup, rollouts: Sequence[Any]) -> str:
    """Put every stage's sender and the rollout replicas' loading processes in one device process group per stage
    (nccl / hccl, gloo on CPU); returns the key that :func:`sync_weights` takes to send over them. The sender is
    rank 0; then each replica's ``sync_ranks()`` ranks in replica order (a vLLM engine's TP workers, so a TP > 1
    engine receives on every worker's device). Each sender hosts its group's rendezvous on a port free on its own
    node; a replica joins the stages' groups one after another while the senders wait in theirs."""
    import itertools
    import uuid

    import ray

    ranks = ray.get([rollout.sync_ranks.remote() for rollout in rollouts])
    firsts = [1 + before for before in itertools.accumulate([0, *ranks[:-1]])]
    key, world = f"weights-{uuid.uuid4().hex[:8]}", 1 + sum(ranks)
    addresses = group.run("rendezvous_address")
    senders = {c.pp_rank: addresses[i] for i, c in enumerate(group.coords) if c.is_sender()}
    joined = [rollout.join_sync_group.remote(key, stage, host, port, first, world)
              for rollout, first in zip(rollouts, firsts, strict=True) for stage, (host, port) in senders.items()]
    group.run("join_sync_group", key, senders, world)
    ray.get(joined)
    return key


def sync_weights(group: SenderGroup, rollouts: Sequence[Any], bucket_bytes: int, max_in_flight: int = 1,
                 collective: str | None = None) -> SyncReport:
    """Push the actor group's current weights into every rollout worker actor of ``rollouts`` (all stages at
    once), through the object store, or over the sync groups of ``collective`` (a :func:`join_collective` key).

    Raises when an engine applied fewer tensors than were sent (a layer it held back: a mapping / checkpoint
    mismatch that would otherwise leave stale weights in the engine). The engines' per-sync set-up happens once,
    around all the stages' buckets (``begin_weight_update`` / ``end_weight_update``)."""
    import ray

    start = time.perf_counter()
    rollouts = list(rollouts)
    if collective is None:
        factory = functools.partial(ObjectStoreSink, rollouts, max_in_flight=max_in_flight)
    else:
        factory = functools.partial(CollectiveSink, rollouts, collective, max_in_flight=max_in_flight)
    ray.get([rollout.begin_weight_update.remote() for rollout in rollouts])  # before any bucket arrives
    stats = [s for s in group.run("push_weights", factory, bucket_bytes) if s is not None]
    ray.get([rollout.end_weight_update.remote() for rollout in rollouts])  # after every bucket was loaded
    report = SyncReport(sorted(stats, key=lambda s: s.pp_rank), time.perf_counter() - start)
    if report.applied != report.tensors:
        raise RuntimeError(f"weight sync: an engine applied {report.applied} of {report.tensors} tensors sent "
                           "(an incomplete layer was held back: do the engine's checkpoint and model.json agree?)")
    return report
