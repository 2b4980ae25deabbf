"""THE mapping between HuggingFace Qwen2.5-VL tensors and Megatron (MindSpeed-MM) tensors.

``TABLE`` is the single source of every rule: for each Megatron tensor, the pipeline part that holds it
(``scope``, see ``stages``), its Megatron name (``{i}``: the layer index local to the stage), the HF tensors it
is made of (``{i}``: the global layer index) with their shapes in model dimensions, how those parts are laid out
in it (``layout``) and which dimension tensor parallelism splits (``split``; None: every rank holds a copy).
hf2mg, mg2hf and the weight sync into vLLM all go through the functions below; no other module names a tensor.

Every layout is expressed as *pieces*: TP rank r's shard of a Megatron tensor is the concatenation, along the
split dimension, of row (or column) ranges of its HF parts. hf2mg reads exactly those ranges from disk; mg2hf
and ``merge_tp_shards`` run the same pieces backwards. Layouts:

- ``plain``: one HF tensor, rank r holds the r-th contiguous chunk along ``split`` (or all of it).
- ``glu``: ``linear_fc1`` = cat(gate, up); rank r holds cat(gate_r, up_r), so each rank can apply
  activation(gate) * up on its own. The TP-merged (full) tensor is cat(gate, up), not cat of the shards.
- ``qkv``: the LLM's separate q/k/v become one tensor interleaved per query group, [q heads of group g, k_g, v_g]
  for g = 0..G-1, so a contiguous chunk gives each rank whole groups.
- ``fused_qkv``: the ViT's fused [Q; K; V] is re-laid per head, [q_h, k_h, v_h] (the ViT has one group per head).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch

from mm_rl.config.schema import ModelConfig
from mm_rl.convert.errors import ConversionError
from mm_rl.convert.stages import Pipeline, Stage

Scope = Literal["patch_embed", "vit_layer", "merger", "embedding", "llm_layer", "final_norm", "output_layer"]
Layout = Literal["plain", "glu", "qkv", "fused_qkv"]
Shape = tuple[str, ...]
SCOPES: tuple[Scope, ...] = ("patch_embed", "vit_layer", "merger", "embedding", "llm_layer", "final_norm",
                             "output_layer")


@dataclass(frozen=True)
class Entry:
    """One Megatron tensor and the HF tensors it is made of; see the module docstring."""

    scope: Scope
    mg: str
    hf: tuple[str, ...]
    shapes: tuple[Shape, ...]  # per HF part, in the dimension names of ``model_dims``
    layout: Layout = "plain"
    split: int | None = None  # the TP split dimension of the Megatron tensor; None = replicated
    heads: tuple[str, str, str] = ("", "", "")  # qkv layouts: dimension names of (heads, groups, head_dim)
    when: str | None = None  # a ``model_flags`` key: the tensor exists only when that flag is true
    duplicate: bool = False  # a Megatron-only copy of another entry's HF tensor (tied output layer)

    @property
    def component(self) -> Literal["vit", "merger", "llm"]:
        if self.scope in ("patch_embed", "vit_layer"):
            return "vit"
        return "merger" if self.scope == "merger" else "llm"


_V, _VH = "image_encoder.encoder.blocks.layers.{i}.", "visual.blocks.{i}."
_L, _LH = "text_decoder.decoder.layers.{i}.", "model.layers.{i}."
_P, _PH = "image_encoder.projector.", "visual.merger."
_VIT_HEADS = ("vheads", "vheads", "vhd")
_LLM_HEADS = ("heads", "groups", "hd")
_VLIN, _VQKV, _LQKV = "vit_linear_bias", "vit_qkv_bias", "llm_qkv_bias"

TABLE: tuple[Entry, ...] = (
    Entry("patch_embed", "image_encoder.encoder.patch_embed.proj.weight", ("visual.patch_embed.proj.weight",),
          (("vh", "cin", "tps", "ps", "ps"),)),
    Entry("vit_layer", _V + "input_layernorm.weight", (_VH + "norm1.weight",), (("vh",),)),
    Entry("vit_layer", _V + "self_attention.linear_qkv.weight", (_VH + "attn.qkv.weight",), (("vqkv", "vh"),),
          "fused_qkv", 0, _VIT_HEADS),
    Entry("vit_layer", _V + "self_attention.linear_qkv.bias", (_VH + "attn.qkv.bias",), (("vqkv",),),
          "fused_qkv", 0, _VIT_HEADS, when=_VQKV),
    Entry("vit_layer", _V + "self_attention.linear_proj.weight", (_VH + "attn.proj.weight",), (("vh", "vattn"),),
          split=1),
    Entry("vit_layer", _V + "self_attention.linear_proj.bias", (_VH + "attn.proj.bias",), (("vh",),), when=_VLIN),
    Entry("vit_layer", _V + "pre_mlp_layernorm.weight", (_VH + "norm2.weight",), (("vh",),)),
    Entry("vit_layer", _V + "mlp.linear_fc1.weight", (_VH + "mlp.gate_proj.weight", _VH + "mlp.up_proj.weight"),
          (("vffn", "vh"), ("vffn", "vh")), "glu", 0),
    Entry("vit_layer", _V + "mlp.linear_fc1.bias", (_VH + "mlp.gate_proj.bias", _VH + "mlp.up_proj.bias"),
          (("vffn",), ("vffn",)), "glu", 0, when=_VLIN),
    Entry("vit_layer", _V + "mlp.linear_fc2.weight", (_VH + "mlp.down_proj.weight",), (("vh", "vffn"),), split=1),
    Entry("vit_layer", _V + "mlp.linear_fc2.bias", (_VH + "mlp.down_proj.bias",), (("vh",),), when=_VLIN),
    Entry("merger", _P + "layernorm.weight", (_PH + "ln_q.weight",), (("pin",),)),
    Entry("merger", _P + "encoder.linear_fc1.weight", (_PH + "mlp.0.weight",), (("pffn", "pcat"),), split=0),
    Entry("merger", _P + "encoder.linear_fc1.bias", (_PH + "mlp.0.bias",), (("pffn",),), split=0),
    Entry("merger", _P + "encoder.linear_fc2.weight", (_PH + "mlp.2.weight",), (("ph", "pffn"),), split=1),
    Entry("merger", _P + "encoder.linear_fc2.bias", (_PH + "mlp.2.bias",), (("ph",),)),
    Entry("embedding", "text_decoder.embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
          (("vocab", "h"),), split=0),
    Entry("llm_layer", _L + "input_layernorm.weight", (_LH + "input_layernorm.weight",), (("h",),)),
    Entry("llm_layer", _L + "self_attention.linear_qkv.weight",
          (_LH + "self_attn.q_proj.weight", _LH + "self_attn.k_proj.weight", _LH + "self_attn.v_proj.weight"),
          (("q", "h"), ("kv", "h"), ("kv", "h")), "qkv", 0, _LLM_HEADS),
    Entry("llm_layer", _L + "self_attention.linear_qkv.bias",
          (_LH + "self_attn.q_proj.bias", _LH + "self_attn.k_proj.bias", _LH + "self_attn.v_proj.bias"),
          (("q",), ("kv",), ("kv",)), "qkv", 0, _LLM_HEADS, when=_LQKV),
    Entry("llm_layer", _L + "self_attention.linear_proj.weight", (_LH + "self_attn.o_proj.weight",), (("h", "q"),),
          split=1),
    Entry("llm_layer", _L + "pre_mlp_layernorm.weight", (_LH + "post_attention_layernorm.weight",), (("h",),)),
    Entry("llm_layer", _L + "mlp.linear_fc1.weight", (_LH + "mlp.gate_proj.weight", _LH + "mlp.up_proj.weight"),
          (("ffn", "h"), ("ffn", "h")), "glu", 0),
    Entry("llm_layer", _L + "mlp.linear_fc2.weight", (_LH + "mlp.down_proj.weight",), (("h", "ffn"),), split=1),
    Entry("final_norm", "text_decoder.decoder.final_layernorm.weight", ("model.norm.weight",), (("h",),)),
    Entry("output_layer", "text_decoder.output_layer.weight", ("lm_head.weight",), (("vocab", "h"),), split=0,
          when="untied"),
    Entry("output_layer", "text_decoder.output_layer.weight", ("model.embed_tokens.weight",), (("vocab", "h"),),
          split=0, when="tied", duplicate=True),
)

# Other spellings of the published HF names, mapped to the published ones when reading (newer transformers
# releases nest the LLM and the ViT under ``model.``). Output is always written with the published names.
HF_ALIASES: tuple[tuple[str, str], ...] = (("model.language_model.", "model."), ("model.visual.", "visual."))


# ------------------------------------------------------------------------------------------ model sizes
def model_dims(model: ModelConfig) -> dict[str, int]:
    """The dimension names used in ``Entry.shapes``, from model.json."""
    text, vit = model.text_decoder, model.image_encoder.vision_encoder
    proj = model.image_encoder.vision_projector
    groups = text.num_query_groups if text.group_query_attention else text.num_attention_heads
    hd = text.kv_channels or text.hidden_size // text.num_attention_heads
    vhd = vit.hidden_size // vit.num_attention_heads
    return {
        "vocab": text.vocab_size, "h": text.hidden_size, "ffn": text.ffn_hidden_size,
        "heads": text.num_attention_heads, "groups": groups, "hd": hd,
        "q": text.num_attention_heads * hd, "kv": groups * hd,
        "vh": vit.hidden_size, "vffn": vit.ffn_hidden_size, "vheads": vit.num_attention_heads, "vhd": vhd,
        "vattn": vit.num_attention_heads * vhd, "vqkv": 3 * vit.num_attention_heads * vhd,
        "cin": vit.in_channels, "tps": vit.temporal_patch_size, "ps": vit.patch_size,
        "pin": proj.input_size, "pcat": proj.input_size * vit.spatial_merge_size ** 2,
        "pffn": proj.ffn_hidden_size, "ph": proj.hidden_size,
    }


def model_flags(model: ModelConfig) -> dict[str, bool]:
    """The switches named by ``Entry.when``."""
    text, vit = model.text_decoder, model.image_encoder.vision_encoder
    return {"vit_qkv_bias": vit.add_qkv_bias, "vit_linear_bias": vit.add_bias_linear,
            "llm_qkv_bias": text.add_qkv_bias, "untied": text.untie_embeddings_and_output_weights,
            "tied": not text.untie_embeddings_and_output_weights}


def hf_shape(entry: Entry, part: int, dims: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(dims[name] for name in entry.shapes[part])


# ---------------------------------------------------------------------------------- tensors of a stage
@dataclass(frozen=True)
class Bound:
    """An entry placed on a stage: the concrete Megatron name and HF names."""

    entry: Entry
    mg: str
    hf: tuple[str, ...]


def stage_tensors(model: ModelConfig, stage: Stage) -> list[Bound]:
    """Every Megatron tensor of ``stage`` in a fixed order (layer by layer), with its HF names."""
    flags = model_flags(model)
    out: list[Bound] = []
    for scope in SCOPES:
        entries = [e for e in TABLE if e.scope == scope and (e.when is None or flags[e.when])]
        for local, index in stage.layers(scope):
            out += [Bound(e, e.mg.format(i=local), tuple(h.format(i=index) for h in e.hf)) for e in entries]
    return out


@cache
def _hf_layer_patterns() -> tuple[tuple[re.Pattern[str], Scope], ...]:
    return tuple((re.compile(re.escape(h).replace(r"\{i\}", r"(\d+)") + "$"), e.scope)
                 for e in TABLE if e.scope in ("vit_layer", "llm_layer") for h in e.hf)


def hf_layer_index(name: str) -> tuple[Scope, int] | None:
    """(scope, global layer) of an HF layer tensor name; None for other names."""
    for pattern, scope in _hf_layer_patterns():
        match = pattern.match(name)
        if match:
            return scope, int(match.group(1))
    return None


@cache
def _mg_patterns() -> tuple[tuple[re.Pattern[str], Entry], ...]:
    return tuple((re.compile(re.escape(e.mg).replace(r"\{i\}", r"\d+") + "$"), e) for e in TABLE)


def entry_for(mg_name: str) -> Entry:
    """The table entry of a Megatron tensor name (any layer index)."""
    for pattern, entry in _mg_patterns():
        if pattern.match(mg_name):
            return entry
    raise ConversionError(f"{mg_name} is not a Qwen2.5-VL Megatron tensor name known to mm_rl.convert.mapping")


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
    if entry.layout in ("qkv", "fused_qkv"):
        return _qkv_pieces(entry, dims, rank, tp)
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
        for part, offset, width in zip(parts, offsets, (per_group * hd, hd, hd), strict=True):
            out.append(Piece(part, offset + g * width, offset + (g + 1) * width))
    return out


def shard_shape(entry: Entry, dims: Mapping[str, int], rank: int, tp: int) -> tuple[int, ...]:
    shape = list(hf_shape(entry, 0, dims))
    shape[entry.split or 0] = sum(p.size for p in pieces(entry, dims, rank, tp))
    return tuple(shape)


# ------------------------------------------------------------------------------------------ transforms
Reader = Callable[[str, int, int, int], torch.Tensor]


def shard_from_hf(bound: Bound, dims: Mapping[str, int], rank: int, tp: int, read: Reader,
                  copy: bool = True) -> torch.Tensor:
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


def check_shards(bound: Bound, dims: Mapping[str, int], shards: Sequence[torch.Tensor],
                 where: Sequence[object] = ()) -> None:
    """Each TP shard must have the shape the model config gives and rank 0's dtype; ``where`` names the shards'
    files in the message. Reads no tensor data."""
    tp = len(shards)
    for rank, shard in enumerate(shards):
        label = f"{where[rank]}: " if where else ""
        want = shard_shape(bound.entry, dims, rank, tp)
        if tuple(shard.shape) != want:
            raise ConversionError(f"{label}{bound.mg} (TP rank {rank} of {tp}) has shape {list(shard.shape)}, "
                                  f"the model config gives {list(want)}")
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
    located = [(piece, rank, offset) for rank in range(tp)
               for piece, offset in _offsets(pieces(entry, dims, rank, tp))]
    if entry.split == 0:
        return [[shards[rank].narrow(0, offset, piece.size)
                 for piece, rank, offset in sorted(located, key=lambda x: x[0].start) if piece.part == part]
                for part in range(len(entry.hf))]
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
    entry, dims = entry_for(mg_name), model_dims(model)
    bound = Bound(entry, mg_name, entry.hf)
    parts = hf_from_shards(bound, dims, shards)
    if len(shards) == 1 or entry.split is None:
        return shards[0]
    return shard_from_hf(bound, dims, 0, 1, lambda name, dim, a, b: parts[entry.hf.index(name)].narrow(dim, a, b - a))


def megatron_to_hf(tensors: Iterable[tuple[str, torch.Tensor]], model: ModelConfig, pipeline: Pipeline,
                   pp_rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (TP-merged) Megatron tensors of stage ``pp_rank`` -> (HF name, tensor) pairs, for the weight sync.

    The tied output-layer copy maps to nothing (HF has one embedding); ``_extra_state`` entries are skipped;
    a name the stage does not hold is an error."""
    dims = model_dims(model)
    by_name = {b.mg: b for b in stage_tensors(model, pipeline.stages[pp_rank])}
    for name, tensor in tensors:
        if name.endswith("._extra_state"):
            continue
        bound = by_name.get(name)
        if bound is None:
            raise ConversionError(f"pipeline stage {pp_rank} holds no tensor named {name}")
        if not bound.entry.duplicate:
            yield from zip(bound.hf, hf_from_shards(bound, dims, [tensor]), strict=True)


def hf_to_megatron(hf: Mapping[str, torch.Tensor], model: ModelConfig, pipeline: Pipeline, pp_rank: int,
                   tp_rank: int) -> dict[str, torch.Tensor]:
    """In-memory HF state dict -> the Megatron state dict of one (pp, tp) rank (the same rules as hf2mg)."""
    dims = model_dims(model)
    read: Reader = lambda name, dim, a, b: hf[name].narrow(dim, a, b - a)  # noqa: E731
    return {b.mg: shard_from_hf(b, dims, tp_rank, pipeline.tp, read)
            for b in stage_tensors(model, pipeline.stages[pp_rank])}
