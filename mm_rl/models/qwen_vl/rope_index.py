"""Qwen2.5-VL's 3D (temporal, height, width) rotary position ids, in pure torch.

Text tokens get the same id on all three axes, counting up by one. The tokens of one image or video (a t x h x w
grid of merged patches, h and w already divided by the spatial merge size) all start at the position the next
text token would have had, then add their own (t, h, w) grid coordinates per axis, the time coordinate scaled by
the item's ``time_step`` (Qwen2.5-VL's ``tokens_per_second x second_per_grid_t`` for a video, truncated to an
integer as vLLM does, ``vllm/model_executor/models/qwen2_5_vl.py`` ``get_mrope_input_positions``); the text after
it resumes one past the largest id it used (vLLM's rule; transformers 5.19 resumes at start + max(h, w) instead,
which differs after a video whose time ids outgrow its width). Items are consumed in order from ``image_grid_thw``
(all samples' images and videos, sample by sample, in the order their tokens appear), so several per sample and
adjacent ones both work. Padding (attention mask 0) is skipped wherever it is (left or right) and gets position 0.

The returned ``deltas`` (largest id + 1 - number of valid tokens, per sample) let a generator continue the
positions of a prompt token by token: the next token's id is its index plus the delta.
"""

from __future__ import annotations

import torch


def _image_positions(start: int, grid_thw: torch.Tensor, merge: int, time_step: float = 1.0) -> torch.Tensor:
    """[3, t*h*w] ids of one image's or video's tokens (row-major over t, h, w) starting at ``start``."""
    t, h, w = (int(v) for v in grid_thw)
    h, w = h // merge, w // merge
    axes = list(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
    if time_step != 1.0:  # float64 product then truncation, as vLLM computes it
        axes[0] = (axes[0].double() * time_step).long()
    return torch.stack([axis.reshape(-1) for axis in axes]) + start


def _sample_positions(
    ids: torch.Tensor, grids: list[torch.Tensor], steps: list[float], vision_ids: torch.Tensor, merge: int
) -> tuple[torch.Tensor, int]:
    """[3, len(ids)] ids of one sample's valid tokens and how many images / videos they used from ``grids``."""
    is_image = torch.isin(ids, vision_ids).tolist()
    chunks: list[torch.Tensor] = []
    next_pos, index, used = 0, 0, 0
    while index < len(is_image):
        if not is_image[index]:
            end = is_image.index(True, index) if True in is_image[index:] else len(is_image)
            chunks.append(torch.arange(next_pos, next_pos + end - index).expand(3, -1))
            next_pos += end - index
            index = end
            continue
        if used == len(grids):
            raise ValueError("more image tokens than image_grid_thw describes")
        image = _image_positions(next_pos, grids[used], merge, steps[used])
        count = image.shape[1]
        if not all(is_image[index : index + count]) or index + count > len(is_image):
            raise ValueError(f"image {used} needs {count} consecutive image tokens at offset {index}")
        chunks.append(image)
        next_pos = int(image.max()) + 1
        index += count
        used += 1
    positions = torch.cat(chunks, dim=1) if chunks else torch.zeros(3, 0, dtype=torch.long)
    return positions, used


def get_rope_index(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    image_token_id: int,
    spatial_merge_size: int = 2,
    video_token_id: int | None = None,
    time_steps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [3, B, S] (long) and deltas [B, 1] for a batch of token ids [B, S].

    ``image_grid_thw`` [N, 3]: the (t, h, w) patch grid of every image and video, before merging, in the order
    their tokens (``image_token_id`` or ``video_token_id``) appear in the batch; ``time_steps`` [N] (float64; None:
    all 1) each item's time-axis step. ``attention_mask`` [B, S]: 1 for real tokens, 0 for padding (None: all
    real). Raises ValueError when the image / video tokens and the grids do not agree.
    """
    batch, seq = input_ids.shape
    grids = list(image_grid_thw.cpu()) if image_grid_thw is not None else []
    steps = time_steps.tolist() if time_steps is not None else [1.0] * len(grids)
    vision_ids = torch.tensor([image_token_id] + ([video_token_id] if video_token_id is not None else []))
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    positions = torch.zeros(3, batch, seq, dtype=torch.long)
    deltas = torch.zeros(batch, 1, dtype=torch.long)
    ids_cpu, mask_cpu = input_ids.cpu(), mask.cpu()
    for sample in range(batch):
        valid = mask_cpu[sample]
        sample_pos, used = _sample_positions(ids_cpu[sample][valid], grids, steps, vision_ids, spatial_merge_size)
        grids, steps = grids[used:], steps[used:]
        positions[:, sample, valid] = sample_pos
        top = int(sample_pos.max()) + 1 if sample_pos.numel() else 0
        deltas[sample, 0] = top - int(valid.sum())
    if grids:
        raise ValueError(f"image_grid_thw describes {len(grids)} more image(s) than the image tokens hold")
    return positions.to(input_ids.device), deltas.to(input_ids.device)
