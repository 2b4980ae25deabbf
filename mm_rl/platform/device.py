"""Which accelerator this process runs on, and the one-time set-up every megatron-core process needs.

Three kinds of machine are supported:

* ``npu``: Ascend, through ``torch_npu``. ``setup_process`` imports MindSpeed's megatron adaptor when it is
  installed, else applies torch_npu's ``transfer_to_npu`` (which re-points ``torch.cuda`` and ``device="cuda"``
  at the NPU) and bridges megatron's ``param.type()`` checks (see :func:`_setup_npu`).
* ``cuda``: nothing to bridge.
* ``cpu``: no accelerator; collectives run over gloo. ``setup_process`` installs the targeted bridges of
  :mod:`mm_rl.platform.megatron_cpu` (read its docstring for the list of call sites). Two
  ``TransformerConfig`` features must stay off on CPU (see :func:`cpu_safe_transformer_kwargs`):
  ``gradient_accumulation_fusion`` (needs apex's fused CUDA kernel) and ``apply_rope_fusion`` (needs
  Transformer Engine).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from typing import Any, Literal

import torch

DeviceKind = Literal["npu", "cuda", "cpu"]

_BACKENDS: dict[str, str] = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
VISIBLE_DEVICES_ENV: dict[str, str] = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
_setup_done = False


def _npu_available() -> bool:
    """True when torch_npu imports and sees at least one NPU (importing it registers the device)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


@functools.cache
def device_kind() -> DeviceKind:
    """The accelerator of this process: ``"npu"``, ``"cuda"`` or ``"cpu"``.

    NPU is probed first: after ``transfer_to_npu`` ``torch.cuda.is_available()`` answers for the NPU too.
    """
    if _npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def device_count() -> int:
    """Accelerators this process sees (0 on a CPU-only machine)."""
    kind = device_kind()
    return 0 if kind == "cpu" else int(getattr(torch, kind).device_count())


def dist_backend() -> str:
    """The ``torch.distributed`` backend for this device kind: ``hccl``, ``nccl`` or ``gloo``."""
    return _BACKENDS[device_kind()]


def current_device() -> torch.device:
    """The device this process puts its tensors on (the current NPU / GPU, or the CPU)."""
    kind = device_kind()
    if kind == "npu":
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on CPU)."""
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def device_identity() -> str | None:
    """Which physical device this process's current device is, comparable across processes (``CUDA_VISIBLE_DEVICES``
    / ``ASCEND_RT_VISIBLE_DEVICES`` renumber devices per process): the GPU's UUID (as vLLM's IPC weight transfer
    keys handles, vllm/distributed/weight_transfer/ipc_engine.py), or the host and the physical NPU index behind
    the visible one (vllm-ascend's npu_generate_uuid does the same). None on CPU: no device is shared."""
    import socket

    kind = device_kind()
    if kind == "cuda":
        return f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    if kind == "npu":
        logical = torch.npu.current_device()  # type: ignore[attr-defined]
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "")
        physical = int(visible.split(",")[logical]) if visible else logical
        return f"{socket.gethostname()}-NPU-{physical}"
    return None


def ipc_supported(device: torch.device) -> bool:
    """Whether another process on ``device`` can map a tensor of this one: CUDA, and NPU where torch_npu shares
    storages (``_share_npu_``, torch_npu/multiprocessing/reductions.py); never CPU tensors here (those go through
    Ray's shared-memory object store)."""
    if device.type == "cuda":
        return True
    return device.type == "npu" and hasattr(torch.UntypedStorage, "_share_npu_")


def export_ipc(tensor: torch.Tensor) -> bytes:
    """A handle another process on the same device opens with :func:`import_ipc` (no copy): torch's
    multiprocessing reduction of the tensor (torch_npu installs its own for NPU tensors when imported), pickled
    with this process's :func:`device_identity`. The caller keeps ``tensor`` alive until the reader is done."""
    import pickle

    from torch.multiprocessing import reductions

    return pickle.dumps((device_identity(), reductions.reduce_tensor(tensor)))


def import_ipc(handle: bytes) -> torch.Tensor:
    """The tensor of :func:`export_ipc` mapped into this process, on its current device. The device index inside
    the handle is the exporter's numbering, so it is replaced by this process's (index 6 of the rebuild arguments
    of torch's and torch_npu's reductions is the storage device; vLLM's IPC engine does the same)."""
    import pickle

    identity, (rebuild, args) = pickle.loads(handle)  # noqa: S301 - made by export_ipc in this job
    if identity != device_identity():
        raise RuntimeError(
            f"a shared weight buffer of device {identity} was sent to a process on {device_identity()}"
            ": only a process on the sender's own device can map it"
        )
    args = list(args)
    args[6] = current_device().index
    return rebuild(*args)


def release_ipc(device: torch.device) -> None:
    """Free the buffers this process exported with :func:`export_ipc` and has since dropped: a shared block stays
    reserved until its readers let go of it, and only ``ipc_collect`` hands it back (``torch.cuda.ipc_collect``;
    torch_npu's where it has one). Without it a colocated engine would size its KV cache without them."""
    collect = getattr(getattr(torch, device.type, None), "ipc_collect", None) if device.type != "cpu" else None
    if collect is not None:
        collect()


def empty_cache() -> None:
    """Hand the caching allocator's free blocks back to the device (after an offload, so a colocated engine can
    take them); nothing to do on CPU."""
    kind = device_kind()
    if kind != "cpu":
        getattr(torch, kind).empty_cache()


def device_rng_state() -> torch.Tensor | None:
    """The default generator state of this process's device (CUDA / NPU), on the CPU for a checkpoint; None on a
    CPU machine, where the CPU generator is the only one (saved beside it)."""
    kind = device_kind()
    return None if kind == "cpu" else getattr(torch, kind).get_rng_state().cpu()


def set_device_rng_state(state: torch.Tensor) -> None:
    """Restore :func:`device_rng_state` (a checkpoint of a CPU run has none, and a CPU machine ignores one)."""
    kind = device_kind()
    if kind != "cpu":
        getattr(torch, kind).set_rng_state(state)


def cpu_safe_transformer_kwargs() -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments that must be forced on this device kind (empty off CPU).

    On CPU: no gradient-accumulation fusion (apex CUDA kernel), no RoPE fusion (Transformer Engine).
    """
    if device_kind() != "cpu":
        return {}
    return {"gradient_accumulation_fusion": False, "apply_rope_fusion": False}


def _apply_transfer_to_npu() -> None:
    """Map ``torch.cuda`` onto ``torch.npu``; importing the module applies the patches."""
    importlib.import_module("torch_npu.contrib.transfer_to_npu")


def _setup_npu() -> str:
    """megatron-core on NPU: MindSpeed's megatron adaptor when installed (what MindSpeed-MM and MindSpeed-RL import
    first; it applies ``transfer_to_npu``, patches ``Tensor.type`` to report CUDA names, and brings the fused NPU
    kernels), else ``transfer_to_npu`` plus mm_rl's bridge of megatron's ``.type()`` checks. Must run before
    megatron is imported (the adaptor replaces modules megatron imports). Returns which one for the log."""
    if importlib.util.find_spec("mindspeed") is not None:
        importlib.import_module("mindspeed.megatron_adaptor")
        return "MindSpeed megatron adaptor"
    from mm_rl.platform import megatron_cpu

    _apply_transfer_to_npu()
    megatron_cpu.install_npu_type_bridge()
    return "transfer_to_npu + mm_rl's type bridge (MindSpeed not installed)"


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def keep_freed_host_memory() -> bool:
    """Let this process reuse the host memory its tensors free instead of handing it back to the kernel: glibc
    serves an allocation above its mmap threshold (128 KiB at first) with a fresh mapping and unmaps it on free,
    so activations fault their pages in again. No mappings, no trimming: freed blocks stay in the heap for the next
    pass, as a device's caching allocator keeps them; the peak stays resident. Measured on a CPU rank's update of the
    28M bench model (2 cores): kernel time 1.12 -> 0.81 s of ~5 CPU-seconds, wall 2.8 -> 2.6 s. False where the C
    library is not glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(
        mallopt(option, value) == 1
        for option, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
    )


def compiled_helpers_run_eagerly() -> None:
    """CPU: the libraries' ``torch.compile``-decorated helpers run as the plain code they decorate, in this process
    (``torch.compiler.set_stance("force_eager")``) and in the processes it starts (``TORCH_COMPILE_DISABLE``, which
    torch reads when it is imported there: vLLM's engine core and TP workers).

    Eager is what runs on CPU anyway (vLLM's ``enforce_eager``, megatron-core without fused kernels), but helpers
    keep their own ``torch.compile``: megatron-core's ``jit_fuser`` (MoE routing and dispatch, the Gated DeltaNet,
    the attention output gate; megatron/core/jit.py) and vLLM's sampler rank count (``batched_count_greater_than``,
    vllm/v1/sample/ops/logprobs.py) and Gated DeltaNet input split (qwen_gdn_linear_attn.py). Each compiled on its
    first call with inductor, which hashes torch's source tree and generates and builds C++ first: measured here,
    the tiny job's first step 3.0 -> 1.2 s (the engine's first generate 2.3 -> 0.2 s), the tiny Qwen3.5's 6.9 ->
    2.9 s, later steps the same."""
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    torch.compiler.set_stance("force_eager")


@contextlib.contextmanager
def helper_threads_without_intra_op() -> Iterator[None]:
    """Within the block, torch in this thread, and in the threads it starts, runs its ops on one thread each; the
    calling thread's setting comes back after. For helper threads of a process whose own thread computes (the
    driver's prompt processing beside it): each thread's first parallel op gives that thread an OpenMP team of its
    own, and once a process holds more OpenMP threads than cores, GNU OpenMP stops spinning at its barriers
    (libgomp's throttled spin count) and the process's main thread's matmuls ran 35% slower from then on
    (measured: 150-170 -> 93-112 GFLOP/s after one prompt batch processed in a thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # this thread's count, and the one threads started from now on take
    try:
        yield
    finally:
        torch.set_num_threads(before)


def setup_process(num_threads: int | None = None) -> None:
    """Prepare this process for megatron-core on its device kind; call once, before building models.

    Idempotent: every call after the first does nothing. ``num_threads`` sets torch's intra-op threads
    (several processes share a few cores on CPU machines, so each should get an explicit budget).
    """
    global _setup_done
    if _setup_done:
        return
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    from mm_rl.platform import megatron_cpu

    kind = device_kind()
    if kind == "npu":
        logging.getLogger(__name__).info("megatron on NPU through %s", _setup_npu())
    elif kind == "cpu":
        megatron_cpu.install()
        keep_freed_host_memory()
        compiled_helpers_run_eagerly()
    # every device kind: without Transformer Engine, megatron-core 0.16.1's MoE router reads a name its import
    # never defined (moe/moe_utils.py, te_general_gemm); CUDA and NPU without MindSpeed crashed at the first forward
    megatron_cpu.define_missing_te_gemm()
    _setup_done = True
