"""Buckets of HF-named tensors: how a sender cuts its weights and how a receiver knows a layer is whole.

vLLM fuses q/k/v and gate/up into one parameter, so a layer must be loaded from all of its tensors at once. A
sender (:mod:`mm_rl.sync.sender`) packs whole weight groups (a transformer layer, a ViT block, else the parent
module) into buckets of about ``sync_bucket_mb``; an engine that may receive a group split over several calls holds
its tensors back in a :class:`GroupAssembler` until the group is complete.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

NamedTensor = tuple[str, "torch.Tensor"]
Bucket = list[NamedTensor]

_LAYER = re.compile(r"^(.*?\.(?:layers|blocks)\.\d+)\.")


def weight_group(name: str) -> str:
    """The unit a weight must be loaded with: its transformer layer / ViT block, else its parent module.

    vLLM fuses q/k/v and gate/up into one parameter, so a layer loaded from half of its tensors would be
    processed with the other half missing; engines therefore apply weights a whole group at a time.
    """
    match = _LAYER.match(name)
    return match.group(1) if match else name.rpartition(".")[0]


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucket_by_group(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Consecutive tensors in buckets of about ``bucket_bytes``, cut only between weight groups.

    For senders that push in several calls (Ray, multiprocess vLLM): with tensors ordered by layer (HF order),
    each bucket holds whole layers, so a receiver can apply it on its own. A single group larger than the bucket
    becomes a bucket of its own.
    """
    bucket: Bucket = []
    size, group = 0, None
    for name, tensor in named_tensors:
        current = weight_group(name)
        if bucket and current != group and size + tensor_bytes(tensor) > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor_bytes(tensor)
        group = current
    if bucket:
        yield bucket


class GroupAssembler:
    """Holds back tensors until every tensor of their group has arrived, then releases the group.

    ``expected`` maps each group to its tensor names (from the checkpoint). Names of unknown groups pass straight
    through. Memory held is at most the incomplete groups, i.e. about one layer per sender split.
    """

    def __init__(self, expected_names: Iterable[str]) -> None:
        self.expected: dict[str, set[str]] = {}
        for name in expected_names:
            self.expected.setdefault(weight_group(name), set()).add(name)
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def feed(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            group = weight_group(name)
            wanted = self.expected.get(group)
            if wanted is None or name not in wanted:
                yield name, tensor
                continue
            held = self.pending.setdefault(group, {})
            held[name] = tensor
            if held.keys() >= wanted:
                yield from self.pending.pop(group).items()

    @property
    def pending_names(self) -> list[str]:
        return sorted(name for held in self.pending.values() for name in held)
