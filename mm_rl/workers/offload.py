"""Colocated memory switches: a rank's parameters, gradients and optimizer state leave the device while the
rollout engine runs there, and come back before training.

Memory moves by *storage*, never by re-pointing ``tensor.data``. megatron's DDP keeps every trainable parameter
(with the distributed optimizer) and every ``main_grad`` as a view into one contiguous buffer per dtype
(``param_data`` / ``grad_data``) that the gradient reduction and the optimizer address directly; giving a
parameter a new ``.data`` would cut it off from that buffer, and the next step would reduce and update stale
memory. Instead each distinct storage is copied to a host tensor (pinned off CPU, so the copies are async DMA) and
resized to zero bytes: every view keeps its shape, strides and offset and sees its values again once the storage is
resized and copied back. Gradients are not copied, only freed: the step zeroes them before it accumulates anyway.

On a CPU-only machine the host *is* the device, so the trainer never switches there; the mechanism is the same on
every device, and the tests run it on CPU (storages really emptied, values restored bit for bit).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

Kind = Literal["params", "grads", "optimizer"]
KINDS: tuple[Kind, ...] = ("params", "grads", "optimizer")


@dataclass
class _Parked:
    """One storage off the device: its size, and its bytes on the host (None: contents not needed back)."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (to copy it in one call)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class MemorySwitch:
    """Offloads / onloads named groups of tensors by storage; each storage is moved once, whatever its views.

    ``offload(kind, tensors, keep)`` empties the storages behind ``tensors`` (their bytes kept on the host when
    ``keep``); ``onload(kind)`` gives them back their size and bytes (zeros when not kept). A storage already
    away under another kind (a buffer shared by two groups) is left to that kind."""

    def __init__(self) -> None:
        self.away: dict[Kind, list[_Parked]] = {}

    def offload(self, kind: Kind, tensors: Iterable[torch.Tensor], keep: bool) -> int:
        """Move ``kind`` off the device; returns the bytes freed there. A kind already away stays as it is."""
        import torch

        from mm_rl.platform.device import synchronize

        if kind in self.away:
            return 0
        taken = {p.storage._cdata for parked in self.away.values() for p in parked}
        parked: list[_Parked] = []
        for storage in _distinct_storages(tensors):
            if storage._cdata in taken or storage.nbytes() == 0:
                continue
            host = None
            if keep:
                pin = storage.device.type != "cpu"
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(_bytes_view(storage), non_blocking=pin)
            parked.append(_Parked(storage, storage.nbytes(), host))
        if parked:
            synchronize(parked[0].storage.device)  # the host copies are complete before the memory goes
        for item in parked:
            item.storage.resize_(0)
        self.away[kind] = parked
        return sum(item.nbytes for item in parked)

    def onload(self, kind: Kind) -> int:
        """Bring ``kind`` back (values as they left, or zeros); returns the bytes restored."""
        from mm_rl.platform.device import synchronize

        parked = self.away.pop(kind, [])
        for item in parked:
            item.storage.resize_(item.nbytes)
            view = _bytes_view(item.storage)
            if item.host is None:
                view.zero_()
            else:
                view.copy_(item.host, non_blocking=True)
        if parked:
            synchronize(parked[0].storage.device)
        return sum(item.nbytes for item in parked)


def _distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storages behind ``tensors``, each once (views of one buffer share it), in first-seen order.

    Keyed by ``_cdata``, the address of the storage itself: each ``untyped_storage()`` call returns a new Python
    wrapper, and an emptied storage has no data pointer."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen.setdefault(storage._cdata, storage)
    return list(seen.values())


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the distinct storages behind ``tensors`` hold now (0 for every offloaded one)."""
    return sum(storage.nbytes() for storage in _distinct_storages(tensors))
