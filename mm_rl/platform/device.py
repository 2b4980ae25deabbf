"""Which accelerator this process runs on, and the one-time set-up every megatron-core process needs.

Three kinds of machine are supported:

* ``npu``: Ascend, through ``torch_npu``. ``setup_process`` applies torch_npu's ``transfer_to_npu``, which
  re-points ``torch.cuda`` (and ``device="cuda"``) at the NPU, so megatron-core's CUDA-shaped code runs
  unchanged. This is the same approach MindSpeed takes.
* ``cuda``: nothing to bridge.
* ``cpu``: no accelerator; collectives run over gloo. ``setup_process`` installs the targeted bridges of
  :mod:`mm_rl.platform.megatron_cpu` (read its docstring for the list of call sites). Three
  ``TransformerConfig`` features must stay off on CPU (see :func:`cpu_safe_transformer_kwargs`):
  ``gradient_accumulation_fusion`` (needs apex's fused CUDA kernel), ``apply_rope_fusion`` (needs
  Transformer Engine) and ``sequence_parallel`` (not supported with the local, non-TE layer spec).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any, Literal

import torch

DeviceKind = Literal["npu", "cuda", "cpu"]

_BACKENDS: dict[str, str] = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
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


def empty_cache() -> None:
    """Hand the caching allocator's free blocks back to the device (after an offload, so a colocated engine can
    take them); nothing to do on CPU."""
    kind = device_kind()
    if kind != "cpu":
        getattr(torch, kind).empty_cache()


def cpu_safe_transformer_kwargs() -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments that must be forced on this device kind (empty off CPU).

    On CPU: no gradient-accumulation fusion (apex CUDA kernel), no RoPE fusion (Transformer Engine),
    no sequence parallelism (the local layer spec does not support it).
    """
    if device_kind() != "cpu":
        return {}
    return {"gradient_accumulation_fusion": False, "apply_rope_fusion": False, "sequence_parallel": False}


def _apply_transfer_to_npu() -> None:
    """Map ``torch.cuda`` onto ``torch.npu``; importing the module applies the patches."""
    importlib.import_module("torch_npu.contrib.transfer_to_npu")


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
    kind = device_kind()
    if kind == "npu":
        _apply_transfer_to_npu()
    elif kind == "cpu":
        from mm_rl.platform import megatron_cpu

        megatron_cpu.install()
    _setup_done = True
