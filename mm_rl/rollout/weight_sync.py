"""Weight sync: the Megatron actor's weights (TP x PP ranks) into the running rollout engine, in bounded buckets.

Per pipeline stage (all stages at once, each independently):

1. gather: every TP rank sends its shard of a tensor to the stage's TP-rank 0 (``torch.distributed.gather`` over
   the TP group; replicated tensors such as norms are taken from rank 0 without communication). Only DP replica 0
   takes part: the other replicas hold the same weights.
2. merge + rename: ``mm_rl.convert.mapping.hf_from_shards`` turns the gathered shards into the HF tensors
   (fused qkv / gate-up split back, TP pieces joined) and the mapping's table gives their HF names; the tied
   output-layer copy is skipped (HF has one embedding and no ``lm_head`` when tied). Vocab padding rows are cut
   first. No naming or layout rule lives here; the mapping module is the one table.
3. bucket: ``bucket_by_group`` packs whole layers into buckets of about ``sync_bucket_mb`` (a layer is never
   split, because vLLM fuses q/k/v and gate/up per layer). Tensors are produced lazily, one at a time, so a
   sender holds one bucket plus one tensor, never its whole stage.
4. transport: a :class:`~mm_rl.rollout.transport.BucketSink` made on the sender by a picklable factory (see
   :mod:`mm_rl.rollout.transport`): Ray's object store (shared memory), or a device collective (nccl / hccl, gloo
   on CPU) between the sender and the engine's worker, joined once by :func:`join_collective`. Either way the
   rollout worker loads each bucket in place (vLLM ``reload_weights``, then encoder and prefix caches reset), at
   most ``max_in_flight`` buckets wait for the engine, and memory stays bounded by the bucket size, not the model:
   per sender about ``(max_in_flight + 1) x (sync_bucket_mb + one layer)`` (a bucket is cut only between layers,
   so it may exceed the size by up to one layer). No disk round trip.

Colocated mode (:class:`RolloutSchedule`): before a rollout the engine takes back the memory of its weights, the
weights are synced, the actor offloads what ``offload_train_param / grad / optimizer`` name
(:mod:`mm_rl.workers.offload`; with ``offload_train_param`` a colocated reference model's weights go too), and only
then the engine takes back its KV cache, into the memory the actor freed. Before training the engine sleeps at
level 2 (weights dropped, not copied to the host: the next sync rewrites all of them) and the actor loads its
state back. On a CPU-only machine engine and actor share host memory, so the
trainer runs the separate schedule there; the colocated one is the same calls, and tests check their order.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mm_rl.rollout.base import bucket_by_group, tensor_bytes
from mm_rl.rollout.transport import BucketSink, CollectiveSink, NamedTensor, ObjectStoreSink

if TYPE_CHECKING:
    import torch

    from mm_rl.config.schema import ActorConfig, GenerateConfig, ModelConfig
    from mm_rl.convert.mapping import Bound
    from mm_rl.convert.stages import Pipeline
    from mm_rl.workers.group import WorkerGroup


# ------------------------------------------------------------------------------------------------- stats
@dataclass
class SyncStats:
    """One stage's sender: what it sent and where the time went (seconds, wall clock on the sender)."""

    pp_rank: int
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    max_bucket_bytes: int = 0
    applied: int = 0
    gather_s: float = 0.0  # TP gathers (includes waiting for the other TP ranks)
    merge_s: float = 0.0  # TP merge, HF renaming and bucketing
    put_s: float = 0.0
    wait_s: float = 0.0
    total_s: float = 0.0
    names: list[str] = field(default_factory=list)  # HF names sent, in order


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


# ------------------------------------------------------------------------------------------ sender side
def stage_pipeline(model: ModelConfig, tp: int, pp: int) -> Pipeline:
    """The converter's stage plan for this TP / PP layout (model.json's pipeline split)."""
    from mm_rl.config.schema import ParallelConfig
    from mm_rl.convert.stages import plan_pipeline

    text, vit = model.text_decoder, model.image_encoder.vision_encoder
    llm = list(text.pipeline_num_layers) if pp > 1 else [text.num_layers]
    vision = list(vit.pipeline_num_layers) if pp > 1 else [vit.num_layers]
    return plan_pipeline(model, ParallelConfig(tp_size=tp, llm_pp_layers=llm, vit_pp_layers=vision))


def gather_shards(tensor: torch.Tensor, split: bool, group: Any) -> list[torch.Tensor] | None:
    """Every TP rank's shard on TP-rank 0 (rank order), None on the others; a replicated tensor is not sent."""
    import torch

    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    if size == 1 or not split:
        return [tensor] if rank == 0 else None
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)] if rank == 0 else None
    torch.distributed.gather(tensor, parts, group=group, group_dst=0)
    return parts


def strip_vocab_padding(bound: Bound, shards: list[torch.Tensor], model: ModelConfig) -> list[torch.Tensor]:
    """Shards of the real vocabulary rows: Megatron pads the vocab to a multiple of ``divisible_by x TP`` (the
    padding is at the end of the last shard); the mapping expects vocab / TP rows per shard."""
    import torch

    from mm_rl.convert.mapping import hf_shape, model_dims

    if bound.entry.scope not in ("embedding", "output_layer"):
        return shards
    vocab = hf_shape(bound.entry, 0, model_dims(model))[0]
    if sum(s.shape[0] for s in shards) == vocab:
        return shards
    return list(torch.cat(shards)[:vocab].chunk(len(shards)))


class _Clock:
    """Seconds spent in the TP gathers, accumulated while the lazy tensor stream is consumed."""

    def __init__(self) -> None:
        self.gather_s = 0.0


def stage_hf_tensors(model: Any, model_cfg: ModelConfig, pipeline: Pipeline, clock: _Clock) -> \
        Iterator[NamedTensor]:
    """(HF name, tensor) of this rank's stage, TP shards merged, in the mapping's order (layer by layer).

    Every TP rank of the stage must run it to the end (the gathers are collective); only TP-rank 0 gets items.
    The mapping's ``hf_from_shards`` goes from the gathered shards straight to the HF tensors (views where the HF
    tensor is one block of a shard, one concatenation otherwise): the same rules as ``merge_tp_shards`` followed
    by ``megatron_to_hf``, without building the TP-merged Megatron tensor in between (measured: that round
    allocated and copied every split tensor twice more). The tied output-layer copy is not even gathered: HF
    has one embedding, which the embedding's stage sends."""
    import torch
    from megatron.core import parallel_state

    from mm_rl.convert.mapping import hf_from_shards, model_dims, stage_tensors

    group = parallel_state.get_tensor_model_parallel_group()
    dims, state = model_dims(model_cfg), model.state_dict()
    for bound in stage_tensors(model_cfg, pipeline.stages[parallel_state.get_pipeline_model_parallel_rank()]):
        if bound.entry.duplicate:
            continue
        start = time.perf_counter()
        with torch.no_grad():
            shards = gather_shards(state[bound.mg].detach(), bound.entry.split is not None, group)
        clock.gather_s += time.perf_counter() - start
        if shards is not None:
            parts = hf_from_shards(bound, dims, strip_vocab_padding(bound, shards, model_cfg))
            yield from zip(bound.hf, parts, strict=True)


def push_stage(model: Any, model_cfg: ModelConfig, tp: int, sink_factory: Callable[[int], BucketSink] | None,
               bucket_bytes: int) -> SyncStats | None:
    """Run this rank's part of the sync: TP ranks gather; the sender (``sink_factory`` given) merges, renames,
    buckets and sends, then closes the sink and returns its statistics."""
    from megatron.core import parallel_state

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pipeline = stage_pipeline(model_cfg, tp, parallel_state.get_pipeline_model_parallel_world_size())
    clock, started = _Clock(), time.perf_counter()
    named = stage_hf_tensors(model, model_cfg, pipeline, clock)
    if sink_factory is None:
        for _ in named:  # a non-sender TP rank: only its part of each gather
            pass
        return None
    sink = sink_factory(pp_rank)
    stats, produced, mark = SyncStats(pp_rank), 0.0, time.perf_counter()
    for bucket in bucket_by_group(named, bucket_bytes):
        produced += time.perf_counter() - mark
        size = sum(tensor_bytes(t) for _, t in bucket)
        stats.tensors, stats.bytes, stats.buckets = stats.tensors + len(bucket), stats.bytes + size, stats.buckets + 1
        stats.max_bucket_bytes = max(stats.max_bucket_bytes, size)
        stats.names += [name for name, _ in bucket]
        sink.send(bucket)
        mark = time.perf_counter()
    produced += time.perf_counter() - mark
    result = sink.close()
    stats.applied, stats.put_s, stats.wait_s = result.applied, result.put_s, result.wait_s
    stats.gather_s, stats.merge_s = clock.gather_s, produced - clock.gather_s
    stats.total_s = time.perf_counter() - started
    return stats


# ------------------------------------------------------------------------------------------ driver side
def bucket_bytes_of(generate: GenerateConfig) -> int:
    """``generate_config.sync_bucket_mb`` in bytes."""
    return int(generate.sync_bucket_mb) << 20


def join_collective(group: WorkerGroup, rollout: Any) -> str:
    """Pair every stage's sender with the rollout worker in a two-rank device process group (nccl / hccl, gloo on
    CPU); returns the key that :func:`sync_weights` takes to send over them. Each sender hosts its pair's
    rendezvous on a port free on its own node; the rollout worker joins the pairs one after another while the
    senders wait in theirs."""
    import uuid

    import ray

    key = f"weights-{uuid.uuid4().hex[:8]}"
    addresses = group.run("rendezvous_address")
    senders = {c.pp_rank: addresses[i] for i, c in enumerate(group.coords) if c.is_sender()}
    joined = [rollout.join_sync_group.remote(key, stage, host, port) for stage, (host, port) in senders.items()]
    group.run("join_sync_group", key, senders)
    ray.get(joined)
    return key


def sync_weights(group: WorkerGroup, rollout: Any, bucket_bytes: int, max_in_flight: int = 1,
                 collective: str | None = None) -> SyncReport:
    """Push the actor group's current weights into the rollout worker actor ``rollout`` (all stages at once),
    through the object store, or over the pair groups of ``collective`` (a :func:`join_collective` key).

    Raises when the engine applied fewer tensors than were sent (a layer it held back: a mapping / checkpoint
    mismatch that would otherwise leave stale weights in the engine)."""
    start = time.perf_counter()
    if collective is None:
        factory = functools.partial(ObjectStoreSink, rollout, max_in_flight=max_in_flight)
    else:
        factory = functools.partial(CollectiveSink, rollout, collective, max_in_flight=max_in_flight)
    stats = [s for s in group.run("push_weights", factory, bucket_bytes) if s is not None]
    report = SyncReport(sorted(stats, key=lambda s: s.pp_rank), time.perf_counter() - start)
    if report.applied != report.tensors:
        raise RuntimeError(f"weight sync: the engine applied {report.applied} of {report.tensors} tensors sent "
                           "(an incomplete layer was held back: do the engine's checkpoint and model.json agree?)")
    return report


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

    def before_rollout(self) -> SyncReport:
        """Colocated: engine weights' memory back, sync, actor offload, engine KV cache back. Else only the sync."""
        import ray

        if self.generate.colocate:
            ray.get(self.rollout.wake_up.remote(["weights"]))
            self.events.append("engine.wake_up(weights)")
        report = sync_weights(self.group, self.rollout, bucket_bytes_of(self.generate), collective=self.collective)
        self.events.append("sync")
        if self.generate.colocate:
            freed = self.group.run("offload", **self.offload_switches)
            self.events.append("actor.offload")
            if self.reference is not None and self.actor.offload_train_param:
                freed += self.reference.run("offload", params=True, grads=False, optimizer=False)
                self.events.append("reference.offload")
            self.offloaded_bytes = sum(sum(rank.values()) for rank in freed)
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
        self.group.run("onload", **self.offload_switches)
        self.events.append("actor.onload")
        if self.reference is not None and self.actor.offload_train_param:
            self.reference.run("onload", params=True, grads=False, optimizer=False)
            self.events.append("reference.onload")

