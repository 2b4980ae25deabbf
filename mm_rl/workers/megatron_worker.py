"""One Megatron rank of the actor (or reference) model, hosted in a Ray actor.

Life cycle (driven by :class:`mm_rl.workers.group.WorkerGroup`, every rank called together)::

    worker = MegatronWorker(spec, rank)                  # light: thread budget and megatron's CPU bridges
    addr, port = rank0.rendezvous_address()              # the caller picks the address / free port
    worker.init_distributed(addr, port)                  # process group + megatron parallel state + RNG seed
    worker.build(mm_dir)                                 # this rank's stage, loaded from its mp_rank file
    worker.set_images(step_images)                       # the step's prompt images, once per step (host memory)
    worker.compute_log_probs(micro_batches)              # forward-only pipeline schedule (every rank runs it)
    worker.push_weights(sink_factory, bucket_bytes)      # weight sync, see mm_rl.sync.sender

Every collective method must be called on every rank of the group at the same time (the pipeline schedule and
the TP gathers block until all ranks arrive); the group does that. Results come back from the ranks that have
them (the last stage for log-probs, each stage's TP-rank 0 for the sync) and ``None`` from the others.

Why a plain class: Ray makes it an actor (``ray.remote(MegatronWorker)``), and tests or a single-process tool
can use it directly. Kept small so the trainer can add the optimizer and the update step beside
``compute_log_probs``.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mm_rl.platform.transfer import StepImages, to_device, to_host
from mm_rl.workers.offload import MemorySwitch

if TYPE_CHECKING:
    import torch

    from mm_rl.config.schema import ActorConfig, ModelConfig, TrainingFlags
    from mm_rl.sync.sender import SyncStats
    from mm_rl.sync.transport import BucketSink

MicroBatch = dict[str, "torch.Tensor"]


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to build its stage: the model, the parallel grid and the thread budget.

    ``tp * cp * pp * dp`` ranks in megatron's default order (TP fastest, then CP, then DP, then PP). Context
    parallelism (Ulysses) needs ``flags`` with ``context-parallel-algo: ulysses_cp_algo``. ``ep`` (MoE) spreads
    each layer's experts over that many consecutive DP x CP ranks (megatron's expert grid).
    ``model.text_decoder.pipeline_num_layers`` / the ViT's give the PP split, as for hf2mg.
    """

    model: ModelConfig
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    actor: ActorConfig | None = None
    flags: TrainingFlags | None = None
    seed: int = 1234
    num_threads: int = 1
    init_timeout_s: float = 300.0
    bf16: bool = False  # bf16 parameters (accelerators); CPU trains in fp32
    remove_padding: bool = True  # pack each micro-batch's rows into one (actor_config.remove_padding)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp


@dataclass(frozen=True)
class RankCoords:
    """Where a rank sits in the grid (from megatron's parallel state after init)."""

    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int = 0
    ep_rank: int = 0  # which block of experts this rank holds (MoE)
    edp_rank: int = 0  # its place among the ranks holding the same experts (the expert-data-parallel group)

    def holds_unique_weights(self) -> bool:
        """The first copy of this rank's weights (saved, synced): DP replica 0 and CP rank 0 without experts; with
        EP the first copy of each block of experts (the EP ranks share DP replica 0's other weights)."""
        return self.edp_rank == 0

    def leads_replica_stage(self) -> bool:
        """TP rank 0 and CP rank 0: the rank of its (replica, stage) that returns results (the others of its TP
        and CP groups hold the same after the model's gathers)."""
        return self.tp_rank == 0 and self.cp_rank == 0

    def is_sender(self) -> bool:
        """The rank that streams its stage's merged weights (the stage's lead of DP replica 0)."""
        return self.leads_replica_stage() and self.dp_rank == 0


class MegatronWorker:
    """One Megatron rank; see the module docstring for the call order."""

    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        from mm_rl.platform.device import setup_process

        os.environ["OMP_NUM_THREADS"] = str(spec.num_threads)
        setup_process(num_threads=spec.num_threads)
        self.spec, self.rank = spec, rank
        self.model: Any = None
        self.base_iteration: Path | None = None
        self.coords: RankCoords | None = None
        self.images: StepImages = {}
        self._memory = MemorySwitch()

    # ------------------------------------------------------------------------------------ set-up
    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a TCP port free a moment ago, for a rendezvous this rank hosts (rank 0's for the
        group, a sender's for its weight-sync group)."""
        import ray

        address = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            return address, int(sock.getsockname()[1])

    def init_distributed(self, master_addr: str, master_port: int) -> RankCoords:
        """Join the process group and initialise megatron's parallel state (all ranks at once)."""
        import torch
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from mm_rl.models.registry import family_of
        from mm_rl.platform.device import dist_backend

        spec = self.spec
        torch.distributed.init_process_group(
            dist_backend(),
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.init_timeout_s),
        )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=spec.tp,
            pipeline_model_parallel_size=spec.pp,
            context_parallel_size=spec.cp,
            expert_model_parallel_size=spec.ep,
            get_embedding_ranks=family_of(spec.model).embedding_ranks(spec.model),
            # megatron's gloo copies of its data-parallel groups serve only its dp-zero optimizer-state gather,
            # which the checkpoint does not use (each rank writes its own shard): no idle gloo loops for them
            create_gloo_process_groups=False,
        )
        model_parallel_cuda_manual_seed(spec.seed)
        self.coords = RankCoords(
            self.rank,
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_context_parallel_rank(),
            parallel_state.get_expert_model_parallel_rank(),
            parallel_state.get_expert_data_parallel_rank(),
        )
        return self.coords

    def build(self, mm_dir: str | Path | None = None, iteration: int | str | None = None) -> None:
        """Build this rank's stage; load its mp_rank file from ``mm_dir`` (latest iteration unless given)."""
        import torch

        from mm_rl.models.lora import load_stage
        from mm_rl.models.registry import family_of
        from mm_rl.platform.device import current_device

        dtype = torch.bfloat16 if self.spec.bf16 else torch.float32
        self.model = family_of(self.spec.model).build_model(
            self.spec.model,
            self.spec.flags,
            self.spec.actor,
            params_dtype=dtype,
            remove_padding=self.spec.remove_padding,
        )
        # megatron's layers create their weights on the current device, plain torch modules (the ViT's patch
        # embedding, the norms) on the CPU: the whole stage goes to this rank's device (megatron-LM's get_model
        # does the same with .cuda()). The same Parameter objects stay, with megatron's attributes.
        self.model.to(current_device())
        if mm_dir is not None:
            # mapped, not read whole: each tensor's pages are read as load_state_dict copies it in, so a rank
            # holds its model once, not twice (file contents + parameters)
            path = self._rank_file(Path(mm_dir), iteration)
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["model"]
            load_stage(self.model, state)
            self.base_iteration = path.parent.parent.resolve()  # a LoRA checkpoint names the base it adapts

    def _rank_file(self, mm_dir: Path, iteration: int | str | None) -> Path:
        from mm_rl.convert.layout import rank_file, resolve_iteration

        coords = self._require_coords()
        return rank_file(
            resolve_iteration(mm_dir, iteration),
            coords.tp_rank,
            coords.pp_rank,
            self.spec.pp,
            coords.ep_rank,
            self.spec.ep,
        )

    def _require_coords(self) -> RankCoords:
        if self.coords is None:
            raise RuntimeError("call init_distributed() first")
        return self.coords

    def _require_model(self) -> Any:
        if self.model is None:
            raise RuntimeError("call build() first")
        return self.model

    # ------------------------------------------------------------------------------- log-probs
    def set_images(self, images: StepImages) -> None:
        """Keep the step's prompt images (on the host) for the micro-batches that name them by ``image_index``;
        they replace the previous step's, and a frozen ViT's per-step cache starts empty."""
        self.images = images
        self._reset_image_cache({})

    def vision_outputs(self) -> dict[tuple[int, int], torch.Tensor] | None:
        """This step's frozen-ViT outputs on this rank (host copies; see :func:`vision_outputs`)."""
        return vision_outputs(self.model)

    def add_vision_outputs(self, outputs: dict[tuple[int, int], torch.Tensor] | None) -> None:
        """Another role's rank's frozen-ViT outputs of this step (:meth:`vision_outputs`), kept as if encoded here."""
        add_vision_outputs(self.model, outputs)

    def _reset_image_cache(self, cache: dict | None) -> None:
        """The frozen ViT's per-step cache of this rank's stage (see ``QwenVisionModel``): ``{}`` a new one,
        None none (its device memory freed)."""
        encoder = getattr(self.model, "image_encoder", None)
        if encoder is not None:
            encoder.cache = cache

    def compute_log_probs(
        self, micro_batches: Sequence[MicroBatch], temperature: float = 1.0, adapters: bool = True
    ) -> list[torch.Tensor] | None:
        """Log-probs [B, S] of each micro-batch's ``labels`` (forward only, through the pipeline schedule).

        A micro-batch holds ``input_ids``, ``attention_mask``, ``labels`` (labels[b, s]: the token position s
        predicts) and, with images, ``image_grid_thw`` of its rows' images and either ``image_index`` (each row's
        prompt among the step's images, see :meth:`set_images`) or their ``pixel_values``, and optionally
        ``response_mask``: then only those positions get log-probs (0 elsewhere; the model's ``output_mask``). Every
        rank must run this; the last stage's TP-rank 0 of each DP replica returns the list, the others None.
        ``adapters`` false: a LoRA actor's passes without its adapters, the base model's (the reference's).
        """
        import torch

        from mm_rl.models.lora import adapters_enabled

        model, coords = self._require_model(), self._require_coords()
        captured: list[torch.Tensor] = []

        def keep_log_probs(batch: MicroBatch, out: dict[str, torch.Tensor]) -> torch.Tensor:
            captured.append(out["log_probs"].detach())
            return out["log_probs"].sum() * 0.0

        was_training = model.training
        model.eval()
        with torch.no_grad(), adapters_enabled(model, adapters):
            run_schedule(model, micro_batches, keep_log_probs, temperature, forward_only=True, images=self.images)
        model.train(was_training)
        keep = model.layout.has_output and coords.leads_replica_stage()
        return to_host(captured) if keep else None

    # ---------------------------------------------------------------------------- weight sync
    def device_placement(self) -> tuple[str, str]:
        """This rank's node and the device Ray gave it (as the visible-devices variable names it): where a
        colocated engine's TP worker beside it must run."""
        import ray

        context = ray.get_runtime_context()
        ids = [i for values in context.get_accelerator_ids().values() for i in values]
        return context.get_node_id(), ",".join(ids)

    def device_identity(self) -> str | None:
        """This rank's physical device (mm_rl.platform.device.device_identity): who may map its sync buffers."""
        from mm_rl.platform.device import device_identity

        return device_identity()

    def join_sync_group(self, key: str, senders: dict[int, tuple[str, int]], worlds: dict[int, int]) -> None:
        """A stage's sender joins its weight-sync group with the engines' ranks (``senders``: stage -> the address
        this rank gave for it; ``worlds``: stage -> 1 + the engines' ranks; 1: every replica maps the sender's
        buffer, no group); the other ranks have no part in it."""
        from mm_rl.sync.transport import join_group

        coords = self._require_coords()
        if coords.is_sender() and worlds[coords.pp_rank] > 1:
            join_group(key, coords.pp_rank, *senders[coords.pp_rank], rank=0, world=worlds[coords.pp_rank])

    def push_weights(
        self,
        sink_factory: Callable[[int], BucketSink],
        bucket_bytes: int,
        stage: int | None = None,
        trained_only: bool = False,
    ) -> SyncStats | None:
        """Stream this stage's weights, TP-merged and HF-named, in buckets of about ``bucket_bytes``.

        Every rank calls it: TP ranks (and EP ranks, for the experts) take part in the gathers, the stage's
        TP-rank 0 of DP replica 0 builds the buckets and hands them to ``sink_factory(stage)`` (the transport
        seam, see mm_rl.sync.transport). Returns that rank's statistics, None elsewhere (other DP replicas hold
        the same weights: they do nothing). With ``stage``, only that pipeline stage's ranks push (the driver
        takes the stages one after another); the gathers stay inside a stage's TP and EP groups. ``trained_only``:
        the engines hold every frozen tensor already, so only what training changes is sent (a frozen ViT stays
        out; LoRA: only the adapted linears, merged).
        """
        from mm_rl.sync.sender import push_stage

        coords, model = self._require_coords(), self._require_model()
        stats = None
        if stage is not None and coords.pp_rank != stage:
            return None
        if coords.holds_unique_weights():  # other replicas and CP ranks hold the same weights
            stats = push_stage(
                model,
                self.spec.model,
                self.spec.tp,
                self.spec.ep,
                sink_factory if coords.is_sender() else None,
                bucket_bytes,
                trained_only=trained_only,
            )
        return stats

    # ------------------------------------------------------------------- colocated memory switches
    def offload(self, params: bool, grads: bool, optimizer: bool) -> dict[str, int]:
        """Free what the switches name on the device for the rollout (see mm_rl.workers.offload); returns the
        bytes freed per kind. Parameters and optimizer state are kept on the host; gradients are dropped."""
        from mm_rl.platform.device import empty_cache

        switches = {"params": params, "grads": grads, "optimizer": optimizer}
        self._reset_image_cache(None)  # the step is over: its images' ViT outputs go too
        freed = {
            kind: self._memory.offload(kind, self._memory_tensors(kind), keep=kind != "grads")
            for kind, on in switches.items()
            if on
        }
        empty_cache()
        return freed

    def onload(self, params: bool, grads: bool, optimizer: bool) -> dict[str, int]:
        """Bring back what :meth:`offload` took, before training (gradients come back as zeros)."""
        switches = {"params": params, "grads": grads, "optimizer": optimizer}
        restored = {kind: self._memory.onload(kind) for kind, on in switches.items() if on}
        return restored

    def _memory_tensors(self, kind: str) -> list[torch.Tensor]:
        """The tensors behind one switch. Gradients: ``main_grad`` (views into DDP's ``grad_data`` buffer, which
        goes as a whole) and plain ``.grad``. Optimizer: Adam moments and the main (fp32) parameters, but not
        storages that are the model's own parameters (fp32 without the distributed optimizer steps them in
        place): those belong to the ``params`` switch."""
        import torch

        model_params = list(self._require_model().parameters())
        if kind == "params":
            return model_params
        if kind == "grads":
            return [
                g for p in model_params for g in (getattr(p, "main_grad", None), p.grad) if isinstance(g, torch.Tensor)
            ]
        owned = {p.untyped_storage()._cdata for p in model_params}
        tensors = []
        for inner in (part.optimizer for part in optimizer_parts(getattr(self, "optimizer", None))):
            tensors += [p for group in inner.param_groups for p in group["params"]]
            tensors += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        return [t for t in tensors if t.untyped_storage()._cdata not in owned]

    # ------------------------------------------------------------------------------- bookkeeping
    def ready(self) -> bool:
        return True

    def threads(self) -> int:
        import torch

        return torch.get_num_threads()

    def node_id(self) -> str:
        """The Ray node this rank runs on (where a multi-node placement put it)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        """Leave the process group (all ranks together) so the actors can exit cleanly."""
        import torch

        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def vision_outputs(model: Any) -> dict[tuple[int, int], torch.Tensor] | None:
    """The frozen ViT's outputs of the step's images encoded so far on this stage (its per-step cache), on the
    host; None where the stage keeps none (no whole frozen ViT here)."""
    from mm_rl.platform.transfer import to_host

    encoder = getattr(model, "image_encoder", None)
    if encoder is None or not encoder.caches:
        return None
    return to_host(dict(encoder.cache))


def add_vision_outputs(model: Any, outputs: dict[tuple[int, int], torch.Tensor] | None) -> None:
    """``outputs`` (:func:`vision_outputs` of a rank at the same place of another role) into this stage's per-step
    cache on its device, where it keeps one: the reference's ViT is the checkpoint's, and so is a frozen actor's, so
    the images one role encoded are not encoded again by the other. Images already here stay as they are."""
    from mm_rl.platform.device import current_device
    from mm_rl.platform.transfer import to_device

    encoder = getattr(model, "image_encoder", None)
    if not outputs or encoder is None or not encoder.caches:
        return
    missing = {key: value for key, value in outputs.items() if key not in encoder.cache}
    encoder.cache.update(to_device(missing, current_device()))


def optimizer_parts(optimizer: Any) -> list[Any]:
    """The megatron optimizers inside ``optimizer`` (a ChainedOptimizer holds one per parameter kind); none for
    None."""
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None) -> torch.Tensor:
    """``tensor`` (on the CPU) all-reduced over ``group`` on this rank's device, returned on the CPU: nccl / hccl
    take device tensors only, and what the driver receives must be on the CPU."""
    import torch

    from mm_rl.platform.device import current_device

    on_device = tensor.to(current_device())
    torch.distributed.all_reduce(on_device, op=op or torch.distributed.ReduceOp.SUM, group=group)
    return on_device.cpu()


def run_schedule(
    model: Any,
    micro_batches: Sequence[MicroBatch],
    loss_of: Callable[..., torch.Tensor],
    temperature: float,
    forward_only: bool,
    images: StepImages | None = None,
) -> None:
    """megatron's pipeline schedule over ``micro_batches`` (every rank of the group calls it together).

    Every stage gets the whole micro-batch (its images from ``images``, the step's); on the last stage
    ``loss_of(batch, output)`` turns the model's output (``log_probs``, ``entropy``) into the loss handed to
    megatron (the log-prob pass returns a zero loss)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    get_forward_backward_func()(
        forward_step_func=functools.partial(_forward_step, loss_of, temperature, images),
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=max(int(b["input_ids"].shape[1]) for b in micro_batches),
        micro_batch_size=max(int(b["input_ids"].shape[0]) for b in micro_batches),
        forward_only=forward_only,
    )


def _forward_step(
    loss_of: Callable[..., torch.Tensor],
    temperature: float,
    images: StepImages | None,
    data: Iterator[MicroBatch],
    model: Any,
) -> tuple[Any, Callable[[Any], Any]]:
    """megatron's forward step: the model on the next micro-batch (its images put together from the step's and
    moved to this rank's device here, the one driver -> rank boundary of every pass), and the loss function of its
    output."""
    from megatron.core.utils import get_attr_wrapped_model

    from mm_rl.platform.device import current_device

    host = dict(next(data))
    # mRoPE ids from the host's copy, before the move: computed from the device's, they would stall each micro-batch
    # on a device -> host copy (the index walks every row's images on the CPU); the videos' time steps stay behind
    positions = get_attr_wrapped_model(model, "position_ids")(
        host["input_ids"], host.get("image_grid_thw"), host.get("attention_mask"), host.pop("mrope_time_steps", None)
    )
    batch = to_device({**host, "position_ids": positions}, current_device(), images)
    output = model(
        batch["input_ids"],
        position_ids=batch["position_ids"],
        attention_mask=batch.get("attention_mask"),
        pixel_values=batch.get("pixel_values"),
        image_grid_thw=batch.get("image_grid_thw"),
        labels=batch["labels"],
        temperature=temperature,
        encoded_grid_thw=batch.get("encoded_grid_thw"),
        image_slots=batch.get("image_slots"),
        image_keys=batch.get("image_keys"),
        output_mask=batch.get("response_mask"),
        shared_prompt=batch.get("shared_prompt"),
    )

    def loss_func(out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        return loss_of(batch, out), {}

    return output, loss_func


if TYPE_CHECKING:  # the weight sync's calls on a rank, checked against this class by type checkers
    from mm_rl.sync.driver import RankSender

    _SENDER: type[RankSender] = MegatronWorker
