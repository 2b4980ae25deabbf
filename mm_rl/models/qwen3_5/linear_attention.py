"""Qwen3.5's linear-attention layers: megatron-core's ``GatedDeltaNet`` on packed rows.

megatron-core 0.16.1's ``GatedDeltaNet`` (``ssm/gated_delta_net.py``) holds the layer's parameters as Qwen3.5
stores them (one column-parallel ``in_proj`` for q, k, v, the output gate z, beta and alpha; the depthwise causal
``conv1d`` over q, k, v; ``A_log``, ``dt_bias``; the per-head ``out_norm``; the row-parallel ``out_proj``), but its
forward refuses packed sequences (``packed_seq_params``) and runs only fla's CUDA kernels (its torch path still
calls fla's Triton l2-norm), so its constructor refuses to run without fla. :class:`PackedGatedDeltaNet` keeps the
module and replaces the forward: a packed row's sequences (:class:`~mm_rl.models.qwen_vl.llm_attention.
CausalSegments`) become the rows of a right-padded batch, so the convolution and the recurrent state start from
zero at every sequence, as each sequence alone would; the padding sits after each sequence's last token and cannot
reach it. The delta rule runs fla's ``chunk_gated_delta_rule`` on CUDA (``pip install flash-linear-attention``) and
megatron-core's ``torch_chunk_gated_delta_rule`` (the chunked fp32 reference, the one transformers runs without
fla) elsewhere: CPU, and Ascend NPU (MindSpeed-MM's own Qwen3.5 runs use the AscendC kernels of the separate
fla-npu package, ``mindspeed_mm/fsdp/ops/gdn/``, which mm_rl does not take yet).

Shared prompts (a GRPO group's prompt computed once) are not taken: a later sample would need the recurrent state
at the end of the shared prompt, which the segment batch does not carry; the family turns sharing off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.ssm import gated_delta_net
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules, torch_chunk_gated_delta_rule
from torch import Tensor

from mm_rl.models.qwen_vl.llm_attention import CausalSegments


def l2_normalised(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the head dimension: fla's ``l2norm`` (and transformers' copy of it)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kernel_name(device: torch.device) -> str:
    """Which delta-rule kernel :func:`gated_delta_rule` runs on ``device`` (for reports)."""
    if device.type == "cuda" and gated_delta_net.chunk_gated_delta_rule is not None:
        return "fla chunk_gated_delta_rule"
    return "megatron-core torch_chunk_gated_delta_rule"


def gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """The gated delta rule over [rows, S, heads, d] from a zero state: fla's chunked kernel on CUDA, megatron-core's
    torch reference elsewhere (see the module docstring); q and k come l2-normalised."""
    if query.is_cuda and gated_delta_net.chunk_gated_delta_rule is not None:
        kernel = gated_delta_net.chunk_gated_delta_rule
        out, _ = kernel(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=False)
        return out
    out, _ = torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta)
    return out


@dataclass(frozen=True)
class SegmentBatch:
    """A packed row's sequences as the rows of a right-padded batch [n, L] and back: ``index`` [n, L] is each slot's
    position in the row (the row's length for padding: a zero appended there), ``valid`` [n, L] the real slots,
    which in row-major order are the row's positions in order."""

    index: Tensor | None  # None: one sequence, the row itself
    valid: Tensor | None

    @classmethod
    def of(cls, segments: CausalSegments, total: int, device: torch.device) -> SegmentBatch:
        spans = [(a, b) for a, b in segments.spans if b > a]
        if len(spans) <= 1 and (not spans or spans[0] == (0, total)):
            return cls(None, None)
        longest = max(b - a for a, b in spans)
        offsets = torch.arange(longest, device=device)
        starts = torch.tensor([a for a, _ in spans], device=device)
        lengths = torch.tensor([b - a for a, b in spans], device=device)
        valid = offsets[None, :] < lengths[:, None]
        index = torch.where(valid, starts[:, None] + offsets[None, :], total)
        return cls(index, valid)

    def batch(self, x: Tensor) -> Tensor:
        """[T, d] -> [n, L, d]."""
        if self.index is None:
            return x[None]
        return (
            torch.cat([x, x.new_zeros(1, x.shape[-1])])
            .index_select(0, self.index.reshape(-1))
            .view(*self.index.shape, x.shape[-1])
        )

    def unbatch(self, x: Tensor) -> Tensor:
        """[n, L, d] -> [T, d]."""
        return x[0] if self.valid is None else x[self.valid]


class PackedGatedDeltaNet(GatedDeltaNet):
    """megatron-core's Gated DeltaNet with a forward for packed rows and any device (see the module docstring).
    Takes what ``TransformerLayer`` gives a self-attention: ``hidden_states`` [s, b, h] (this rank's share under
    sequence parallelism), returns (output [s, b, h], None)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # megatron-core's constructor refuses to build without fla (``HAVE_FLA``) because its own forward runs only
        # fla's kernels; this forward needs fla on CUDA alone. fla is not installed on CPU: transformers (5.19,
        # ``integrations/hub_kernels.py``) then swaps fla's Triton kernels into its own Qwen3.5 on any device,
        # which fails without a GPU.
        have_fla = gated_delta_net.HAVE_FLA
        gated_delta_net.HAVE_FLA = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            gated_delta_net.HAVE_FLA = have_fla

    def forward(  # type: ignore[override]
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None,
        key_value_states: Tensor | None = None,
        inference_context: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
        sequence_len_offset: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        if inference_context is not None or kwargs.get("inference_params") is not None:
            raise NotImplementedError("the Gated DeltaNet layer trains and scores; the engine generates")
        projected, _ = self.in_proj(hidden_states)  # [s, b, local]: the whole sequence under SP
        seq, rows, width = projected.shape
        if isinstance(packed_seq_params, CausalSegments):
            if packed_seq_params.contexts:
                raise ValueError("Gated DeltaNet cannot continue a shared prompt (its family turns sharing off)")
            segments = packed_seq_params.derived.get(seq)
            if segments is None:  # once per micro-batch, for every Gated DeltaNet layer
                segments = packed_seq_params.derived[seq] = SegmentBatch.of(packed_seq_params, seq, projected.device)
            x = segments.batch(projected.view(seq, width))
        elif attention_mask is not None:
            raise ValueError(
                "a Gated DeltaNet layer runs packed rows or right-padded rows (no attention mask); "
                "set actor_config.remove_padding true"
            )
        else:
            segments, x = None, projected.transpose(0, 1)
        out = self._mix(x)
        out = segments.unbatch(out)[:, None] if segments is not None else out.transpose(0, 1)
        return self.out_proj(out.contiguous())

    def _mix(self, x: Tensor) -> Tensor:
        """[n, L, local in_proj] -> [n, L, local v_dim]: convolution, delta rule, gated norm, per row from zero."""
        tp = self.tp_size
        n, length, _ = x.shape
        qkv, gate, beta, alpha = torch.split(
            x,
            [self.conv_dim_local_tp, self.v_dim // tp, self.num_value_heads // tp, self.num_value_heads // tp],
            dim=-1,
        )
        qkv = self.act_fn(self.conv1d(qkv.transpose(1, 2))[..., :length]).transpose(1, 2)
        query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
        query = l2_normalised(query.reshape(n, length, -1, self.key_head_dim).float())
        key = l2_normalised(key.reshape(n, length, -1, self.key_head_dim).float())
        value = value.reshape(n, length, -1, self.value_head_dim)
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:
            query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias.float())
        core = gated_delta_rule(query.to(value.dtype), key.to(value.dtype), value, g, beta.sigmoid())
        normed = self.out_norm(core)  # per value head, in the model's dtype (transformers' RMSNormGated)
        gated = normed.float() * self.act_fn(gate.reshape(n, length, -1, self.value_head_dim).float())
        return gated.to(x.dtype).reshape(n, length, -1)


def gated_delta_net_spec(norm: Any) -> Any:
    """The megatron-core spec of a Qwen3.5 linear-attention block (the ``self_attention`` of its layer): local
    column- / row-parallel projections (MindSpeed-MM's names ``in_proj`` / ``out_proj``) and ``norm`` per value
    head."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(
        module=PackedGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear),
    )
