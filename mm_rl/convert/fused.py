"""Writing fused expert tensors (``mm_rl.models.family.Fused``): the tensor table and mg2hf speak of one HF
tensor per expert and part; a family whose checkpoints store them fused gets them written back fused, in the
published layout (``[experts, in, k * out]``, each part transposed). Reading them is the HF reader's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mm_rl.convert.errors import ConversionError
from mm_rl.convert.hf_writer import ShardedWriter, TensorSpec
from mm_rl.models.family import Fused, name_pattern


@dataclass(frozen=True)
class PartOf:
    """Where one per-expert HF tensor goes: the stored tensor's name, the expert and the part."""

    stored: str
    expert: int
    part: int
    parts: int


def part_of(name: str, rules: Sequence[Fused]) -> PartOf | None:
    for rule in rules:
        for j, part in enumerate(rule.parts):
            match = name_pattern(part).match(name)
            if match:
                return PartOf(rule.stored.format(i=match["i"]), int(match["e"]), j, len(rule.parts))
    return None


def fuse_specs(specs: Sequence[TensorSpec], rules: Sequence[Fused]) -> list[TensorSpec]:
    """The specs with each group of per-expert parts replaced by its stored tensor, placed where its last part
    was (where :class:`FusingWriter` has it complete)."""
    groups: dict[str, list[tuple[PartOf, TensorSpec]]] = {}
    for spec in specs:
        found = part_of(spec.name, rules)
        if found:
            groups.setdefault(found.stored, []).append((found, spec))
    last = {id(members[-1][1]): stored for stored, members in groups.items()}
    out = []
    for spec in specs:
        if id(spec) in last:
            members = groups[last[id(spec)]]
            experts = 1 + max(p.expert for p, _ in members)
            out_size, in_size = members[0][1].shape
            out.append(TensorSpec(last[id(spec)], (experts, in_size, out_size * members[0][0].parts), spec.dtype))
        elif part_of(spec.name, rules) is None:
            out.append(spec)
    return out


class FusingWriter:
    """A :class:`ShardedWriter` front that collects the parts of a fused tensor and writes it once complete
    (memory: one stored tensor, the size of one layer's experts)."""

    def __init__(self, writer: ShardedWriter, rules: Sequence[Fused]) -> None:
        """``writer``: planned with :func:`fuse_specs`' specs, which give each stored tensor's shape."""
        self.writer, self.rules = writer, tuple(rules)
        self.expected = {spec.name: spec for shard in writer.shards for spec in shard}
        self.pending: dict[str, dict[tuple[int, int], torch.Tensor]] = {}

    def write(self, name: str, blocks: Sequence[torch.Tensor]) -> None:
        found = part_of(name, self.rules)
        if found is None:
            self.writer.write(name, blocks)
            return
        parts = self.pending.setdefault(found.stored, {})
        parts[found.expert, found.part] = torch.cat(list(blocks)) if len(blocks) > 1 else blocks[0]
        spec = self.expected.get(found.stored)
        if spec is None:
            raise ConversionError(f"internal: {name} belongs to {found.stored}, which is not being written")
        experts = spec.shape[0]
        if len(parts) < experts * found.parts:
            return
        fused = torch.stack([torch.cat([parts[e, j].T for j in range(found.parts)], dim=1) for e in range(experts)])
        del self.pending[found.stored]
        self.writer.write(found.stored, [fused])

    def finish(self) -> None:
        if self.pending:
            raise ConversionError(f"internal: fused tensors left incomplete: {sorted(self.pending)}")
        self.writer.finish()

    def abort(self) -> None:
        self.writer.abort()
