"""What a rollout engine does with prompts it cannot take as they are: a policy per case, counted, never a crash.

Checked per request, before the engine sees it:

* structure: the image pads in ``prompt_ids`` must form one run per image (an image block the engine can match
  to its picture), and there may be at most ``max_images_per_prompt`` images (vLLM's ``limit_mm_per_prompt``);
  otherwise the request is skipped (``image_unusable_skipped``).
* images: one with an aspect ratio above 200 (the Qwen2-VL resize rejects it) is skipped whatever the policy. One
  whose pixel count lies outside ``[min_pixels, max_pixels]`` is counted, then under ``image_bounds="resize"``
  kept: the Qwen2-VL image processor of the actor and of the engine rescales it into the bounds with the same
  rule, so the engine's image-token count still equals the actor's. Under ``"skip"`` the request is dropped.
* length: a prompt longer than ``max_model_len - max_tokens`` (so that a full-length response still fits) is
  dropped under ``prompt_overflow="skip"``. Under ``"truncate"`` its earliest text tokens are removed (left
  truncation, as the end holds the question and the generation prompt) while every image block is kept whole, so
  the actor's ``pixel_values`` / ``image_grid_thw`` still apply; a prompt whose image blocks alone do not fit is
  dropped. The truncated ids are what the engine returns as the output's ``prompt_ids``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from mm_rl.rollout.base import RolloutMetrics, RolloutRequest

if TYPE_CHECKING:
    from mm_rl.config.schema import GenerateConfig

MAX_ASPECT_RATIO = 200  # Qwen2-VL smart_resize raises above this


@dataclass(frozen=True)
class BoundsPolicy:
    """Limits and policies, from ``generate_config``, the data section's pixel bounds and the model config."""

    max_model_len: int
    min_pixels: int
    max_pixels: int
    prompt_overflow: Literal["skip", "truncate"] = "skip"
    image_bounds: Literal["resize", "skip"] = "resize"
    max_images_per_prompt: int = 1
    max_videos_per_prompt: int = 0
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    def __post_init__(self) -> None:
        if self.prompt_overflow not in ("skip", "truncate"):
            raise ValueError(f"prompt_overflow must be 'skip' or 'truncate', got {self.prompt_overflow!r}")
        if self.image_bounds not in ("resize", "skip"):
            raise ValueError(f"image_bounds must be 'resize' or 'skip', got {self.image_bounds!r}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels} and {self.max_pixels}")

    def max_prompt_len(self, max_tokens: int) -> int:
        """Longest prompt that leaves room for ``max_tokens``; a non-positive room is a configuration error."""
        room = self.max_model_len - max_tokens
        if room < 1:
            raise ValueError(
                f"max_tokens={max_tokens} leaves no room for a prompt in max_model_len={self.max_model_len}"
            )
        return room


def token_ids_of(model_path: str | Path) -> dict[str, int]:
    """The image pad and vision start / end ids from a HF checkpoint's config.json (tokenizer-specific)."""
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    ids = {
        "image_token_id": config.get("image_token_id"),
        "vision_start_token_id": config.get("vision_start_token_id"),
        "vision_end_token_id": config.get("vision_end_token_id"),
    }
    return {key: int(value) for key, value in ids.items() if value is not None}


def policy_from_config(
    generate_config: GenerateConfig, model_path: str | Path, min_pixels: int, max_pixels: int
) -> BoundsPolicy:
    """The policy of a ``GenerateConfig`` for the model in ``model_path``."""
    return BoundsPolicy(
        max_model_len=int(generate_config.max_model_len),
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        prompt_overflow=generate_config.prompt_overflow,
        image_bounds=generate_config.image_bounds,
        max_images_per_prompt=generate_config.max_images_per_prompt,
        max_videos_per_prompt=generate_config.max_videos_per_prompt,
        **token_ids_of(model_path),
    )


@dataclass
class Admission:
    """The request the engine gets (None when skipped), why it was skipped, and whether it was truncated."""

    request: RolloutRequest | None
    skipped: str | None = None
    truncated: bool = False


# ---------------------------------------------------------------------------------------------- structure
def image_runs(ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of image pads: one run per image."""
    runs, start = [], None
    for i, token in enumerate(ids):
        if token == image_token_id and start is None:
            start = i
        elif token != image_token_id and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(ids)))
    return runs


def collapse_image_pads(ids: Sequence[int], image_token_id: int) -> list[int]:
    """The ids with each run of image pads reduced to one pad: the form vLLM expands itself from the image."""
    return [t for i, t in enumerate(ids) if t != image_token_id or i == 0 or ids[i - 1] != image_token_id]


def _image_count(request: RolloutRequest) -> int:
    if request.images:
        return len(request.images)
    return 0 if request.image_grid_thw is None else int(request.image_grid_thw.shape[0])


def _image_problem(request: RolloutRequest, policy: BoundsPolicy, metrics: RolloutMetrics) -> str | None:
    """None when the images are usable (out-of-bounds ones counted), else the reason to skip."""
    runs = len(image_runs(request.prompt_ids, policy.image_token_id))
    if runs != _image_count(request):
        return "image_pads_mismatch"
    if runs > policy.max_images_per_prompt:
        return "too_many_images"
    if len(request.videos) > policy.max_videos_per_prompt:
        return "too_many_videos"
    out_of_bounds = 0
    for image in request.images:
        width, height = image.size
        if min(width, height) < 1 or max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
            return "image_aspect_ratio"
        out_of_bounds += not policy.min_pixels <= width * height <= policy.max_pixels
    metrics.images_out_of_bounds += out_of_bounds
    if out_of_bounds and policy.image_bounds == "skip":
        return "image_out_of_bounds"
    metrics.images_resized += out_of_bounds
    return None


# ------------------------------------------------------------------------------------------------- length
def _protected(ids: Sequence[int], policy: BoundsPolicy) -> list[bool]:
    """Which positions belong to an image block (vision start .. vision end, or a bare pad run)."""
    keep = [False] * len(ids)
    inside = False
    for i, token in enumerate(ids):
        if token == policy.vision_start_token_id:
            inside = True
        keep[i] = inside or token == policy.image_token_id
        if token == policy.vision_end_token_id:
            inside = False
    return keep


def truncate_left(ids: Sequence[int], limit: int, policy: BoundsPolicy) -> list[int] | None:
    """Drop the earliest text tokens until ``len <= limit``, keeping image blocks whole; None if impossible."""
    excess = len(ids) - limit
    if excess <= 0:
        return list(ids)
    keep = _protected(ids, policy)
    if len(ids) - sum(not k for k in keep) > limit:
        return None
    out = []
    for token, protected in zip(ids, keep, strict=True):
        if not protected and excess > 0:
            excess -= 1
            continue
        out.append(token)
    return out


def _admit(request: RolloutRequest, policy: BoundsPolicy, limit: int, metrics: RolloutMetrics) -> Admission:
    problem = _image_problem(request, policy, metrics)
    if problem is not None:
        if problem == "image_out_of_bounds":
            metrics.image_bounds_skipped += 1
        else:
            metrics.image_unusable_skipped += 1
        return Admission(None, problem)
    if len(request.prompt_ids) <= limit:
        return Admission(request)
    # a video prompt goes to the engine as its text (Qwen3-VL's timestamps cannot be rebuilt from ids): never cut
    truncates = policy.prompt_overflow == "truncate" and not request.videos
    shorter = truncate_left(request.prompt_ids, limit, policy) if truncates else None
    if shorter is None:
        metrics.prompt_overflow_skipped += 1
        return Admission(None, "prompt_overflow")
    metrics.prompt_overflow_truncated += 1
    metrics.prompt_tokens_truncated += len(request.prompt_ids) - len(shorter)
    return Admission(dataclasses.replace(request, prompt_ids=shorter, prompt_text=None), truncated=True)


def apply_bounds(
    requests: Sequence[RolloutRequest], policy: BoundsPolicy, max_tokens: int
) -> tuple[list[Admission], RolloutMetrics]:
    """One admission per request, in order, and the batch metrics with the policy counts filled in."""
    limit = policy.max_prompt_len(max_tokens)
    metrics = RolloutMetrics(prompts=len(requests))
    admitted = [_admit(request, policy, limit, metrics) for request in requests]
    metrics.prompts_skipped = sum(item.request is None for item in admitted)
    return admitted, metrics


def vision_token_ids(tokenizer: Any, tokens: tuple[str, ...]) -> frozenset[int]:
    """Ids of the family's vision special tokens the tokenizer knows (a response must not carry them, see the
    trainer and the multi-turn loop)."""
    unknown = tokenizer.unk_token_id
    ids = (tokenizer.convert_tokens_to_ids(token) for token in tokens)
    return frozenset(int(i) for i in ids if i is not None and i != unknown)
