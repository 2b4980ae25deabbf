"""The driver side of the weight sync: join the transports once, start a sync on every rank, check its report.

The ranks' half (TP gather, merge, HF names, buckets, send) is :mod:`mm_rl.sync.sender`; the transports are
:mod:`mm_rl.sync.transport`. The driver never holds a tensor: it hands each stage's sender a picklable sink
factory and collects the senders' statistics.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar

from mm_rl.sync.transport import DeviceSink, ObjectStoreSink, StageRoute, SyncRoute

if TYPE_CHECKING:
    from mm_rl.config.schema import GenerateConfig
    from mm_rl.sync.sender import SyncStats
    from mm_rl.sync.transport import BucketSink

P = ParamSpec("P")
R = TypeVar("R")


class RankSender(Protocol):
    """The weight sync's calls on every Megatron rank (``mm_rl.workers.megatron_worker.MegatronWorker`` implements
    them); the driver names them as ``RankSender.method``, so a rename on either side is a static error."""

    def device_identity(self) -> str | None: ...

    def rendezvous_address(self) -> tuple[str, int]: ...

    def join_sync_group(self, key: str, senders: dict[int, tuple[str, int]], worlds: dict[int, int]) -> None: ...

    def push_weights(
        self,
        sink_factory: Callable[[int], BucketSink],
        bucket_bytes: int,
        stage: int | None = None,
        trained_only: bool = False,
    ) -> SyncStats | None: ...


class SenderGroup(Protocol):
    """What the sync needs of a group of Megatron ranks (``mm_rl.workers.group.WorkerGroup`` is one): their grid
    coordinates and a call of a rank method on every rank at once."""

    coords: Sequence[Any]

    def run(self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]: ...


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


def plan_route(key: str, senders: dict[int, str | None], replicas: Sequence[Sequence[str | None]]) -> SyncRoute:
    """Per stage, which loading processes map the sender's buffer in place and which receive its broadcast.

    ``senders``: each stage's sender device (:func:`mm_rl.platform.device.device_identity`); ``replicas``: the
    devices of each replica's loading processes (a vLLM engine's TP workers). A process on the sender's device
    reads the sender's buffer through an IPC handle (NCCL and HCCL refuse two ranks of a group on one device, and
    a copy to the same device would be wasted); every other one takes a rank in the stage's process group. CPU
    has no identity: everything there goes over the group."""
    stages = {}
    for stage, sender in senders.items():
        owners: dict[str, int] = {}
        ranks, rank = [], 1
        for replica, identities in enumerate(replicas):
            row: list[int | None] = []
            for identity in identities:
                if sender is not None and identity == sender:
                    row.append(None)
                    continue
                if identity is not None and identity in owners:
                    raise ValueError(
                        f"two engine processes on device {identity} (replicas {owners[identity]} and "
                        f"{replica}) in stage {stage}'s weight-sync group: nccl / hccl refuse that"
                    )
                if identity is not None:
                    owners[identity] = replica
                row.append(rank)
                rank += 1
            ranks.append(tuple(row))
        stages[stage] = StageRoute(tuple(ranks))
    return SyncRoute(key, stages)


def join_device_sync(group: SenderGroup, rollouts: Sequence[Any]) -> SyncRoute:
    """Set up device-to-device syncs from every stage's sender to the rollout replicas along the route their
    devices give (:func:`plan_route`); returns the route :func:`sync_weights` takes."""
    import uuid

    import ray

    devices = ray.get([rollout.device_identities.remote() for rollout in rollouts])
    identities = group.run(RankSender.device_identity)
    senders = {c.pp_rank: identities[i] for i, c in enumerate(group.coords) if c.is_sender()}
    return join_route(group, rollouts, plan_route(f"weights-{uuid.uuid4().hex[:8]}", senders, devices))


def join_route(group: SenderGroup, rollouts: Sequence[Any], route: SyncRoute) -> SyncRoute:
    """Form the stages' process groups of ``route``: each sender hosts its group's rendezvous on a port free on
    its own node; a replica joins the stages' groups one after another while the senders wait in theirs."""
    import ray

    addresses = group.run(RankSender.rendezvous_address)
    senders = {c.pp_rank: addresses[i] for i, c in enumerate(group.coords) if c.is_sender()}
    joined = [
        rollout.join_sync_group.remote(
            route.key, stage, *senders[stage], list(stage_route.ranks[replica]), stage_route.world
        )
        for replica, rollout in enumerate(rollouts)
        for stage, stage_route in route.stages.items()
        if stage_route.joins(replica)
    ]
    group.run(RankSender.join_sync_group, route.key, senders, {stage: r.world for stage, r in route.stages.items()})
    ray.get(joined)
    return route


def push_order(group: SenderGroup, rollouts: Sequence[Any], route: SyncRoute | None) -> list[int | None]:
    """The pushes of one sync: every stage at once ([None]), or, device to device with two or more engine
    replicas and pipeline stages, one stage after another. A replica's actor takes one call at a time, in the order
    the calls arrive, and each stage's sender posts its bucket's receive on every replica and then broadcasts: were
    the stages to push together, replica A could take stage 0's bucket while replica B took stage 1's, each then
    waiting in a broadcast that needs the other (a deadlock). Stage by stage, every replica receives in one order."""
    stages = sorted({c.pp_rank for c in group.coords})
    if route is None or len(rollouts) < 2 or len(stages) < 2:
        return [None]
    return list(stages)


def sync_weights(
    group: SenderGroup,
    rollouts: Sequence[Any],
    bucket_bytes: int,
    max_in_flight: int = 1,
    route: SyncRoute | None = None,
    trained_only: bool = False,
) -> SyncReport:
    """Push the actor group's current weights into every rollout worker actor of ``rollouts`` (all stages at
    once), through the object store, or device to device along ``route`` (:func:`join_device_sync`).

    Raises when an engine applied fewer tensors than were sent (a layer it held back: a mapping / checkpoint
    mismatch that would otherwise leave stale weights in the engine). The engines' per-sync set-up happens once,
    around all the stages' buckets (``begin_weight_update`` / ``end_weight_update``). ``trained_only``: every engine
    holds the actor's frozen tensors already (an earlier sync): only what training changes is sent (the rest of each
    engine stays put: a frozen ViT, a LoRA actor's base)."""
    import ray

    start = time.perf_counter()
    rollouts = list(rollouts)
    if route is None:
        factory = functools.partial(ObjectStoreSink, rollouts, max_in_flight=max_in_flight)
    else:
        factory = functools.partial(DeviceSink, rollouts, route, max_in_flight=max_in_flight)
    ray.get([rollout.begin_weight_update.remote() for rollout in rollouts])  # before any bucket arrives
    stats = [
        s for stage in push_order(group, rollouts, route)
        for s in group.run(RankSender.push_weights, factory, bucket_bytes, stage, trained_only) if s is not None
    ]  # fmt: skip
    ray.get([rollout.end_weight_update.remote() for rollout in rollouts])  # after every bucket was loaded
    report = SyncReport(sorted(stats, key=lambda s: s.pp_rank), time.perf_counter() - start)
    if report.applied != report.tensors:
        raise RuntimeError(
            f"weight sync: an engine applied {report.applied} of {report.tensors} tensors sent "
            "(an incomplete layer was held back: do the engine's checkpoint and model.json agree?)"
        )
    return report
