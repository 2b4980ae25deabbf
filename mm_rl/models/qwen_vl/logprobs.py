"""Per-token log-probs of given labels and the entropy, from logits split over tensor-parallel ranks by vocab.

Gathering the full vocabulary (152k columns for Qwen2.5-VL) per token would cost TP times the memory of the
shard and an all-gather as large as the logits, so each rank works on its own slice and only per-token
scalars cross ranks: one MAX all-reduce (for a stable softmax) and one SUM all-reduce of three numbers per
token (sum of exp, sum of exp * logit, the label's logit when this rank owns it). Backward is analytic:

    d log p(y) / dz = onehot(y) - p            d H / dz = -p * (z - E_p[z])

so the autograd graph keeps only the input logits (no softmax or exp tensor per op), and backward
recomputes p from them with the two saved per-token statistics. Embedding rows past the real vocabulary
(Megatron pads it to a multiple of TP) are excluded.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# Stands in for -inf on padded vocab rows: exp() gives exactly 0 and 0 * value stays finite (no NaN).
_MASKED = -1e30


def _tp_group() -> dist.ProcessGroup | None:
    """The tensor-parallel group when megatron's parallel state is set up, else None (single process)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) in ``group``; (0, 1) without one."""
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _scaled(logits: torch.Tensor, temperature: float, vocab_start: int, vocab_size: int | None) -> torch.Tensor:
    """fp32 logits divided by the temperature, padded vocab rows masked. Upcast first: dividing bf16 logits rounds
    every one of them to bf16 again (an error of up to 2^-8 relative, which the sampler's fp32 division lacks)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    if vocab_size is not None and vocab_start + z.shape[-1] > vocab_size:
        z = z.clone() if z is logits else z
        z[..., max(vocab_size - vocab_start, 0) :] = _MASKED
    return z


def _shifted_logits(
    logits: torch.Tensor,
    temperature: float,
    vocab_start: int,
    vocab_size: int | None,
    group: dist.ProcessGroup | None,
    size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits / temperature minus the global per-token max (padded vocab rows masked), and that max."""
    z = _scaled(logits, temperature, vocab_start, vocab_size)
    top = z.max(dim=-1).values
    if size > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return z - top.unsqueeze(-1), top


class _LogProbEntropy(torch.autograd.Function):
    """(log p(label), entropy) per token from this rank's vocab slice; see the module docstring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None,
        group: dist.ProcessGroup | None,
        temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rank, size = _world(group)
        local = logits.shape[-1]
        vocab_start = rank * local
        shifted, top = _shifted_logits(logits, temperature, vocab_start, vocab_size, group, size)
        exp = shifted.exp()
        target = labels - vocab_start
        owned = (target >= 0) & (target < local)
        picked = shifted.gather(-1, target.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1) * owned
        stats = torch.stack([exp.sum(-1), (exp * shifted).sum(-1), picked])
        if size > 1:
            dist.all_reduce(stats, group=group)
        sum_exp, weighted, picked = stats.unbind(0)
        log_sum = sum_exp.log()
        mean_shifted = weighted / sum_exp
        ctx.save_for_backward(logits, labels, top, log_sum, mean_shifted)
        ctx.vocab = (vocab_start, vocab_size, temperature)
        return picked - log_sum, log_sum - mean_shifted

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        logits, labels, top, log_sum, mean_shifted = ctx.saved_tensors
        vocab_start, vocab_size, temperature = ctx.vocab
        z = _scaled(logits, temperature, vocab_start, vocab_size)
        shifted = z - top.unsqueeze(-1)
        probs = (shifted - log_sum.unsqueeze(-1)).exp()
        grad = torch.zeros_like(z)
        if grad_entropy is not None:
            grad -= grad_entropy.unsqueeze(-1) * probs * (shifted - mean_shifted.unsqueeze(-1))
        if grad_logprob is not None:
            grad -= grad_logprob.unsqueeze(-1) * probs
            target = labels - vocab_start
            owned = (target >= 0) & (target < z.shape[-1])
            index = target.clamp(0, z.shape[-1] - 1).unsqueeze(-1)
            grad.scatter_add_(-1, index, (grad_logprob * owned).unsqueeze(-1))
        if temperature != 1.0:  # d(z / T) / dz
            grad /= temperature
        return grad.to(logits.dtype), None, None, None, None


def log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None | str = "tp",
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(labels) and the entropy of the softmax over the vocabulary, both fp32 with ``labels``' shape.

    ``logits`` [..., V / TP] is this rank's vocab slice (rank r holds columns r*V/TP .. (r+1)*V/TP) and
    ``labels`` [...] are global token ids (callers shift: labels[s] is the token that position s predicts).
    ``vocab_size`` is the real vocabulary when the embedding is padded; ``temperature`` divides the logits
    after the upcast to fp32 (as the sampler does). ``group`` defaults to megatron's TP group ("tp"); None means
    unsplit logits.
    Labels outside the vocabulary give a meaningless log-prob; mask those tokens in the loss.
    """
    tp_group = _tp_group() if group == "tp" else group
    return _LogProbEntropy.apply(logits, labels, vocab_size, tp_group, float(temperature))  # type: ignore[no-any-return]
