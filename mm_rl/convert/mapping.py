"""The rules that turn a model family's tensor table into hf2mg / mg2hf / weight-sync operations.

A family's ``tensors`` (``mm_rl.models.family.Entry``, one per Megatron tensor) give, for each Megatron tensor,
the pipeline part that holds it (``scope``, see ``stages``), its Megatron name (``{i}``: the layer index local
to the stage), the HF tensors it is made of (``{i}``: the global layer index) with their shapes in model
dimensions, how those parts are laid out in it (``layout``) and which dimension tensor parallelism splits
(``split``; None: every rank holds a copy). hf2mg, mg2hf and the weight sync into vLLM all go through the
functions below; no other module names a tensor.

Every layout is expressed as *pieces*: TP rank r's shard of a Megatron tensor is the concatenation, along the
split dimension, of row (or column) ranges of its HF parts. hf2mg reads exactly those ranges from disk; mg2hf
and ``merge_tp_shards`` run the same pieces backwards. The layouts are described with the Qwen2.5-VL table
(``mm_rl.models.qwen_vl.tensors``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache

import torch

from mm_rl.config.schema import ModelConfig
from mm_rl.convert.errors import ConversionError
from mm_rl.convert.stages import Pipeline, Stage
from mm_rl.models.family import SCOPES, Entry, ModelFamily, Scope, UnknownFamily, name_pattern
from mm_rl.models.registry import family_of


# ------------------------------------------------------------------------------------------ model sizes
def model_family(model: ModelConfig) -> ModelFamily:
    """The family of model.json, an unknown ``model_id`` as a conversion error."""
    try:
        return family_of(model)
    except UnknownFamily as err:
        raise ConversionError(str(err)) from None


def model_dims(model: ModelConfig) -> dict[str, int]:
    """The dimension names used in ``Entry.shapes``, from model.json."""
    return model_family(model).model_dims(model)


def hf_shape(entry: Entry, part: int, dims: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(dims[name] for name in entry.shapes[part])


# ---------------------------------------------------------------------------------- tensors of a stage
@dataclass(frozen=True)
class Bound:
    """An entry placed on a stage: the concrete Megatron name and HF names."""

    entry: Entry
    mg: str
    hf: tuple[str, ...]


def local_experts(model: ModelConfig, ep_rank: int, ep: int) -> list[tuple[int, int]]:
    """(local, global) indices of the routed experts EP rank ``ep_rank`` of ``ep`` holds (a contiguous block, as
    megatron's ``local_expert_indices``); none for a dense model."""
    experts = model.text_decoder.num_moe_experts or 0
    per_rank = experts // ep
    return [(e, ep_rank * per_rank + e) for e in range(per_rank)]


def stage_tensors(model: ModelConfig, stage: Stage, ep_rank: int = 0, ep: int = 1) -> list[Bound]:
    """Every Megatron tensor of ``stage`` on EP rank ``ep_rank`` in a fixed order (layer by layer; an expert
    entry for each of the rank's experts), with its HF names."""
    family = model_family(model)
    flags = family.model_flags(model)
    experts = local_experts(model, ep_rank, ep)
    out: list[Bound] = []
    kinds = model.text_decoder.layer_types
    for scope in SCOPES:
        entries = [e for e in family.tensors if e.scope == scope and (e.when is None or flags[e.when])]
        for local, index in stage.layers(scope):
            for e in entries:
                if e.layer is not None and (kinds[index] if kinds else "full_attention") != e.layer:
                    continue
                out += [
                    Bound(e, e.mg.format(i=local, e=mine), tuple(h.format(i=index, e=glob) for h in e.hf))
                    for mine, glob in (experts if e.expert else [(0, 0)])
                ]
    return out


@cache
def _hf_layer_patterns(family: ModelFamily) -> tuple[tuple[re.Pattern[str], Scope], ...]:
    """The HF prefixes of the ViT blocks and LLM layers (up to ``{i}.``), so a stored fused tensor of a layer
    (``...layers.3.mlp.experts.gate_up_proj``) is placed as its per-expert parts are."""
    prefixes = {(h[: h.index("{i}") + 4], e.scope) for e in family.tensors if e.scope in ("vit_layer", "llm_layer")
                for h in e.hf}  # fmt: skip
    return tuple(
        (re.compile(re.escape(prefix).replace(r"\{i\}", r"(?P<i>\d+)")), scope) for prefix, scope in sorted(prefixes)
    )


def hf_layer_index(model: ModelConfig, name: str) -> tuple[Scope, int] | None:
    """(scope, global layer) of an HF layer tensor name; None for other names."""
    for pattern, scope in _hf_layer_patterns(model_family(model)):
        match = pattern.match(name)
        if match:
            return scope, int(match["i"])
    return None


def dropped_layer(model: ModelConfig, name: str) -> bool:
    """A tensor of a layer past model.json's ``num_layers``: left out on purpose (the bottom layers are kept)."""
    found = hf_layer_index(model, name)
    if found is None:
        return False
    kept = model.image_encoder.vision_encoder.num_layers if found[0] == "vit_layer" else model.text_decoder.num_layers
    return found[1] >= kept


def unused_tensor(model: ModelConfig, name: str) -> bool:
    """A checkpoint tensor outside the RL model (the family's ``hf_unused``: Qwen3.5's multi-token prediction)."""
    return name.startswith(model_family(model).hf_unused)


@cache
def _mg_patterns(family: ModelFamily) -> tuple[tuple[re.Pattern[str], Entry], ...]:
    return tuple((name_pattern(e.mg), e) for e in family.tensors)


def entry_for(model: ModelConfig, mg_name: str) -> Entry:
    """The table entry of a Megatron tensor name (any layer index)."""
    family = model_family(model)
    for pattern, entry in _mg_patterns(family):
        if pattern.match(mg_name):
            return entry
    raise ConversionError(f"{mg_name} is not a {family.label} Megatron tensor name known to mm_rl")


def published_name(model: ModelConfig, name: str) -> str:
    """The published HF name of a tensor stored under another spelling (the family's ``hf_aliases``)."""
    for alias, published in model_family(model).hf_aliases:
        if name.startswith(alias):
            return published + name[len(alias) :]
    return name


def module_name(model: ModelConfig, name: str) -> str:
    """transformers' in-memory spelling of a published HF name (the inverse of :func:`published_name`): the
    names PEFT's adapters carry."""
    for alias, published in model_family(model).hf_aliases:
        if name.startswith(published):
            return alias + name[len(published) :]
    return name


# -------------------------------------------------------------------------------------------- pieces
@dataclass(frozen=True)
class Piece:
    """Rows (or columns, along the split dimension) [start, stop) of HF part ``part``."""

    part: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def pieces(entry: Entry, dims: Mapping[str, int], rank: int, tp: int) -> list[Piece]:
    """TP rank ``rank``'s shard of ``entry`` as HF ranges, in the order they are concatenated."""
    if entry.layout in ("qkv", "fused_qkv", "gated_qkv"):
        return _qkv_pieces(entry, dims, rank, tp)
    if entry.layout == "sections":
        return _section_pieces(entry, dims, rank, tp)
    dim = entry.split or 0
    out = []
    for part in range(len(entry.hf)):
        size = hf_shape(entry, part, dims)[dim]
        chunk = size // tp if entry.split is not None else size
        start = rank * chunk if entry.split is not None else 0
        out.append(Piece(part, start, start + chunk))
    return out


def _qkv_pieces(entry: Entry, dims: Mapping[str, int], rank: int, tp: int) -> list[Piece]:
    heads, groups, hd = (dims[name] for name in entry.heads)
    per_group = heads // groups
    if entry.layout == "qkv":  # separate q, k, v tensors
        parts, offsets = (0, 1, 2), (0, 0, 0)
    else:  # one fused [Q; K; V] tensor
        parts, offsets = (0, 0, 0), (0, heads * hd, 2 * heads * hd)
    out = []
    for g in range(rank * groups // tp, (rank + 1) * groups // tp):
        if entry.layout == "gated_qkv":  # q rows [q_h; gate_h] per head -> [q heads of g, their gates, k_g, v_g]
            heads_of_g = range(g * per_group, (g + 1) * per_group)
            out += [Piece(0, 2 * h * hd, (2 * h + 1) * hd) for h in heads_of_g]
            out += [Piece(0, (2 * h + 1) * hd, (2 * h + 2) * hd) for h in heads_of_g]
            out += [Piece(1, g * hd, (g + 1) * hd), Piece(2, g * hd, (g + 1) * hd)]
            continue
        for part, offset, width in zip(parts, offsets, (per_group * hd, hd, hd), strict=True):
            out.append(Piece(part, offset + g * width, offset + (g + 1) * width))
    return out


def _section_pieces(entry: Entry, dims: Mapping[str, int], rank: int, tp: int) -> list[Piece]:
    """Each HF part is blocks along the split dimension (``entry.sections``, e.g. Qwen3.5's ``in_proj_qkv`` = q, k,
    v); rank r holds the r-th chunk of every block, in order: MindSpeed-MM's Gated DeltaNet ``in_proj`` per rank
    [q_r, k_r, v_r, z_r, b_r, a_r] and ``conv1d`` [q_r, k_r, v_r]."""
    out = []
    for part, blocks in enumerate(entry.sections):
        offset = 0
        for name in blocks:
            chunk = dims[name] // tp
            out.append(Piece(part, offset + rank * chunk, offset + (rank + 1) * chunk))
            offset += dims[name]
    return out


def shard_shape(entry: Entry, dims: Mapping[str, int], rank: int, tp: int) -> tuple[int, ...]:
    shape = list(hf_shape(entry, 0, dims))
    shape[entry.split or 0] = sum(p.size for p in pieces(entry, dims, rank, tp))
    return tuple(shape)


# ------------------------------------------------------------------------------------------ transforms
Reader = Callable[[str, int, int, int], torch.Tensor]


def shard_from_hf(
    bound: Bound, dims: Mapping[str, int], rank: int, tp: int, read: Reader, copy: bool = True
) -> torch.Tensor:
    """TP rank ``rank``'s shard of ``bound``: a new compact tensor, or with ``copy=False`` the range ``read``
    returned where the shard is a single range (no copy; possibly a strided view).

    ``read(hf_name, dim, start, stop)`` returns that range of an HF tensor (e.g. a safetensors slice, read from
    disk only then). Adjacent pieces of one part are read in one call (a rank's q heads, its k, its v)."""
    dim = bound.entry.split or 0
    plan = pieces(bound.entry, dims, rank, tp)
    runs: list[Piece] = []
    for piece in sorted(set(plan), key=lambda p: (p.part, p.start)):
        if runs and runs[-1].part == piece.part and runs[-1].stop == piece.start:
            runs[-1] = Piece(piece.part, runs[-1].start, piece.stop)
        else:
            runs.append(piece)
    data = [(run, read(bound.hf[run.part], dim, run.start, run.stop)) for run in runs]
    out = []
    for piece in plan:
        run, tensor = next((r, t) for r, t in data if r.part == piece.part and r.start <= piece.start < r.stop)
        out.append(tensor.narrow(dim, piece.start - run.start, piece.size))
    if len(out) == 1 and not copy:
        return out[0]
    return torch.cat(out, dim)


def check_shards(
    bound: Bound, dims: Mapping[str, int], shards: Sequence[torch.Tensor], where: Sequence[object] = ()
) -> None:
    """Each TP shard must have the shape the model config gives and rank 0's dtype; ``where`` names the shards'
    files in the message. Reads no tensor data."""
    tp = len(shards)
    for rank, shard in enumerate(shards):
        label = f"{where[rank]}: " if where else ""
        want = shard_shape(bound.entry, dims, rank, tp)
        if tuple(shard.shape) != want:
            raise ConversionError(
                f"{label}{bound.mg} (TP rank {rank} of {tp}) has shape {list(shard.shape)}, "
                f"the model config gives {list(want)}"
            )
        if shard.dtype != shards[0].dtype:
            raise ConversionError(f"{label}{bound.mg} is {shard.dtype} on TP rank {rank}, {shards[0].dtype} on 0")


def hf_from_shards(bound: Bound, dims: Mapping[str, int], shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The HF tensors of ``bound`` from its TP shards (rank order); replicated tensors come from rank 0.

    A part made of one block is returned as that block (a view of a shard, no copy)."""
    return [blocks[0] if len(blocks) == 1 else torch.cat(blocks) for blocks in hf_blocks(bound, dims, shards)]


def hf_blocks(bound: Bound, dims: Mapping[str, int], shards: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per HF part, blocks whose concatenation along dim 0 is that part.

    Where TP splits dim 0 the blocks are views of the shards (row ranges), so a writer can stream them without
    assembling the tensor; where it splits dim 1 each row spans every shard and the part is assembled."""
    check_shards(bound, dims, shards)
    entry, tp = bound.entry, len(shards)
    if entry.split is None:
        return [[shards[0]]]
    located = [(piece, rank, offset) for rank in range(tp) for piece, offset in _offsets(pieces(entry, dims, rank, tp))]
    if entry.split == 0:
        return [
            [
                shards[rank].narrow(0, offset, piece.size)
                for piece, rank, offset in sorted(located, key=lambda x: x[0].start)
                if piece.part == part
            ]
            for part in range(len(entry.hf))
        ]
    out = [torch.empty(hf_shape(entry, part, dims), dtype=shards[0].dtype) for part in range(len(entry.hf))]
    for piece, rank, offset in located:
        out[piece.part].narrow(1, piece.start, piece.size).copy_(shards[rank].narrow(1, offset, piece.size))
    return [[tensor] for tensor in out]


def _offsets(plan: list[Piece]) -> list[tuple[Piece, int]]:
    """Each piece with its offset in the shard it is concatenated into."""
    out, offset = [], 0
    for piece in plan:
        out.append((piece, offset))
        offset += piece.size
    return out


def merge_tp_shards(mg_name: str, shards: Sequence[torch.Tensor], model: ModelConfig) -> torch.Tensor:
    """The TP shards of one Megatron tensor (rank order) -> the full tensor in the TP-independent layout (the
    layout at TP = 1), which ``megatron_to_hf`` maps to HF tensors. For the weight sync into vLLM."""
    entry, dims = entry_for(model, mg_name), model_dims(model)
    bound = Bound(entry, mg_name, entry.hf)
    parts = hf_from_shards(bound, dims, shards)
    if len(shards) == 1 or entry.split is None:
        return shards[0]
    return shard_from_hf(bound, dims, 0, 1, lambda name, dim, a, b: parts[entry.hf.index(name)].narrow(dim, a, b - a))


def megatron_to_hf(
    tensors: Iterable[tuple[str, torch.Tensor]],
    model: ModelConfig,
    pipeline: Pipeline,
    pp_rank: int,
    ep_rank: int = 0,
    ep: int = 1,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (TP-merged) Megatron tensors of stage ``pp_rank`` on EP rank ``ep_rank`` -> (HF name, tensor) pairs,
    for the weight sync (experts by their per-expert HF names, which vLLM loads as they are).

    The tied output-layer copy maps to nothing (HF has one embedding); ``_extra_state`` entries are skipped;
    a name the stage does not hold is an error."""
    dims = model_dims(model)
    by_name = {b.mg: b for b in stage_tensors(model, pipeline.stages[pp_rank], ep_rank, ep)}
    for name, tensor in tensors:
        if name.endswith("._extra_state"):
            continue
        bound = by_name.get(name)
        if bound is None:
            raise ConversionError(f"pipeline stage {pp_rank} holds no tensor named {name}")
        if not bound.entry.duplicate:
            yield from zip(bound.hf, hf_from_shards(bound, dims, [tensor]), strict=True)


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor],
    model: ModelConfig,
    pipeline: Pipeline,
    pp_rank: int,
    tp_rank: int,
    ep_rank: int = 0,
    ep: int = 1,
) -> dict[str, torch.Tensor]:
    """In-memory HF state dict (per-expert names) -> the Megatron state dict of one (pp, tp, ep) rank (the same
    rules as hf2mg)."""
    dims = model_dims(model)
    read: Reader = lambda name, dim, a, b: hf[name].narrow(dim, a, b - a)  # noqa: E731
    return {
        b.mg: shard_from_hf(b, dims, tp_rank, pipeline.tp, read)
        for b in stage_tensors(model, pipeline.stages[pp_rank], ep_rank, ep)
    }
