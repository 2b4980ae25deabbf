"""Segment-restricted attention core for the Qwen2.5-VL ViT (window and per-image full attention).

The ViT packs every patch of every image into one sequence ([N, 1, hidden]). Each block attends only within
segments of that sequence: windows of 8x8 patches (window blocks) or whole images (``fullatt_block_indexes``).
megatron-core's local ``DotProductAttention`` only knows dense masks, which would cost O(N^2) memory for a
large image, so this core replaces it in the ViT layer spec: it gathers equally long segments into one batch
and runs torch's ``scaled_dot_product_attention`` per batch (windows share a handful of lengths, so a layer
makes a few SDPA calls, not one per window). Work and memory are O(sum of segment_len^2).

The segments reach the core through megatron's ``packed_seq_params`` argument (a :class:`VisionSegments`,
which ``TransformerBlock`` hands unchanged to every layer). Its ``qkv_format`` is ``"sbhd"``, so megatron's
attention keeps the [s, b, heads, head_dim] layout and applies the rotary embedding per token, not per
packed sequence. Whether a layer uses windows or images is a constructor flag set by the layer spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor


@dataclass
class SegmentPlan:
    """How to run attention restricted to the segments of one ``cu_seqlens``.

    ``groups[i]`` is a [num_segments_i, length_i] index tensor: segments of equal length, gathered as a batch.
    ``inverse`` puts the concatenated, flattened group outputs back into sequence order.
    """

    groups: list[Tensor]
    inverse: Tensor

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Tensor) -> SegmentPlan:
        """Group the non-empty segments of ``cu_seqlens`` by length (a few distinct lengths per image)."""
        bounds = cu_seqlens.to("cpu", torch.long).tolist()
        starts_by_length: dict[int, list[int]] = {}
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            if end > start:
                starts_by_length.setdefault(end - start, []).append(start)
        device = cu_seqlens.device
        groups = [
            torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)
            for length, starts in starts_by_length.items()
        ]
        order = torch.cat([group.reshape(-1) for group in groups])
        if not torch.equal(order.sort().values, torch.arange(bounds[-1] - bounds[0], device=device) + bounds[0]):
            raise ValueError("cu_seqlens must be increasing and start at 0")
        return cls(groups=groups, inverse=torch.argsort(order))

    def to(self, device: torch.device) -> SegmentPlan:
        return SegmentPlan([group.to(device) for group in self.groups], self.inverse.to(device))


@dataclass
class VisionSegments(PackedSeqParams):
    """The attention segments of one packed ViT sequence, passed to every layer as ``packed_seq_params``.

    ``window``: windows (the blocks not in ``fullatt_block_indexes``); ``full``: one segment per image frame.
    ``cu_seqlens_q`` / ``cu_seqlens_kv`` hold the window boundaries for readers that expect them.
    """

    window: SegmentPlan | None = None
    full: SegmentPlan | None = None
    cu_window_seqlens: Tensor | None = field(default=None, repr=False)
    cu_full_seqlens: Tensor | None = field(default=None, repr=False)

    @classmethod
    def build(cls, cu_window_seqlens: Tensor, cu_full_seqlens: Tensor) -> VisionSegments:
        return cls(
            qkv_format="sbhd",
            cu_seqlens_q=cu_window_seqlens,
            cu_seqlens_kv=cu_window_seqlens,
            window=SegmentPlan.from_cu_seqlens(cu_window_seqlens),
            full=SegmentPlan.from_cu_seqlens(cu_full_seqlens),
            cu_window_seqlens=cu_window_seqlens,
            cu_full_seqlens=cu_full_seqlens,
        )


class VisionSegmentAttention(MegatronModule):
    """Core attention (softmax(q k^T * scale) v) within window or image segments; a drop-in for the spec.

    The constructor takes the arguments megatron's ``SelfAttention`` passes to any core attention (it calls
    the class directly, so the window / image choice is the subclass, not a spec param). Inputs are
    [s, 1, heads_per_rank, head_dim]; the output is [s, 1, heads_per_rank * head_dim], as ``linear_proj``
    expects.
    """

    full_attention: bool = False

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("the ViT attention core does not support context parallelism")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if not isinstance(packed_seq_params, VisionSegments):
            raise TypeError("the ViT attention core needs the VisionSegments of the batch as packed_seq_params")
        if query.size(1) != 1:
            raise ValueError(f"the ViT packs all images into one sequence (batch 1), got batch {query.size(1)}")
        plan = packed_seq_params.full if self.full_attention else packed_seq_params.window
        assert plan is not None
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._attend(query, key, value, plan, dropout_p)
        else:
            out = self._attend(query, key, value, plan, 0.0)
        return out.unsqueeze(1)

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, plan: SegmentPlan, dropout_p: float) -> Tensor:
        """[s, 1, h, d] q/k/v -> [s, h * d]: SDPA over each batch of equally long segments, back in order."""
        q, k, v = (t.squeeze(1) for t in (query, key, value))
        _, heads, head_dim = q.shape
        outputs = []
        for index in plan.groups:
            # [n, L, h, d] -> [n, h, L, d]
            qg, kg, vg = (t[index].transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(qg, kg, vg, dropout_p=dropout_p, scale=self.softmax_scale)
            outputs.append(out.transpose(1, 2).reshape(-1, heads * head_dim))
        return torch.cat(outputs)[plan.inverse]


class VisionWindowAttention(VisionSegmentAttention):
    """Attention within windows (the ViT blocks not listed in ``fullatt_block_indexes``)."""

    full_attention = False


class VisionFullAttention(VisionSegmentAttention):
    """Attention within each whole image frame (the ``fullatt_block_indexes`` blocks)."""

    full_attention = True
