"""Interleaved multimodal rotary (Qwen3-VL's mRoPE) on megatron's ``MultimodalRotaryEmbedding``.

megatron-core's mRoPE gives each of (t, h, w) one contiguous block of frequencies (``mrope_section``), as
Qwen2-VL / Qwen2.5-VL do. Qwen3-VL interleaves them: frequency j rotates by the height position when
j mod 3 == 1 and j < 3 * sections[1], by the width position when j mod 3 == 2 and j < 3 * sections[2], and by
the time position otherwise (transformers' ``Qwen3VLTextRotaryEmbedding``). Only the choice of axis per
frequency differs, so this subclass replaces megatron's forward and keeps its output layout ([S, B, 1, dim],
rotate-half).
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    MultimodalRotaryEmbedding,
    get_pos_emb_on_this_cp_rank,
)
from torch import Tensor


def interleaved_axes(frequencies: int, sections: list[int]) -> Tensor:
    """The position axis (0 t, 1 h, 2 w) each of the ``frequencies`` rotary frequencies uses."""
    j = torch.arange(frequencies)
    axes = torch.zeros(frequencies, dtype=torch.long)
    axes[(j % 3 == 1) & (j < 3 * sections[1])] = 1
    axes[(j % 3 == 2) & (j < 3 * sections[2])] = 2
    return axes


class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    def forward(
        self,
        position_ids: Tensor,
        mrope_section: list[int],  # type: ignore[override]
        cp_group: torch.distributed.ProcessGroup | None = None,
    ) -> Tensor:
        """Angles [S, B, 1, dim] of 3D positions ``position_ids`` [3, B, S]."""
        positions = position_ids.to(device=self.inv_freq.device, dtype=torch.float32)
        freqs = positions[..., None] * self.inv_freq.float()  # [3, B, S, dim / 2]
        axes = interleaved_axes(freqs.size(-1), mrope_section).to(freqs.device)
        freqs = freqs.gather(0, axes.expand(1, *freqs.shape[1:]))[0]  # [B, S, dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[..., None, :].transpose(0, 1).contiguous()
        cp_group = cp_group if cp_group is not None else self.cp_group
        if cp_group is not None and cp_group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb
