"""The LLM's core attention, and packed micro-batches (padding removed).

A micro-batch arrives as padded rows [B, S]. With ``remove_padding`` (the default) the model packs the real
tokens of its rows into one row [1, T] (:class:`PackedRows`; verl's ``use_remove_padding``): every linear layer,
the norms and the output layer then work on T tokens instead of B x S, and the mRoPE positions, computed per row
first, travel with the tokens they belong to. Attention must not cross from one sequence into the next:
:class:`CausalSegments` (megatron's ``packed_seq_params``, handed by ``TransformerBlock`` to every layer unchanged)
carries each sequence's span. ``qkv_format`` stays ``"sbhd"``, so megatron applies the rotary embedding per token,
from the packed positions.

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
    attends causally within itself, which is what the padded row computes with its padding hidden."""

    valid: Tensor

    @classmethod
    def of(cls, input_ids: Tensor, attention_mask: Tensor | None) -> PackedRows:
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        return cls(valid)

    @property
    def lengths(self) -> Tensor:
        return self.valid.sum(-1)

    def pack(self, x: Tensor | None) -> Tensor | None:
        """[..., B, S] -> [..., 1, T]."""
        return None if x is None else x[..., self.valid].unsqueeze(-2)

    def unpack(self, x: Tensor) -> Tensor:
        """[1, T, ...] -> [B, S, ...] with zeros at the padding (out of place: gradients reach ``x``)."""
        rows, cols = self.valid.nonzero(as_tuple=True)
        out = x.new_zeros(*self.valid.shape, *x.shape[2:])
        return out.index_put((rows, cols), x[0, : rows.numel()])

    def segments(self, total: int) -> CausalSegments:
        """The attention segments of the packed row padded to ``total`` tokens (the padding its own segment)."""
        bounds = torch.cat([self.lengths.new_zeros(1), self.lengths.cumsum(0)])
        if total > int(bounds[-1]):
            bounds = torch.cat([bounds, bounds.new_tensor([total])])
        return CausalSegments.build(bounds.to(torch.int32))


@dataclass
class CausalSegments(PackedSeqParams):
    """The sequences of a packed row, passed to every LLM layer as ``packed_seq_params``: ``cu_seqlens`` and, read
    once on the host, the (start, end) of each."""

    spans: list[tuple[int, int]] = field(default_factory=list, repr=False)

    @classmethod
    def build(cls, cu_seqlens: Tensor) -> CausalSegments:
        bounds = cu_seqlens.tolist()
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        longest = max((b - a for a, b in spans), default=0)
        return cls(
            qkv_format="sbhd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
            spans=spans,
        )


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
        k, v = _expand_groups(k, v, heads, dim=1)
        # The sequences are contiguous spans: slices (views, whose backward is a plain copy) rather than a gather
        # of equally long ones, whose backward would be an accumulating scatter (slow on the CPU).
        outputs = [
            F.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=self.softmax_scale
            )
            for a, b in segments.spans
            if b > a
        ]
        return torch.cat(outputs, dim=2).permute(2, 0, 1, 3).reshape(-1, 1, heads * head_dim)

    def _npu_varlen(self, query: Tensor, key: Tensor, value: Tensor, segments: CausalSegments) -> Tensor:
        """All spans in one ``torch_npu.npu_fusion_attention`` call: layout TND, ``actual_seq_qlen`` the spans'
        cumulative ends, ``sparse_mode`` 3 (causal within each sequence) with the 2048 x 2048 upper-triangular
        mask that mode takes, grouped-query heads native (Nq / Nkv an integer). The call and its constraints:
        MindSpeed's docs/zh/ops/fusion_attention.md and mindspeed/core/context_parallel/dot_product_attention.py."""
        import torch_npu  # type: ignore[import-not-found]

        q, k, v = (t.squeeze(1) for t in (query, key, value))  # [T, heads, d]
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
            actual_seq_kvlen=ends,
        )[0]
        return out.reshape(-1, 1, q.shape[1] * q.shape[2])

    def _cuda_varlen(self, query: Tensor, key: Tensor, value: Tensor, segments: CausalSegments) -> Tensor:
        """All spans in one flash-attention varlen call (``torch.nn.attention.varlen.varlen_attn``): [T, heads, d]
        with the spans' cumulative ends, causal within each sequence (``window_size`` (-1, 0)), grouped-query heads
        native; one kernel per layer instead of one SDPA call per sequence."""
        from torch.nn.attention.varlen import varlen_attn

        q, k, v = (t.squeeze(1) for t in (query, key, value))  # [T, heads, d]
        bounds = segments.cu_seqlens_q.to(device=q.device, dtype=torch.int32)
        out = varlen_attn(
            q,
            k,
            v,
            bounds,
            bounds,
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
