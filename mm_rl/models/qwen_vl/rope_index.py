"""Qwen2.5-VL's 3D (temporal, height, width) rotary position ids, in pure torch.

Text tokens get the same id on all three axes, counting up by one. The tokens of one image (a t x h x w grid
of merged patches, h and w already divided by the spatial merge size) all start at the position the next
text token would have had, then add their own (t, h, w) grid coordinates per axis; the text after the image
resumes one past the largest id the image used. Images are consumed in order from ``image_grid_thw`` (all
samples' images, sample by sample), so several images per sample and adjacent images both work. Padding
(attention mask 0) is skipped wherever it is (left or right) and gets position 0.

The returned ``deltas`` (largest id + 1 - number of valid tokens, per sample) let a generator continue the
positions of a prompt token by token: the next token's id is its index plus the delta.
"""

from __future__ import annotations

import torch


def _image_positions(start: int, grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """[3, t*h*w] ids of one image's tokens (row-major over t, h, w) starting at ``start``."""
    t, h, w = (int(v) for v in grid_thw)
    h, w = h // merge, w // merge
    axes = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([axis.reshape(-1) for axis in axes]) + start


def _sample_positions(
    ids: torch.Tensor, grids: list[torch.Tensor], image_token_id: int, merge: int
) -> tuple[torch.Tensor, int]:
    """[3, len(ids)] ids of one sample's valid tokens and how many images they used from ``grids``."""
    is_image = (ids == image_token_id).tolist()
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
        image = _image_positions(next_pos, grids[used], merge)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [3, B, S] (long) and deltas [B, 1] for a batch of token ids [B, S].

    ``image_grid_thw`` [N, 3]: the (t, h, w) patch grid of every image, before merging, in the order the
    images appear in the batch. ``attention_mask`` [B, S]: 1 for real tokens, 0 for padding (None: all real).
    Raises ValueError when the image tokens and the grids do not agree.
    """
    batch, seq = input_ids.shape
    grids = list(image_grid_thw.cpu()) if image_grid_thw is not None else []
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    positions = torch.zeros(3, batch, seq, dtype=torch.long)
    deltas = torch.zeros(batch, 1, dtype=torch.long)
    ids_cpu, mask_cpu = input_ids.cpu(), mask.cpu()
    for sample in range(batch):
        valid = mask_cpu[sample]
        sample_pos, used = _sample_positions(ids_cpu[sample][valid], grids, image_token_id, spatial_merge_size)
        grids = grids[used:]
        positions[:, sample, valid] = sample_pos
        top = int(sample_pos.max()) + 1 if sample_pos.numel() else 0
        deltas[sample, 0] = top - int(valid.sum())
    if grids:
        raise ValueError(f"image_grid_thw describes {len(grids)} more image(s) than the image tokens hold")
    return positions.to(input_ids.device), deltas.to(input_ids.device)
