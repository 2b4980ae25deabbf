"""The device boundaries of a rank or an engine, each one function that names its target device.

Three things cross a process or device boundary, and each crosses here only:

* driver -> rank: a micro-batch arrives on the CPU (Ray unpickles it there) and goes to the rank's device at the
  step boundary, :func:`to_device`, before the model sees any of it (the ViT takes its device from
  ``pixel_values``, the LLM from ``input_ids``). From pinned memory the copy is asynchronous.
* rank -> driver: whatever a rank returns is on the CPU, :func:`to_host`: a CPU-only head cannot unpickle a device
  tensor, and on a GPU head it would land on cuda:0 beside the driver's CPU tensors.
* rank -> engine: weight buckets are packed on a device the caller names (:func:`mm_rl.sync.transport.pack_bucket`).

On a CPU machine the target is the CPU and both moves return the tensors themselves; tests pass another device
(``meta``, or a tensor labelled cuda over CPU values) to see that nothing is left behind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def _pinned(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` in page-locked host memory when it goes to an accelerator (an asynchronous copy needs it)."""
    if device.type in ("cuda", "npu") and tensor.device.type == "cpu" and not tensor.is_pinned():
        return tensor.pin_memory()
    return tensor


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """Every tensor of a micro-batch on ``device`` (other values pass unchanged); the driver -> rank boundary."""
    return {key: _pinned(value, device).to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
            for key, value in batch.items()}


def to_host(value: T) -> T:
    """``value`` with every tensor it holds (in lists, tuples, dicts, dataclasses) on the CPU, detached; the
    rank -> driver boundary."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()  # type: ignore[return-value]
    if isinstance(value, Mapping):
        return type(value)((key, to_host(item)) for key, item in value.items())  # type: ignore[call-arg]
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(to_host(item) for item in value)  # type: ignore[call-arg]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: to_host(getattr(value, f.name))  # type: ignore[arg-type]
                                             for f in dataclasses.fields(value) if f.init})
    return value
