"""How weight-sync buckets travel from an actor stage's sender to every rollout engine replica's loading processes.

A sender (the stage's TP-rank 0, in its Megatron worker process) makes a :class:`BucketSink` from a picklable
factory called with its pipeline stage, ``send``s buckets of HF-named tensors in order, and ``close``s it. Two
sinks, one contract:

* :class:`ObjectStoreSink`: each bucket goes into Ray's object store once (shared memory on the node; tensors
  travel as raw byte buffers, see :class:`SharedBucket`, so an engine maps them without a copy) and every
  replica's ``update_weights`` loads it. Works anywhere Ray does; the default on CPU.
* :class:`DeviceSink`, on accelerators: a bucket is packed into one flat byte buffer on the sender's device, and
  the stage's :class:`SyncRoute` says how each replica gets it. A replica on the sender's own device (colocated)
  maps that buffer through an IPC handle (torch's CUDA / torch_npu's NPU multiprocessing reductions) and copies
  out of it: no copy, nothing through the host. The others share a process group with the sender (nccl on CUDA,
  hccl on Ascend, gloo on CPU; :func:`join_group`; the sender is rank 0, then one rank per loading process: a
  vLLM engine's TP workers, each on its own device) and the buffer is broadcast once into a buffer on each of
  their devices. NCCL and HCCL refuse two ranks of a group on one device, which is why the same-device replica
  is not in the group. The Ray calls that trigger the receives carry one :class:`DeviceBucket`: names, dtypes,
  shapes and offsets (and the IPC handle).

Both keep at most ``max_in_flight`` buckets waiting for the engines, so they load bucket i while the sender
builds bucket i + 1 and memory stays bounded by the bucket size.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from mm_rl.platform.transfer import TensorLayout, dtype_name, pack_bucket, unpack_bucket
from mm_rl.sync.buckets import Bucket

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DeviceBucket:
    """The message announcing one bucket of a device sync to a replica's loading processes: what the bucket holds
    (``layout``, ``nbytes`` of flat buffer) and how it arrives, by ``stage``'s broadcast in group ``key`` or, for
    a process on the sender's device, mapped through the IPC ``handle`` of the sender's buffer."""

    key: str
    stage: int
    layout: list[TensorLayout]
    nbytes: int
    handle: bytes | None = None


@dataclass
class SinkResult:
    """What a transport reports when closed: tensors every engine replica applied (the fewest any replica did) and
    where the sender waited."""

    applied: int = 0
    put_s: float = 0.0  # handing buckets to the transport (a copy into shared memory, or pack + broadcast)
    wait_s: float = 0.0  # blocked on the engine (loading earlier buckets)


class BucketSink(Protocol):
    """The transport seam: takes buckets of HF-named tensors in order, then reports when closed."""

    def send(self, bucket: Bucket) -> None: ...

    def close(self) -> SinkResult: ...


class _Pipelined:
    """The bounded queue of engine calls both sinks share: one call per replica and bucket."""

    def __init__(self, rollouts: Sequence[Any], max_in_flight: int) -> None:
        if not rollouts:
            raise ValueError("a weight-sync sink needs at least one rollout engine")
        self.rollouts = list(rollouts)
        self.max_in_flight = max(1, max_in_flight)
        self.pending: collections.deque[list[Any]] = collections.deque()
        self.applied = [0] * len(self.rollouts)
        self.result = SinkResult()

    def _submitted(self, refs: list[Any]) -> None:
        self.pending.append(refs)
        self._drain(self.max_in_flight)

    def _drain(self, keep: int) -> None:
        import ray

        start = time.perf_counter()
        while len(self.pending) > keep:
            for replica, count in enumerate(ray.get(self.pending.popleft())):
                self.applied[replica] += int(count)
        self.result.applied = min(self.applied)
        self.result.wait_s += time.perf_counter() - start

    def close(self) -> SinkResult:
        self._drain(0)
        return self.result


# ------------------------------------------------------------------------------------------ object store
def _unpack_bucket(names: list[str], arrays: list[Any], meta: list[tuple[str, tuple[int, ...]]]) -> Bucket:
    """Receiver side of :class:`SharedBucket`: tensors viewing the received byte buffers (no copy)."""
    import torch

    out = []
    with warnings.catch_warnings():  # object-store buffers are read-only; the engine only reads them
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for name, array, (dtype, shape) in zip(names, arrays, meta, strict=True):
            out.append((name, torch.from_numpy(array).view(getattr(torch, dtype)).view(shape)))
    return out


class SharedBucket:
    """A bucket that pickles each tensor as a raw uint8 numpy buffer and unpickles as a plain list of tensors.

    torch pickles a tensor's storage in-band (a copy into the pickle and another out of it); a numpy array goes
    out of band under pickle protocol 5, which Ray writes straight into its shared-memory object store and hands
    to the reader as a view. Raw bytes also carry dtypes numpy lacks (bf16). The array is made through DLPack, not
    ``Tensor.numpy()``: the latter marks the storage (on CPU often a live parameter's) as never resizable again,
    which would make the colocated offload fail on the next rollout."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        import numpy
        import torch

        names, arrays, meta = [], [], []
        for name, tensor in self.bucket:
            flat = tensor.detach().cpu().contiguous()
            names.append(name)
            arrays.append(numpy.from_dlpack(flat.reshape(-1).view(torch.uint8)))
            meta.append((dtype_name(flat), tuple(flat.shape)))
        return _unpack_bucket, (names, arrays, meta)


class ObjectStoreSink(_Pipelined):
    """Buckets through Ray's object store (one copy) into every ``RolloutWorker`` actor's ``update_weights``."""

    def __init__(self, rollouts: Sequence[Any], stage: int, max_in_flight: int = 1) -> None:
        super().__init__(rollouts, max_in_flight)
        self.stage = stage

    def send(self, bucket: Bucket) -> None:
        import ray

        start = time.perf_counter()
        ref = ray.put(SharedBucket(bucket))
        self.result.put_s += time.perf_counter() - start
        self._submitted([rollout.update_weights.remote(ref) for rollout in self.rollouts])


# ---------------------------------------------------------------------------------------------- device
@dataclass(frozen=True)
class StageRoute:
    """How one stage's buckets reach every loading process of every engine replica (a vLLM engine: one per TP
    worker): its rank in the stage's process group (the sender is rank 0), or None for a process on the sender's
    own device, which maps the sender's buffer in place through an IPC handle instead."""

    ranks: tuple[tuple[int | None, ...], ...]  # per replica, per loading process

    @property
    def world(self) -> int:
        return 1 + sum(rank is not None for replica in self.ranks for rank in replica)

    def maps(self, replica: int) -> bool:
        return None in self.ranks[replica]

    def joins(self, replica: int) -> bool:
        return any(rank is not None for rank in self.ranks[replica])


@dataclass(frozen=True)
class SyncRoute:
    """A device sync's routes by stage (``mm_rl.sync.driver.join_device_sync``); ``key`` names its groups."""

    key: str
    stages: dict[int, StageRoute]


@dataclass
class SyncGroup:
    """A stage's weight-sync process group: rank 0 is the actor stage's sender, the others the engines' ranks."""

    group: Any  # a torch.distributed backend (ProcessGroupGloo / NCCL / HCCL) outside the default world
    device: torch.device


_GROUPS: dict[str, SyncGroup] = {}  # this process's sync groups, by group_name


def group_name(key: str, stage: int) -> str:
    return f"{key}/stage{stage}"


def _group_backend(store: Any, rank: int, world: int, timeout: timedelta) -> Any:
    """The device collective of ``world`` ranks on this process's device kind, built on ``store`` (no default
    group: the actor ranks already have theirs, and the engines' workers have vLLM's)."""
    import torch.distributed as dist

    from mm_rl.platform.device import device_kind

    kind = device_kind()
    if kind == "cpu":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    if kind == "cuda":
        cls = dist.ProcessGroupNCCL
    else:
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL as cls  # type: ignore[import-not-found]
    options = cls.Options()
    options._timeout = timeout
    return cls(store, rank, world, options)


def join_group(key: str, stage: int, host: str, port: int, rank: int, world: int, timeout_s: float = 600.0) -> None:
    """Join (or rejoin) the sync group of ``stage`` (``world`` = 1 + the engines' ranks): rank 0 hosts the
    rendezvous store at ``host:port``; all block until every rank arrived (up to ``timeout_s``)."""
    import torch.distributed as dist

    from mm_rl.platform.device import current_device

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size=world, is_master=rank == 0, timeout=timeout)
    _GROUPS[group_name(key, stage)] = SyncGroup(_group_backend(store, rank, world, timeout), current_device())


def _sync_group(key: str, stage: int) -> SyncGroup:
    try:
        return _GROUPS[group_name(key, stage)]
    except KeyError:
        raise RuntimeError(
            f"no weight-sync group {group_name(key, stage)!r} in this process: "
            "join_device_sync() must run before a device sync"
        ) from None


def receive_bucket(bucket: DeviceBucket) -> Bucket:
    """Engine side of a :class:`DeviceSink` bucket, in one loading process: received from the broadcast when this
    process is in the stage's group, else mapped from the sender's buffer (``handle``, same device). The caller
    loads it and waits for the device before returning (the sender reuses its buffer afterwards)."""
    import torch

    from mm_rl.platform.device import import_ipc

    group = _GROUPS.get(group_name(bucket.key, bucket.stage))
    if group is None:
        if bucket.handle is None:
            _sync_group(bucket.key, bucket.stage)  # raises: this process neither joined the group nor got the buffer
        return unpack_bucket(bucket.layout, import_ipc(bucket.handle))  # type: ignore[arg-type]
    flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
    group.group.broadcast(flat, 0).wait()
    return unpack_bucket(bucket.layout, flat)


class DeviceSink(_Pipelined):
    """Buckets packed into a device buffer on the sender and delivered per the stage's :class:`StageRoute`: one
    broadcast to the processes in its group (every replica's ``receive_weights`` posted first, so the broadcast has
    its receivers) and, to the processes on the sender's device, an IPC handle of the same buffer (they copy straight
    out of it). Where the device cannot share memory between processes (an NPU whose torch_npu lacks it), a
    single-process replica on the sender's device gets the bucket through the object store instead.

    The buffers are reused: ``max_in_flight + 1`` of them in turn, so a buffer is packed again only after the
    engines finished the bucket it held (at most ``max_in_flight`` buckets are unfinished after each send)."""

    def __init__(self, rollouts: Sequence[Any], route: SyncRoute, stage: int, max_in_flight: int = 1) -> None:
        from mm_rl.platform.device import current_device, ipc_supported

        super().__init__(rollouts, max_in_flight)
        self.key, self.stage, self.route = route.key, stage, route.stages[stage]
        self.sync_group = _sync_group(route.key, stage) if self.route.world > 1 else None
        self.device = self.sync_group.device if self.sync_group else current_device()
        self.shared = ipc_supported(self.device)
        for replica in range(len(self.rollouts)):
            if self.route.maps(replica) and self.route.joins(replica) and not self.shared:
                raise RuntimeError(
                    f"engine replica {replica} has a TP worker on the {self.device} of stage {stage}'s "
                    "sender, which cannot share memory with it (torch_npu without storage sharing): "
                    "give the engines devices of their own (generate_config.colocate: false)"
                )
        self.buffers: list[torch.Tensor | None] = [None] * (self.max_in_flight + 1)
        self.sent = 0

    def _buffer(self, nbytes: int) -> torch.Tensor:
        import torch

        slot = self.sent % len(self.buffers)
        self.sent += 1
        held = self.buffers[slot]
        if held is None or held.numel() < nbytes:
            held = self.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return held

    def send(self, bucket: Bucket) -> None:
        import ray

        from mm_rl.platform.device import export_ipc, synchronize

        start = time.perf_counter()
        layout, flat = pack_bucket(bucket, self.device, self._buffer)
        synchronize(self.device)  # packed before another process reads it (no stream order across processes)
        mapped = [replica for replica in range(len(self.rollouts)) if self.route.maps(replica)]
        handle = export_ipc(flat) if mapped and self.shared else None
        stored = ray.put(SharedBucket(bucket)) if mapped and not self.shared else None
        message = DeviceBucket(self.key, self.stage, layout, flat.numel())
        mapping = dataclasses.replace(message, handle=handle)
        refs = [
            rollout.update_weights.remote(stored)
            if stored is not None and self.route.maps(replica)
            else rollout.receive_weights.remote(mapping if self.route.maps(replica) else message)
            for replica, rollout in enumerate(self.rollouts)
        ]
        if self.sync_group is not None:
            self.sync_group.group.broadcast(flat, 0).wait()
            synchronize(self.device)  # sent before the buffer is packed again
        self.result.put_s += time.perf_counter() - start
        self._submitted(refs)

    def close(self) -> SinkResult:
        from mm_rl.platform.device import release_ipc

        result = super().close()  # every engine is done with every buffer
        self.buffers.clear()
        release_ipc(self.device)
        return result
