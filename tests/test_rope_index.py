"""Qwen2.5-VL 3D rope position ids match transformers' get_rope_index on several batch layouts."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from mm_rl.models.qwen_vl.rope_index import get_rope_index

IMAGE, START, END, PAD = 1006, 1003, 1004, 1000
MERGE = 2


def _hf_rope_index(
    input_ids: torch.Tensor, grids: torch.Tensor | None, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' implementation, called on a stand-in ``self`` holding only what it reads."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    vision = SimpleNamespace(spatial_merge_size=MERGE, tokens_per_second=2)
    fake = SimpleNamespace(config=SimpleNamespace(vision_config=vision))
    fake.get_vision_position_ids = functools.partial(Qwen2_5_VLModel.get_vision_position_ids, fake)
    token_types = (input_ids == IMAGE).int()
    return Qwen2_5_VLModel.get_rope_index(fake, input_ids, token_types, image_grid_thw=grids, attention_mask=mask)


def _image(grid: tuple[int, int, int]) -> list[int]:
    t, h, w = grid
    return [START] + [IMAGE] * (t * h * w // MERGE**2) + [END]


def _batch(rows: list[list[int]], left_pad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad rows to one length (left or right) and return ids and the attention mask."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left_pad else slice(0, len(row))
        ids[i, span] = torch.tensor(row)
        mask[i, span] = 1
    return ids, mask


def _text(n: int, first: int = 5) -> list[int]:
    return list(range(first, first + n))


LAYOUTS: dict[str, tuple[list[list[int]], list[tuple[int, int, int]], bool]] = {
    "one_image_right_pad": (
        [_text(3) + _image((1, 4, 4)) + _text(5), _text(4) + _image((1, 2, 6)) + _text(1)],
        [(1, 4, 4), (1, 2, 6)],
        False,
    ),
    "two_images_left_pad": (
        [_text(2) + _image((1, 4, 6)) + _text(3) + _image((1, 6, 2)) + _text(4), _text(5)],
        [(1, 4, 6), (1, 6, 2)],
        True,
    ),
    "image_first_and_last": (
        [_image((1, 2, 2))[1:] + _text(3) + _image((1, 8, 4))[:-1]],
        [(1, 2, 2), (1, 8, 4)],
        False,
    ),
    "mixed_batch": (
        [
            _text(7),
            _text(1) + _image((1, 4, 4)) + _text(2) + _image((1, 2, 4)) + _text(3),
            _image((1, 6, 6)) + _text(2),
        ],
        [(1, 4, 4), (1, 2, 4), (1, 6, 6)],
        False,
    ),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_matches_transformers(name: str) -> None:
    rows, grid_list, left_pad = LAYOUTS[name]
    ids, mask = _batch(rows, left_pad)
    grids = torch.tensor(grid_list)
    ours, our_deltas = get_rope_index(ids, grids, mask, image_token_id=IMAGE, spatial_merge_size=MERGE)
    theirs, their_deltas = _hf_rope_index(ids, grids, mask)
    valid = mask.bool()
    assert torch.equal(ours[:, valid], theirs[:, valid])
    assert torch.equal(our_deltas.view(-1), their_deltas.view(-1))
    assert torch.equal(ours[:, ~valid], torch.zeros_like(ours[:, ~valid]))
    assert ours.shape == (3, *ids.shape) and ours.dtype == torch.long


def test_text_only_is_arange_without_mask() -> None:
    ids = torch.tensor([_text(6), _text(6, first=40)])
    positions, deltas = get_rope_index(ids, None, None, image_token_id=IMAGE)
    assert torch.equal(positions, torch.arange(6).expand(3, 2, 6))
    assert torch.equal(deltas, torch.zeros(2, 1, dtype=torch.long))


def test_adjacent_images_are_split_by_their_grids() -> None:
    """Two images with no token between them: the grids, not the runs of image tokens, delimit them."""
    ids = torch.tensor([[7] + [IMAGE] * 2 + [IMAGE] * 1 + [8]])
    positions, _ = get_rope_index(ids, torch.tensor([[1, 2, 4], [1, 2, 2]]), image_token_id=IMAGE)
    expected = torch.tensor([[0, 1, 1, 3, 4], [0, 1, 1, 3, 4], [0, 1, 2, 3, 4]])
    assert torch.equal(positions[:, 0], expected)


@pytest.mark.parametrize(
    ("tokens", "grids"),
    [([IMAGE] * 4, [[1, 4, 6]]), ([IMAGE] * 4, []), ([IMAGE] * 4, [[1, 4, 4], [1, 2, 2]])],
)
def test_mismatched_grids_raise(tokens: list[int], grids: list[list[int]]) -> None:
    grid_tensor = torch.tensor(grids, dtype=torch.long).view(-1, 3) if grids else None
    with pytest.raises(ValueError, match="image"):
        get_rope_index(torch.tensor([[5, *tokens, 6]]), grid_tensor, image_token_id=IMAGE)
