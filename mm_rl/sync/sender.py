"""The sender side of the weight sync: runs on every Megatron rank of DP replica 0 (CP rank 0), and with expert
parallelism on the first copy of every block of experts.

Per pipeline stage (all stages at once, each independently):

1. gather: every TP rank sends its shard of a tensor to the stage's TP-rank 0 (``torch.distributed.gather`` over
   the TP group; replicated tensors such as norms are taken from rank 0 without communication). Only DP replica 0
   takes part: the other replicas hold the same weights.
   MoE: each expert tensor is all-gathered over the EP group too, so the sender holds every expert.
2. merge + rename: ``mm_rl.convert.mapping.hf_from_shards`` turns the gathered shards into the HF tensors
   (fused qkv / gate-up split back, TP pieces joined) and the mapping's table gives their HF names; the tied
   output-layer copy is skipped (HF has one embedding and no ``lm_head`` when tied). Vocab padding rows are cut
   first. No naming or layout rule lives here; the mapping module is the one table.
3. bucket: :func:`mm_rl.sync.buckets.bucket_by_group` packs whole layers into buckets of about
   ``sync_bucket_mb`` (a layer is never split, because vLLM fuses q/k/v and gate/up per layer). Tensors are
   produced lazily, one at a time, so a sender holds one bucket plus one tensor, never its whole stage.
4. transport: a :class:`~mm_rl.sync.transport.BucketSink` made on the sender by a picklable factory (see
   :mod:`mm_rl.sync.transport`). At most ``max_in_flight`` buckets wait for the engine, so memory stays bounded
   by the bucket size, not the model: per sender about ``(max_in_flight + 1) x (sync_bucket_mb + one layer)``
   (a bucket is cut only between layers, so it may exceed the size by up to one layer). No disk round trip.

The driver's half (joining the transports, starting a sync, its report) is :mod:`mm_rl.sync.driver`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mm_rl.sync.buckets import NamedTensor, bucket_by_group, tensor_bytes

if TYPE_CHECKING:
    import torch

    from mm_rl.config.schema import ModelConfig
    from mm_rl.convert.mapping import Bound
    from mm_rl.convert.stages import Pipeline
    from mm_rl.sync.transport import BucketSink


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


# ------------------------------------------------------------------------------------------ sender side
def stage_pipeline(model: ModelConfig, tp: int, pp: int, ep: int = 1) -> Pipeline:
    """The converter's stage plan for this TP / PP / EP layout (model.json's pipeline split)."""
    from mm_rl.config.schema import ParallelConfig
    from mm_rl.convert.stages import plan_pipeline

    text, vit = model.text_decoder, model.image_encoder.vision_encoder
    llm = list(text.pipeline_num_layers) if pp > 1 else [text.num_layers]
    vision = list(vit.pipeline_num_layers) if pp > 1 else [vit.num_layers]
    return plan_pipeline(model, ParallelConfig(tp_size=tp, ep_size=ep, llm_pp_layers=llm, vit_pp_layers=vision))


def gather_shards(tensor: torch.Tensor, split: bool, group: Any) -> list[torch.Tensor] | None:
    """Every TP rank's shard on TP-rank 0 (rank order), None on the others; a replicated tensor is not sent.

    An all-gather into one flat buffer rather than a gather to rank 0: HCCL has no ``gather`` (torch_npu's
    ``ProcessGroupHCCL``), and nccl / hccl / gloo all have ``all_gather_into_tensor``. The other ranks drop their
    copy at once (one tensor at a time)."""
    import torch

    rank = torch.distributed.get_rank(group)
    if not split:
        return [tensor] if rank == 0 else None
    gathered = all_gather(tensor, group)
    return gathered if rank == 0 else None


def all_gather(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape everywhere), in group-rank order, on every rank: one
    ``all_gather_into_tensor`` into a flat buffer on the tensor's device; the tensor alone in a group of one."""
    import torch

    size = torch.distributed.get_world_size(group)
    if size == 1:
        return [tensor]
    tensor = tensor.contiguous()
    flat = torch.empty(size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    torch.distributed.all_gather_into_tensor(flat, tensor.view(-1), group=group)
    return list(flat.view(size, *tensor.shape).unbind(0))


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


class GatherTimer:
    """Seconds spent in the TP gathers, accumulated while the lazy tensor stream is consumed."""

    def __init__(self) -> None:
        self.gather_s = 0.0


def trained_tensors(model: Any, state: Mapping[str, Any]) -> Callable[[str], bool]:
    """Which of a stage's tensors (``export_state`` keys) an optimizer step can change, by whole module: vLLM
    rebuilds a layer from all of its tensors at once, so a module's weight and bias travel together.

    With LoRA, the adapted linears' merged weights and their biases; else every tensor of a module with a trained
    parameter (the frozen ViT stays out: on Qwen2.5-VL-7B its 0.67B parameters are 8% of the bytes, on the tiny
    model 25 of 81 tensors and 14% of the bytes; vLLM's CPU backend also re-creates a oneDNN matmul handle for every
    linear it reloads). A tensor that is no parameter (a buffer) is always sent."""
    from mm_rl.models.lora import MergedState, is_adapted

    if isinstance(state, MergedState):
        return lambda key: is_adapted(state, key)
    parameters = dict(model.named_parameters())
    modules = {name.rpartition(".")[0] for name, param in parameters.items() if param.requires_grad}
    return lambda key: key not in parameters or key.rpartition(".")[0] in modules


def stage_hf_tensors(
    model: Any, model_cfg: ModelConfig, pipeline: Pipeline, clock: GatherTimer, trained_only: bool = False
) -> Iterator[NamedTensor]:
    """(HF name, tensor) of this rank's stage, TP shards merged, in the mapping's order (layer by layer).

    Every TP rank of the stage must run it to the end (the gathers are collective); only TP-rank 0 gets items.
    The mapping's ``hf_from_shards`` goes from the gathered shards straight to the HF tensors (views where the HF
    tensor is one block of a shard, one concatenation otherwise): the same rules as ``merge_tp_shards`` followed
    by ``megatron_to_hf``, without building the TP-merged Megatron tensor in between (measured: that round
    allocated and copied every split tensor twice more). The tied output-layer copy is not even gathered: HF
    has one embedding, which the embedding's stage sends. ``trained_only``: only what training changes
    (:func:`trained_tensors`), for an engine that holds the rest from an earlier sync."""
    import torch
    from megatron.core import parallel_state

    from mm_rl.convert.mapping import hf_from_shards, model_dims, stage_tensors
    from mm_rl.models.lora import export_state

    group, experts = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_expert_model_parallel_group()
    dims, state = model_dims(model_cfg), export_state(model)  # LoRA: each adapted weight merged as it is read
    stage = pipeline.stages[parallel_state.get_pipeline_model_parallel_rank()]
    # every EP rank names its experts local_experts.0.. (its own bounds); the sender renames each rank's block
    by_rank = [stage_tensors(model_cfg, stage, r, pipeline.ep) for r in range(pipeline.ep)]
    trained = trained_tensors(model, state) if trained_only else None
    for position, bound in enumerate(by_rank[0]):
        if bound.entry.duplicate or (trained is not None and not trained(bound.mg)):
            continue
        start = time.perf_counter()
        with torch.no_grad():
            tensor = state[bound.mg].detach()
            # an expert: every EP rank's local expert of this index, in EP-rank order
            blocks = all_gather(tensor, experts) if bound.entry.expert else [tensor]
            gathered = [gather_shards(block, bound.entry.split is not None, group) for block in blocks]
        clock.gather_s += time.perf_counter() - start
        for r, shards in enumerate(gathered):
            if shards is not None:
                named = by_rank[r][position]
                parts = hf_from_shards(named, dims, strip_vocab_padding(named, shards, model_cfg))
                yield from zip(named.hf, parts, strict=True)


def push_stage(
    model: Any,
    model_cfg: ModelConfig,
    tp: int,
    ep: int,
    sink_factory: Callable[[int], BucketSink] | None,
    bucket_bytes: int,
    trained_only: bool = False,
) -> SyncStats | None:
    """Run this rank's part of the sync: TP ranks gather; the sender (``sink_factory`` given) merges, renames,
    buckets and sends, then closes the sink and returns its statistics (``trained_only``: see
    :func:`stage_hf_tensors`)."""
    from megatron.core import parallel_state

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pipeline = stage_pipeline(model_cfg, tp, parallel_state.get_pipeline_model_parallel_world_size(), ep)
    clock, started = GatherTimer(), time.perf_counter()
    named = stage_hf_tensors(model, model_cfg, pipeline, clock, trained_only)
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
