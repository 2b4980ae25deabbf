"""MoE routing statistics of the Qwen-VL stage's LLM layers (tokens per expert, read by the trainer's metrics)."""

from __future__ import annotations

from typing import Any

import torch


class RoutingCounts:
    """MoE: per LLM layer, the tokens each expert received since :meth:`reset`, then the tokens routed (this
    rank's tokens, its stage's layers). Kept on the router's device (a forward hook per layer and micro-batch
    must not wait for a host copy); the reader all-reduces them and brings them to the host once."""

    def __init__(self, layers: int, experts: int) -> None:
        self.counts = torch.zeros(layers, experts + 1 if experts else 0, dtype=torch.int64)

    def add(self, layer: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook of megatron's ``TopKRouter`` (its output: probs, routing_map [T, E])."""
        routing_map = output[1].detach()
        if self.counts.device != routing_map.device:
            self.counts = self.counts.to(routing_map.device)
        self.counts[layer, :-1] += routing_map.sum(0, dtype=torch.int64)
        self.counts[layer, -1] += routing_map.shape[0]

    def reset(self) -> None:
        self.counts.zero_()
