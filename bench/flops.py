"""The actor passes' matmul work against this machine's own fp32 matmul rate at the same shapes.

The passes are compute-bound once the model is large enough: their matmuls are what a faster step must do faster.
``passes_flops`` counts them from the micro-batches a pass received (2 FLOPs per multiply-add; a forward-only pass
once, an update's forward + backward three times, as 6 x params x tokens counts it): every LLM linear layer on each
position the model computes, the output layer on the response tokens only, and each attention layer's two matmuls
(scores and weighted values) over the causal query-key pairs it computes (a row's positions against themselves and
its shared prompt; the pairs inside a shared prompt once), as the usual model-FLOPs count has them (PaLM's
appendix B). The families of the benches have attention in every layer (no linear-attention layers).
``matmul_peak`` times ``torch.mm`` at the linears' shapes at the passes' mean positions per micro-batch, the three
an update runs per linear on its [out, in] weight (the forward [positions, in] x [out, in]^T, the input gradient
[positions, out] x [out, in] and the weight gradient [positions, out]^T x [positions, in]), with the actor's
threads: the rate the passes would reach if they were nothing but their linears' matmuls. The machine's rate drifts
over minutes: measure it next to the passes it is compared with.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any


def linear_shapes(model: Any) -> list[tuple[int, int]]:
    """(in, out) of one LLM layer's weight matmuls (an MoE layer: its top-k routed experts, as each token goes
    through them; the families here have no shared expert), ``model`` being the job's ``ModelConfig``."""
    text = model.text_decoder
    head = text.kv_channels or text.hidden_size // text.num_attention_heads
    groups = text.num_query_groups if text.group_query_attention else text.num_attention_heads
    qkv = head * (text.num_attention_heads + 2 * groups)
    shapes = [(text.hidden_size, qkv), (head * text.num_attention_heads, text.hidden_size)]
    if text.num_moe_experts:
        width, copies = text.moe_intermediate_size, text.moe_router_topk
    else:
        width, copies = text.ffn_hidden_size, 1
    mlp = [(text.hidden_size, width * (2 if text.swiglu else 1)), (width, text.hidden_size)]
    return shapes + mlp * copies


def attention_pairs(batch: dict[str, Any]) -> int:
    """Causal query-key pairs the attention layers compute for a micro-batch: each row's real positions against
    themselves and those before (a shared prompt's own pairs counted at its first row only)."""
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    shared = batch.get("shared_prompt")
    skipped = shared.tolist() if shared is not None else [0] * len(lengths)
    return int(sum(n * (n + 1) // 2 - s * (s + 1) // 2 for n, s in zip(lengths, skipped, strict=True)))


def computed_positions(batch: dict[str, Any]) -> tuple[int, int]:
    """Positions the LLM computes for a micro-batch (real tokens; a shared prompt once) and response positions."""
    shared = batch.get("shared_prompt")
    positions = int(batch["attention_mask"].sum()) - (int(shared.sum()) if shared is not None else 0)
    return positions, int(batch["response_mask"].sum())


def passes_flops(model: Any, passes: Iterable[tuple[str, Sequence[dict[str, Any]], float]]) -> tuple[float, float]:
    """Matmul FLOPs of a step's passes (``("log_probs" | "update", micro-batches, ...)``) and the mean positions
    per micro-batch."""
    text = model.text_decoder
    per_position = 2 * sum(i * o for i, o in linear_shapes(model)) * text.num_layers
    per_response = 2 * text.hidden_size * text.vocab_size
    head = text.kv_channels or text.hidden_size // text.num_attention_heads
    per_pair = 2 * 2 * head * text.num_attention_heads * text.num_layers  # scores and weighted values
    total, counts = 0.0, []
    for kind, batches, _ in passes:
        for batch in batches:
            positions, responses = computed_positions(batch)
            counts.append(positions)
            work = per_position * positions + per_response * responses + per_pair * attention_pairs(batch)
            total += (3 if kind == "update" else 1) * work
    return total, sum(counts) / max(1, len(counts))


def matmul_peak(model: Any, positions: float, threads: int, seconds: float = 1.0) -> float:
    """FLOP/s of fp32 ``torch.mm`` over one layer's linears at ``positions`` rows (forward, input gradient and
    weight gradient of each), repeated for ``seconds``, with ``threads`` torch threads (restored after)."""
    import torch

    rows = max(1, round(positions))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        operands = []
        for i, o in linear_shapes(model):
            operands += [
                (torch.randn(rows, i), torch.randn(o, i).t()),  # forward: against the [out, in] weight, transposed
                (torch.randn(rows, o), torch.randn(o, i)),  # input gradient
                (torch.randn(rows, o).t(), torch.randn(rows, i)),  # weight gradient: the outputs' gradient transposed
            ]
        work = 3 * sum(2 * rows * i * o for i, o in linear_shapes(model))
        for a, b in operands:  # warm-up
            torch.mm(a, b)
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for a, b in operands:
                torch.mm(a, b)
            done += work
        return done / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
