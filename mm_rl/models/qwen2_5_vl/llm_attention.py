"""The LLM's core attention, and packed micro-batches (padding removed).

A micro-batch arrives as padded rows [B, S]. With ``remove_padding`` (the default) the model packs the real
tokens of its rows into one row [1, T] (:class:`PackedRows`; verl's ``use_remove_padding``): every linear layer,
the norms and the output layer then work on T tokens instead of B x S, and the mRoPE positions, computed per row
first, travel with the tokens they belong to. Attention must not cross from one sequence into the next:
:class:`CausalSegments` (megatron's ``packed_seq_params``, handed by ``TransformerBlock`` to every layer unchanged)
carries each sequence's span, and :class:`LLMCoreAttention` runs torch's ``scaled_dot_product_attention``, causal,
on each span. Without segments it is megatron's own ``DotProductAttention`` (dense scores with a causal or padding
mask). ``qkv_format`` stays ``"sbhd"``, so
megatron applies the rotary embedding per token, from the packed positions.
"""

from __future__ import annotations

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
        return out.index_put((rows, cols), x[0, :rows.numel()])

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
        return cls(qkv_format="sbhd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=longest,
                   max_seqlen_kv=longest, spans=spans)


class LLMCoreAttention(MegatronModule):
    """Causal core attention of the LLM: within each sequence for a packed row (:class:`CausalSegments`), else
    megatron's ``DotProductAttention``. Takes the arguments megatron's ``SelfAttention`` gives any core attention;
    q, k, v are [s, b, heads, head_dim] (k, v with the query groups), the output [s, b, heads * head_dim]."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        super().__init__(config=config)
        self.dense = DotProductAttention(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                                         softmax_scale, cp_comm_type, pg_collection)
        if config.apply_query_key_layer_scaling or config.attention_dropout:
            raise ValueError("packed attention takes neither query-key layer scaling nor attention dropout")
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> Tensor:
        if not isinstance(packed_seq_params, CausalSegments):
            return self.dense(query, key, value, attention_mask, attn_mask_type=attn_mask_type,  # type: ignore[no-any-return]
                              attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if query.size(1) != 1:
            raise ValueError(f"a packed micro-batch is one row, got {query.size(1)}")
        q, k, v = (t.squeeze(1).transpose(0, 1) for t in (query, key, value))  # [h, s, d]
        heads, head_dim = q.shape[0], q.shape[2]
        if k.shape[0] != heads:  # grouped-query attention: each key / value head serves heads / groups queries
            k, v = (t.repeat_interleave(heads // t.shape[0], dim=0) for t in (k, v))
        # The sequences are contiguous spans: slices (views, whose backward is a plain copy) rather than a gather
        # of equally long ones, whose backward would be an accumulating scatter (slow on the CPU).
        outputs = [F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True,
                                                  scale=self.softmax_scale)
                   for a, b in packed_seq_params.spans if b > a]
        return torch.cat(outputs, dim=1).transpose(0, 1).reshape(-1, 1, heads * head_dim)
