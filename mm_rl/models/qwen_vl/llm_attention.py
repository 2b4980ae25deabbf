"""The LLM's core attention, and packed micro-batches (padding removed).

A micro-batch arrives as padded rows [B, S]. With ``remove_padding`` (the default) the model packs the real
tokens of its rows into one row [1, T] (:class:`PackedRows`; verl's ``use_remove_padding``): every linear layer,
the norms and the output layer then work on T tokens instead of B x S, and the mRoPE positions, computed per row
first, travel with the tokens they belong to. Attention must not cross from one sequence into the next:
:class:`CausalSegments` (megatron's ``packed_seq_params``, handed by ``TransformerBlock`` to every layer unchanged)
carries each sequence's span. ``qkv_format`` stays ``"sbhd"``, so megatron applies the rotary embedding per token,
from the packed positions. The n samples of a GRPO group repeat one prompt: a packed row holds it once and the
later samples' tokens attend to it there (shared prompts, :class:`PackedRows`), exactly what each row computed
whole, at a fraction of the positions when prompts (images included) are long beside the responses.

:class:`LLMCoreAttention` never holds S x S scores (megatron's local ``DotProductAttention`` keeps them, and their
fp32 softmax, for backward: ~0.94 GB per layer at S 4096 and 28 heads): a packed row runs torch's
``scaled_dot_product_attention``, causal, on each span (the flash kernel on CPU), or in bf16 / fp16 one varlen call
for all spans: on CUDA (Ampere+) torch's flash-attention ``varlen_attn``, on Ascend ``npu_fusion_attention``'s TND
form (as MindSpeed's core attention runs packed sequences); padded rows run SDPA with the causal padding mask.
Ulysses CP wraps it. Transformer Engine's layer spec is not used: its fused norm-linear modules rename the
parameters (a second checkpoint mapping), and for this attention it would run the same flash kernel.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from torch import Tensor


@dataclass(frozen=True)
class PackedRows:
    """Padded rows [B, S] (``valid``: their attention mask) as one packed row [1, T] of the real tokens, in row
    order, and back. Where the padding sits does not matter: a row's real tokens become one sequence that
    attends causally within itself, which is what the padded row computes with its padding hidden.

    Shared prompts (``shared`` [B]): row b > 0 may name how many leading tokens it has in common with the row
    before it (the n samples of a GRPO group share their prompt); those are left out of the packed row and the
    rest of row b (its tail) attends to the first row of its run for them (:class:`CausalSegments` contexts).
    Every kept token computes what it computed in its own row, and a prompt of P tokens costs the LLM P + n - 1
    positions instead of n x P. The first row of a run has ``shared`` 0; a tail keeps at least the last shared
    position's successor, so the token that predicts the first response token stays in every row."""

    valid: Tensor
    keep: Tensor  # [B, S] the tokens the packed row holds
    contexts: tuple[tuple[int, int], ...] = ()  # per row, the (start, end) of its shared tokens in the packed row

    @classmethod
    def of(cls, input_ids: Tensor, attention_mask: Tensor | None, shared: Tensor | None = None) -> PackedRows:
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if shared is None or not bool((shared > 0).any()):
            return cls(valid, valid)
        shared = shared.to(valid.device).clone()
        shared[0] = 0  # the first row has no row before it (a micro-batch cut out of a larger one)
        positions = torch.arange(valid.shape[1], device=valid.device)
        keep = valid & (positions[None, :] >= shared[:, None])
        starts = torch.cat([keep.new_zeros(1, dtype=torch.long), keep.sum(-1).cumsum(0)[:-1]]).tolist()
        contexts, first = [], 0
        for row, count in enumerate(shared.tolist()):
            if count <= 0:
                first = row
            contexts.append((starts[first], starts[first] + count) if count > 0 else (0, 0))
        return cls(valid, keep, tuple(contexts))

    @property
    def lengths(self) -> Tensor:
        return self.keep.sum(-1)

    def pack(self, x: Tensor | None) -> Tensor | None:
        """[..., B, S] -> [..., 1, T]."""
        return None if x is None else x[..., self.keep].unsqueeze(-2)

    def unpack(self, x: Tensor) -> Tensor:
        """[1, T, ...] -> [B, S, ...] with zeros at the padding and the shared tokens (out of place: gradients reach
        ``x``)."""
        rows, cols = self.keep.nonzero(as_tuple=True)
        out = x.new_zeros(*self.keep.shape, *x.shape[2:])
        return out.index_put((rows, cols), x[0, : rows.numel()])

    def image_rows(self, vision: Tensor) -> Tensor | None:
        """Which rows of the micro-batch's image embeddings (one per image or video token of the rows, ``vision``
        [B, S] bool, in row order) the packed row still holds; None when it holds all of them (no shared prompt)."""
        if not self.contexts:
            return None
        pads = vision & self.valid
        order = pads.reshape(-1).long().cumsum(0) - 1
        return order[(pads & self.keep).reshape(-1)]

    def segments(self, total: int) -> CausalSegments:
        """The attention segments of the packed row padded to ``total`` tokens (the padding its own segment)."""
        bounds = torch.cat([self.lengths.new_zeros(1), self.lengths.cumsum(0)])
        contexts = list(self.contexts)
        if total > int(bounds[-1]):
            bounds = torch.cat([bounds, bounds.new_tensor([total])])
            contexts += [(0, 0)] if contexts else []
        return CausalSegments.build(bounds.to(torch.int32), contexts)


@dataclass
class CausalSegments(PackedSeqParams):
    """The sequences of a packed row, passed to every LLM layer as ``packed_seq_params``: ``cu_seqlens`` and, read
    once on the host, the (start, end) of each, and per sequence the (start, end) of the earlier tokens it also
    attends to, all of them (a shared prompt, :class:`PackedRows`; (0, 0): none). With contexts, the varlen
    kernels' keys and values are each sequence's context then itself (``kv_index``, ``cu_seqlens_kv``), and the
    causal mask is aligned to the end of the keys (flash attention's and ``npu_fusion_attention``'s sparse mode 3
    alignment for queries shorter than keys)."""

    spans: list[tuple[int, int]] = field(default_factory=list, repr=False)
    contexts: list[tuple[int, int]] = field(default_factory=list, repr=False)
    kv_index: Tensor | None = field(default=None, repr=False)
    kv_ends: list[int] = field(default_factory=list, repr=False)  # cu_seqlens_kv[1:], read on the host
    masks: dict[tuple[int, int], Tensor] = field(default_factory=dict, repr=False)
    # what another layer kind derives once per micro-batch for all its layers (Qwen3.5's Gated DeltaNet batch)
    derived: dict[Any, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, cu_seqlens: Tensor, contexts: list[tuple[int, int]] | None = None) -> CausalSegments:
        bounds = cu_seqlens.tolist()
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        contexts = contexts if contexts and any(b > a for a, b in contexts) else []
        longest = max((b - a for a, b in spans), default=0)
        cu_kv, kv_ends, kv_index = cu_seqlens, bounds[1:], None
        if contexts:  # the keys: each sequence's context, then itself
            ranges = [r for (a, b), (c0, c1) in zip(spans, contexts, strict=True) for r in ((c0, c1), (a, b))]
            kv_ends = list(itertools.accumulate(b - a for a, b in ranges))[1::2]
            cu_kv = torch.tensor([0, *kv_ends], dtype=cu_seqlens.dtype, device=cu_seqlens.device)
            kv_index = torch.cat([torch.arange(a, b) for a, b in ranges]).to(cu_seqlens.device)
        return cls(
            qkv_format="sbhd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_kv,
            max_seqlen_q=longest,
            max_seqlen_kv=max(b - a for a, b in itertools.pairwise([0, *kv_ends])) if kv_ends else 0,
            spans=spans,
            contexts=contexts,
            kv_index=kv_index,
            kv_ends=kv_ends,
        )

    def context(self, span: int) -> tuple[int, int]:
        return self.contexts[span] if self.contexts else (0, 0)

    @functools.cached_property
    def pieces(self) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
        """The row cut at every sequence and context boundary: the pieces' sizes, and per non-empty sequence the
        pieces of its context (none without) and its own, in order."""
        cuts = sorted({0, *(p for span in self.spans for p in span), *(p for c in self.contexts for p in c if c[1])})
        at = {position: index for index, position in enumerate(cuts)}
        sizes = [b - a for a, b in itertools.pairwise(cuts)]
        plan = []
        for i, (a, b) in enumerate(self.spans):
            if b > a:
                c0, c1 = self.context(i)
                plan.append((list(range(at[c0], at[c1])) if c1 > c0 else [], list(range(at[a], at[b]))))
        return sizes, plan

    def mask(self, queries: int, context: int, device: torch.device) -> Tensor:
        """[queries, context + queries] True where a query of a sequence with a context may attend (the whole
        context, then causally within the sequence), kept for the other layers."""
        key = (queries, context)
        if key not in self.masks:
            self.masks[key] = torch.ones(queries, context + queries, dtype=torch.bool, device=device).tril(context)
        return self.masks[key]


class LLMCoreAttention(MegatronModule):
    """Causal core attention of the LLM: within each sequence for a packed row (:class:`CausalSegments`), else over
    padded rows with the model's padding mask (see the module docstring). Takes the arguments megatron's
    ``SelfAttention`` gives any core attention; q, k, v are [s, b, heads, head_dim] (k, v with the query groups), the
    output [s, b, heads * head_dim]."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if config.apply_query_key_layer_scaling or config.attention_dropout:
            raise ValueError("the LLM's core attention takes neither query-key layer scaling nor attention dropout")
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("the LLM's core attention takes no attention bias")
        if isinstance(packed_seq_params, CausalSegments):
            if query.size(1) != 1:
                raise ValueError(f"a packed micro-batch is one row, got {query.size(1)}")
            if query.device.type == "npu" and query.dtype in (torch.bfloat16, torch.float16):
                return self._npu_varlen(query, key, value, packed_seq_params)
            if _cuda_flash_varlen(query):
                return self._cuda_varlen(query, key, value, packed_seq_params)
            return self._segments(query, key, value, packed_seq_params)
        return self._padded(query, key, value, attention_mask)

    def _segments(self, query: Tensor, key: Tensor, value: Tensor, segments: CausalSegments) -> Tensor:
        # [1, h, s, d]: SDPA's fused kernels take 4-d inputs only (3-d ones fall back to the math kernel, which
        # keeps the S x S probabilities for backward; torch 2.13, CPU)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        heads, head_dim = q.shape[1], q.shape[3]
        native = q.device.type == "cpu"  # grouped-query heads native in SDPA (torch's CPU flash kernel), no copies
        if not native:
            k, v = _expand_groups(k, v, heads, dim=1)
        # One split into the pieces between every sequence and context boundary: its backward is one concatenation,
        # where slicing each sequence out would give each a zero-filled gradient of the whole row (CPU: as costly as
        # the attention itself at tens of sequences per micro-batch).
        sizes, plan = segments.pieces
        qs, ks, vs = (torch.split(t, sizes, dim=2) for t in (q, k, v))
        outputs = []
        for context, own in plan:
            keys = [*context, *own]
            mask = (
                segments.mask(sum(sizes[i] for i in own), sum(sizes[i] for i in context), q.device) if context else None
            )
            outputs.append(
                F.scaled_dot_product_attention(
                    _joined(qs, own),
                    _joined(ks, keys),
                    _joined(vs, keys),
                    attn_mask=mask,
                    is_causal=mask is None,
                    scale=self.softmax_scale,
                    enable_gqa=native and k.shape[1] != heads,
                )
            )
        return torch.cat(outputs, dim=2).permute(2, 0, 1, 3).reshape(-1, 1, heads * head_dim)

    def _npu_varlen(self, query: Tensor, key: Tensor, value: Tensor, segments: CausalSegments) -> Tensor:
        """All spans in one ``torch_npu.npu_fusion_attention`` call: layout TND, ``actual_seq_qlen`` the spans'
        cumulative ends, ``sparse_mode`` 3 (causal within each sequence) with the 2048 x 2048 upper-triangular
        mask that mode takes, grouped-query heads native (Nq / Nkv an integer). With shared prompts the keys are
        each sequence's context then itself (``actual_seq_kvlen`` their ends) and mode 3's causal mask is aligned
        to the end of the keys. The call and its constraints: MindSpeed's docs/zh/ops/fusion_attention.md and
        mindspeed/core/context_parallel/dot_product_attention.py."""
        import torch_npu  # type: ignore[import-not-found]

        q, k, v = (t.squeeze(1) for t in (query, key, value))  # [T, heads, d]
        k, v = _with_contexts(k, v, segments)
        ends = [b for _, b in segments.spans]
        out = torch_npu.npu_fusion_attention(
            q,
            k,
            v,
            q.shape[1],
            "TND",
            atten_mask=_npu_causal_mask(q.device),
            scale=self.softmax_scale,
            sparse_mode=3,
            actual_seq_qlen=ends,
            actual_seq_kvlen=segments.kv_ends,
        )[0]
        return out.reshape(-1, 1, q.shape[1] * q.shape[2])

    def _cuda_varlen(self, query: Tensor, key: Tensor, value: Tensor, segments: CausalSegments) -> Tensor:
        """All spans in one flash-attention varlen call (``torch.nn.attention.varlen.varlen_attn``): [T, heads, d]
        with the spans' cumulative ends, causal within each sequence (``window_size`` (-1, 0)), grouped-query heads
        native; one kernel per layer instead of one SDPA call per sequence. With shared prompts the keys are each
        sequence's context then itself; flash attention aligns the causal window to the end of the keys."""
        from torch.nn.attention.varlen import varlen_attn

        q, k, v = (t.squeeze(1) for t in (query, key, value))  # [T, heads, d]
        k, v = _with_contexts(k, v, segments)
        bounds = segments.cu_seqlens_q.to(device=q.device, dtype=torch.int32)
        kv_bounds = segments.cu_seqlens_kv.to(device=q.device, dtype=torch.int32)
        out = varlen_attn(
            q,
            k,
            v,
            bounds,
            kv_bounds,
            segments.max_seqlen_q,
            segments.max_seqlen_kv,
            scale=self.softmax_scale,
            window_size=(-1, 0),
            enable_gqa=k.shape[1] != q.shape[1],
        )
        return out.reshape(-1, 1, q.shape[1] * q.shape[2])

    def _padded(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None) -> Tensor:
        """Rows [s, b, ...] with the model's mask ([b, 1, s, s], True = may attend, see
        ``model.padding_attention_mask``; None = plain causal)."""
        seq, rows, heads, head_dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        k, v = _expand_groups(k, v, heads, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None, scale=self.softmax_scale
        )
        return out.permute(2, 0, 1, 3).reshape(seq, rows, heads * head_dim)


def _joined(pieces: tuple[Tensor, ...], indices: list[int]) -> Tensor:
    """The pieces ``indices`` (consecutive along the sequence, or a context then a sequence) as one [1, h, s, d]."""
    return pieces[indices[0]] if len(indices) == 1 else torch.cat([pieces[i] for i in indices], dim=2)


def _with_contexts(k: Tensor, v: Tensor, segments: CausalSegments) -> tuple[Tensor, Tensor]:
    """Keys and values [T, heads, d] laid out for the varlen kernels: each sequence's context, then itself (as
    they are when no sequence has a context)."""
    if segments.kv_index is None:
        return k, v
    index = segments.kv_index.to(k.device)
    return k.index_select(0, index), v.index_select(0, index)


def _expand_groups(k: Tensor, v: Tensor, heads: int, dim: int) -> tuple[Tensor, Tensor]:
    """Grouped-query attention for SDPA: each key / value head repeated for the query heads it serves."""
    if k.shape[dim] == heads:
        return k, v
    return k.repeat_interleave(heads // k.shape[dim], dim=dim), v.repeat_interleave(heads // v.shape[dim], dim=dim)


def _cuda_flash_varlen(query: Tensor) -> bool:
    """Whether a packed row can take torch's flash varlen kernel: CUDA, half precision, Ampere or newer (flash
    attention's floor), and a torch that has it (``torch.nn.attention.varlen``, torch 2.10+)."""
    if not (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)):
        return False
    import importlib.util

    return importlib.util.find_spec("torch.nn.attention.varlen") is not None and torch.cuda.get_device_capability(
        query.device
    ) >= (8, 0)


@functools.cache
def _npu_causal_mask(device: torch.device) -> Tensor:
    """The fixed causal mask ``npu_fusion_attention``'s sparse_mode 3 takes (True = hidden)."""
    return torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(1)
