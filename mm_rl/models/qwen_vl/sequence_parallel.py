"""Megatron's sequence parallelism in the Qwen-VL stage: a TP rank's share of the tokens, and the rows of the
LLM's last hidden states that reach the output layer (only the tokens whose log-probs are wanted, the same
number on every TP rank)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def sequence_parallel_share(x: Tensor) -> Tensor:
    """This TP rank's contiguous 1/TP of ``x`` [S, B, H] along S (megatron's scatter: the backward all-gathers);
    a copy, so the whole tensor is not kept alive by the view (megatron's embedding clones it for the same
    reason)."""
    from megatron.core import tensor_parallel

    return tensor_parallel.scatter_to_sequence_parallel_region(x).clone()  # type: ignore[no-any-return]


@dataclass(frozen=True)
class OutputRows:
    """The token positions of a micro-batch whose log-probs are wanted (the response tokens), and the rows of the
    hidden states that reach the output layer for them: only those, since a prompt's logits are never read and the
    output layer and the log-prob function are the widest steps of the LLM (vocab columns per token).

    Under sequence parallelism TP rank r holds the r-th contiguous share of the tokens and the output layer
    all-gathers the shares, so every rank keeps the same number of rows (``width``: its wanted rows, then unwanted
    ones of its share as fillers; every rank sees the whole mask, so all agree without talking) and the gathered
    rows come in rank order. ``kept`` are the gathered rows that are not fillers, ``positions`` their places in the
    [S, B] token grid flattened."""

    local: Tensor  # [width] rows of this rank's [S / shares * B] hidden states
    labels_at: Tensor  # [shares * width]: each gathered row's place in the flattened grid, fillers included
    kept: Tensor  # [wanted]
    positions: Tensor  # [wanted]
    shape: tuple[int, int]  # (B, S)

    @classmethod
    def of(cls, mask: Tensor, shares: int, rank: int) -> OutputRows:
        """``mask`` [B, S] (nonzero: wanted) of this rank's tokens (CP-local), cut into ``shares`` along S."""
        grid = (mask != 0).t().reshape(shares, -1)  # share r: its [S / shares, B] rows, as the hidden states hold them
        counts = grid.sum(1)
        width = max(int(counts.max()), 1)
        # the wanted rows of each share first, in order (a stable sort of "not wanted"), then fillers
        order = torch.sort((~grid).to(torch.uint8), dim=1, stable=True).indices[:, :width]
        valid = (torch.arange(width, device=mask.device) < counts[:, None]).reshape(-1)
        places = (order + torch.arange(shares, device=mask.device)[:, None] * grid.shape[1]).reshape(-1)
        kept = valid.nonzero().squeeze(1)
        return cls(order[rank], places, kept, places.index_select(0, kept), (mask.shape[0], mask.shape[1]))

    def pick(self, hidden: Tensor) -> Tensor:
        """[S / shares, B, H] -> [width, 1, H]."""
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.local).unsqueeze(1)

    def labels(self, labels: Tensor) -> Tensor:
        """[B, S] -> [1, shares * width], in the gathered rows' order."""
        return labels.t().reshape(-1).index_select(0, self.labels_at).unsqueeze(0)

    def place(self, values: Tensor) -> Tensor:
        """[1, shares * width] -> [B, S], zeros where nothing was wanted (out of place: gradients reach ``values``)."""
        rows, cols = self.shape
        out = values.new_zeros(cols * rows)
        out = out.index_put((self.positions,), values[0].index_select(0, self.kept))
        return out.reshape(cols, rows).t()
