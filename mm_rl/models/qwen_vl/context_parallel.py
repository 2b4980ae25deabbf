"""Ulysses context parallelism (``context-parallel-algo: ulysses_cp_algo``) for the Qwen-VL stage's LLM.

Every CP rank keeps a contiguous 1/cp of the tokens; attention all-to-alls between "my tokens, all heads" and
"all tokens, my heads" (:class:`UlyssesAttention`), and the last stage gathers its per-token outputs back to the
whole sequence (:meth:`ContextParallel.gather`), so the loss code is the same with and without CP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (chunk i goes to rank i); its own adjoint, so backward is the same op."""

    @staticmethod
    def forward(ctx: Any, chunks: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group = group
        chunks = chunks.contiguous()  # (empty_like of a permuted view would keep its strides)
        out = torch.empty_like(chunks)
        torch.distributed.all_to_all_single(out, chunks, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        torch.distributed.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def sequence_to_heads(x: Tensor, group: Any, size: int) -> Tensor:
    """[S/cp, B, h, d] (this rank's tokens, all its heads) -> [S, B, h/cp, d] (all tokens, its head block)."""
    seq, batch, heads, dim = x.shape
    chunks = x.reshape(seq, batch, size, heads // size, dim).permute(2, 0, 1, 3, 4)
    return _AllToAll.apply(chunks, group).reshape(size * seq, batch, heads // size, dim)  # type: ignore[no-any-return]


def heads_to_sequence(x: Tensor, group: Any, size: int) -> Tensor:
    """[S, B, h/cp * d] attention output of this rank's head block -> [S/cp, B, h * d] for its own tokens."""
    seq, batch, width = x.shape
    out = _AllToAll.apply(x.reshape(size, seq // size, batch, width), group)
    return out.permute(1, 2, 0, 3).reshape(seq // size, batch, size * width)  # type: ignore[no-any-return]


class UlyssesAttention(torch.nn.Module):
    """Core attention with DeepSpeed-Ulysses context parallelism (``context-parallel-algo: ulysses_cp_algo``).

    Each CP rank holds a contiguous 1/cp of the sequence. q, k, v go through one all-to-all each, from
    "my tokens, all heads" to "all tokens, 1/cp of the heads"; megatron's local attention then runs on the
    full sequence (causal or padding masks, or a packed row's segments, work unchanged), and one all-to-all brings
    the output back.
    KV groups are repeated to one per query head first when the CP size does not divide them.
    Built by megatron's layer spec with the arguments of any core attention.
    """

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
        import dataclasses

        from megatron.core import parallel_state

        from mm_rl.models.qwen_vl.llm_attention import LLMCoreAttention

        super().__init__()
        self.group = parallel_state.get_context_parallel_group()
        self.size = parallel_state.get_context_parallel_world_size()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        heads, groups = config.num_attention_heads // tp, config.num_query_groups // tp
        if heads % self.size:
            raise ValueError(f"Ulysses CP {self.size} must divide the attention heads per TP rank ({heads})")
        self.repeat_kv = 1 if groups % self.size == 0 else heads // groups
        inner = dataclasses.replace(
            config,
            num_attention_heads=config.num_attention_heads // self.size,
            num_query_groups=config.num_query_groups * self.repeat_kv // self.size,
        )
        self.attention = LLMCoreAttention(
            inner, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale, None, pg_collection
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        if self.repeat_kv > 1:
            key, value = (t.repeat_interleave(self.repeat_kv, dim=2) for t in (key, value))
        q, k, v = (sequence_to_heads(t, self.group, self.size) for t in (query, key, value))
        out = self.attention(
            q,
            k,
            v,
            attention_mask,
            attn_mask_type=attn_mask_type,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )
        return heads_to_sequence(out, self.group, self.size)


class _GatherSequence(torch.autograd.Function):
    """All-gather over CP along dim 1 ([B, S/cp, ...] -> [B, S, ...]); backward keeps this rank's slice.

    Every CP rank computes the same loss from the gathered tensor, so the gradient of its own slice is
    exactly its share (no sum); megatron's loss x cp and DP x CP gradient averaging complete it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, rank: int, size: int) -> Tensor:  # type: ignore[override]
        ctx.rank, ctx.size = rank, size
        parts = [torch.empty_like(x) for _ in range(size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        return grad.chunk(ctx.size, dim=1)[ctx.rank].contiguous(), None, None, None


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in the CP group; its tokens are the contiguous chunk ``rank`` of ``size``."""

    group: Any
    rank: int
    size: int

    def local(self, x: Tensor, dim: int) -> Tensor:
        """This rank's chunk of ``x`` along ``dim``."""
        return x.chunk(self.size, dim=dim)[self.rank]

    def gather(self, x: Tensor) -> Tensor:
        """[B, S/cp, ...] -> [B, S, ...] (see _GatherSequence)."""
        return _GatherSequence.apply(x, self.group, self.rank, self.size)  # type: ignore[no-any-return]


def context_parallel() -> ContextParallel | None:
    """This process's CP group from megatron's parallel state (None without context parallelism)."""
    from megatron.core import parallel_state

    size = parallel_state.get_context_parallel_world_size()
    if size == 1:
        return None
    return ContextParallel(
        parallel_state.get_context_parallel_group(), parallel_state.get_context_parallel_rank(), size
    )
