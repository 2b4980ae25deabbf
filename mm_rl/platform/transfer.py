"""The device boundaries of a rank or an engine, each one function that names its target device.

Three things cross a process or device boundary, and each crosses here only:

* driver -> rank: a micro-batch arrives on the CPU (Ray unpickles it there) and goes to the rank's device at the
  step boundary, :func:`to_device`, before the model sees any of it (the ViT takes its device from
  ``pixel_values``, the LLM from ``input_ids``). From pinned memory the copy is asynchronous. The step's prompt
  images reach every rank once per step (:data:`StepImages`, kept on the host); a micro-batch names its rows'
  images by ``image_index`` and :func:`to_device` puts the pixel values of its distinct images together there,
  the one place a rank materialises them (:func:`image_inputs`).
* rank -> driver: whatever a rank returns is on the CPU, :func:`to_host`: a CPU-only head cannot unpickle a device
  tensor, and on a GPU head it would land on cuda:0 beside the driver's CPU tensors.
* rank -> engine: weight buckets are packed on a device the caller names (:func:`pack_bucket`).

Between processes (Ray's object store) the driver's micro-batches and step images travel as :class:`Packed`: all of
a value's tensors in one flat byte buffer, which pickle protocol 5 hands to the store out of band, unpickled as the
same value whose tensors view one host buffer of the receiver's own. torch pickles every tensor's storage apart
(measured through the object store, 8 micro-batches of 10 tensors: 10-12 ms put + get, packed 3 ms).

On a CPU machine the target is the CPU and both moves return the tensors themselves; tests pass another device
(``meta``, or a tensor labelled cuda over CPU values) to see that nothing is left behind.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")
# data-set index -> (pixel_values [patches, C*T*P*P], image_grid_thw [images, 3]) of that prompt (no images: empty);
# a multi-turn trajectory's tool images under a key of its own, below NO_TOOL_IMAGES
StepImages = Mapping[int, tuple[torch.Tensor, torch.Tensor]]
NO_TOOL_IMAGES = -1  # a micro-batch row's tool_image_index when its tools returned no image
TensorLayout = tuple[str, str, tuple[int, ...], int]  # name, dtype, shape, byte offset in the flat buffer
_ALIGN = 64  # byte alignment of each tensor in a flat buffer (any dtype view of it stays aligned)


def _pinned(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` in page-locked host memory when it goes to an accelerator (an asynchronous copy needs it)."""
    if device.type in ("cuda", "npu") and tensor.device.type == "cpu" and not tensor.is_pinned():
        return tensor.pin_memory()
    return tensor


def to_device(batch: Mapping[str, Any], device: torch.device, images: StepImages | None = None) -> dict[str, Any]:
    """Every tensor of a micro-batch on ``device`` (other values pass unchanged); the driver -> rank boundary.

    A micro-batch with ``image_index`` gets its images from the step's ``images`` first (:func:`image_inputs`)."""
    if "image_index" in batch:
        if images is None:
            raise ValueError("the micro-batch names its images by image_index but the rank holds no step images")
        named = ("image_index", "tool_image_index")
        batch = {key: value for key, value in batch.items() if key not in named} | image_inputs(batch, images)
    return {
        key: _pinned(value, device).to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
        for key, value in batch.items()
    }


def image_inputs(batch: Mapping[str, Any], images: StepImages) -> dict[str, torch.Tensor]:
    """The model's image inputs of a micro-batch whose rows name their prompt by ``image_index`` [B] (and, for a
    multi-turn trajectory whose tools returned images, those by ``tool_image_index`` [B], NO_TOOL_IMAGES for none):
    each
    distinct entry's images once (``pixel_values``, their grids ``encoded_grid_thw``, their keys ``image_keys``:
    entry key and image number, entries in order of first use) and, per image slot in row order (a row's prompt
    images, then its tools'), the encoded image that fills it (``image_slots``); none without images.

    The n samples of a prompt share its images, so the ViT encodes them once per micro-batch and the model copies
    the embeddings into every slot. ``encoded_grid_thw[image_slots]`` must be the micro-batch's ``image_grid_thw``
    (images of another step would not be)."""
    prompts = batch["image_index"].tolist()
    tools = batch["tool_image_index"].tolist() if "tool_image_index" in batch else [NO_TOOL_IMAGES] * len(prompts)
    rows = [[index] + ([tool] if tool != NO_TOOL_IMAGES else []) for index, tool in zip(prompts, tools, strict=True)]
    entries = list(dict.fromkeys(key for keys in rows for key in keys))
    missing = [key for key in entries if key not in images]
    if missing:
        raise ValueError(
            f"the micro-batch's prompts {missing} are not among the step's images: were this step's "
            "images handed to the ranks?"
        )
    first: dict[int, int] = {}
    count = 0
    for key in entries:
        first[key], count = count, count + len(images[key][1])
    if not count:
        return {}
    slots = torch.tensor([first[key] + k for keys in rows for key in keys for k in range(len(images[key][1]))])
    grids = torch.cat([images[key][1] for key in entries])
    if not torch.equal(grids[slots], batch.get("image_grid_thw", grids[:0])):
        raise ValueError(
            "the micro-batch's image_grid_thw differs from its prompts' images in the step's images: "
            "were this step's images handed to the ranks?"
        )
    keys = torch.tensor([(key, k) for key in entries for k in range(len(images[key][1]))])
    return {
        "pixel_values": torch.cat([images[key][0] for key in entries]),
        "encoded_grid_thw": grids,
        "image_slots": slots,
        "image_keys": keys,
    }


def to_host(value: T) -> T:
    """``value`` with every tensor it holds (in lists, tuples, dicts, dataclasses) on the CPU, detached; the
    rank -> driver boundary."""
    return map_tensors(value, lambda tensor: tensor.detach().cpu())


def map_tensors(value: T, fn: Callable[[Any], Any], kind: type = torch.Tensor) -> T:
    """``value`` with ``fn`` applied to every ``kind`` it holds, in lists, tuples, dicts and dataclasses (rebuilt as
    their own types; named tuples and other objects pass as they are)."""
    if isinstance(value, kind):
        return fn(value)  # type: ignore[no-any-return]
    if isinstance(value, Mapping):
        return type(value)((key, map_tensors(item, fn, kind)) for key, item in value.items())  # type: ignore[call-arg]
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(map_tensors(item, fn, kind) for item in value)  # type: ignore[call-arg]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(
            value,
            **{
                f.name: map_tensors(getattr(value, f.name), fn, kind)  # type: ignore[arg-type]
                for f in dataclasses.fields(value)
                if f.init
            },
        )
    return value


# ------------------------------------------------------------------------------------- packed byte buffers
def dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _view(flat: torch.Tensor, dtype: str, shape: tuple[int, ...], start: int) -> torch.Tensor:
    """The tensor of ``dtype`` / ``shape`` stored at byte ``start`` of ``flat`` (an empty one: its own, since an
    empty buffer's slice may have a stride a dtype view refuses)."""
    kind = getattr(torch, dtype)
    if not math.prod(shape):
        return torch.empty(shape, dtype=kind, device=flat.device)
    return flat[start : start + kind.itemsize * math.prod(shape)].view(kind).view(shape)


def bucket_layout(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[TensorLayout], int]:
    """Where each tensor of ``bucket`` goes in one flat byte buffer (aligned offsets), and the buffer's size."""
    layout, offset = [], 0
    for name, tensor in bucket:
        layout.append((name, dtype_name(tensor), tuple(tensor.shape), offset))
        offset += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    return layout, offset


def pack_bucket(
    bucket: Sequence[tuple[str, torch.Tensor]],
    device: torch.device,
    buffer: Callable[[int], torch.Tensor] | None = None,
) -> tuple[list[TensorLayout], torch.Tensor]:
    """The bucket's tensors in one flat byte buffer on ``device`` (``buffer(nbytes)`` when given: a buffer reused
    between buckets, at least that large), and where each one is."""
    layout, nbytes = bucket_layout(bucket)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device) if buffer is None else buffer(nbytes)[:nbytes]
    for (_, tensor), (_, dtype, shape, start) in zip(bucket, layout, strict=True):
        _view(flat, dtype, shape, start).copy_(tensor, non_blocking=True)
    return layout, flat


def unpack_bucket(layout: Sequence[TensorLayout], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors of :func:`pack_bucket`'s buffer, as views of it."""
    return [(name, _view(flat, dtype, tuple(shape), start)) for name, dtype, shape, start in layout]


@dataclasses.dataclass(frozen=True)
class _Slot:
    index: int  # where a tensor of a Packed value sits in its buffer's layout


class Packed:
    """A value holding host tensors (lists, tuples, dicts, dataclasses of them) that pickles as one flat byte buffer
    and unpickles as the same value, its tensors views of one buffer the receiver owns (see the module docstring).
    Only host tensors: a rank's results leave through :func:`to_host` first."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        import numpy

        tensors: list[tuple[str, torch.Tensor]] = []

        def slot(tensor: torch.Tensor) -> _Slot:
            if tensor.device.type != "cpu":
                raise ValueError(f"a {tensor.device} tensor cannot travel packed: move it to the host first")
            tensors.append(("", tensor.detach()))
            return _Slot(len(tensors) - 1)

        skeleton = map_tensors(self.value, slot)
        layout, flat = pack_bucket(tensors, torch.device("cpu"))
        return _unpacked, (skeleton, layout, numpy.from_dlpack(flat))


def _unpacked(skeleton: Any, layout: list[TensorLayout], array: Any) -> Any:
    """Receiver side of :class:`Packed`. The buffer is copied once: an array Ray maps from its object store is
    read-only shared memory, and a rank may write into its micro-batches' tensors."""
    tensors = [tensor for _, tensor in unpack_bucket(layout, torch.from_numpy(array.copy()))]
    return map_tensors(skeleton, lambda slot: tensors[slot.index], _Slot)
