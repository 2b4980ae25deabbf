"""Prompt data set for GRPO: geo3k-style rows read from a directory and turned into the actor's inputs.

Three on-disk forms are detected per split (first match wins):

1. verl / MindSpeed parquet: ``{split}.parquet``; ``prompt`` is a list of chat messages whose content holds
   ``<image>`` placeholders and already ends with the instruction; ``reward_model.ground_truth`` is the answer.
2. raw HF ``geometry3k``: ``{split}-*.parquet`` or ``data/{split}-*.parquet``; ``problem`` is text starting with
   ``<image>`` and ``answer`` the label. The default keys fall back to these columns.
3. jsonl: ``{split}.jsonl``, one object per line; images are paths relative to the file, data URIs or base64.

A text prompt (forms 2 and 3) gets the instruction appended; a message list (form 1) is used as it is. Every
``<image>`` placeholder becomes an image part of its chat message and every ``<video>`` a video part (the videos
column, ``videos`` by default: files, bytes or lists of frame images, :mod:`mm_rl.data.video`); the chat template
renders the prompt with the generation prompt, and the processor expands each image pad to
``grid_thw.prod() / merge_size**2`` tokens and each video pad to what the model's own processor puts there (its pads,
and for Qwen3-VL / Qwen3.5 a timestamp and vision markers per frame pair).

The whole split is checked once when the data set is built (fields present, answer non-empty, every image
decodes, token count within ``max_prompt_length``), so nothing fails mid-epoch; rows that fail are skipped and
summarised in one warning. Only the encoded image bytes (or paths) are kept: pixels are decoded and processed on
access, so a 2k-row set never holds every processed image at once.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import itertools
import json
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from PIL import Image

from mm_rl.config.loader import ConfigError, Violation
from mm_rl.config.schema import BasicDataParameters, DataConfig, PreprocessParameters
from mm_rl.data.video import VideoClip, VideoSampling, VideoSettings, frames_clip, read_video

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
DEFAULT_INSTRUCTION = PreprocessParameters().instruction
# Used only when the configured key is the default and absent: the raw geometry3k columns.
KEY_FALLBACKS: dict[str, tuple[str, ...]] = {
    BasicDataParameters().prompt_key: ("problem",),
    BasicDataParameters().answer_key: ("answer",),
}
Form = Literal["verl", "geometry3k", "jsonl"]
ImageSource = bytes | Path
VideoSource = bytes | Path | tuple[ImageSource, ...]  # a file, or its frames
_MISSING = object()
_SHOWN_ROWS = 5  # row ids named in a summary line
T = TypeVar("T")


class BadRow(ValueError):
    """A row that cannot become a prompt; ``reason`` is a short category used to count such rows."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# --------------------------------------------------------------------------------------------- split files
@dataclass(frozen=True)
class SplitFiles:
    """The files of one split and the form they were detected as."""

    form: Form
    paths: tuple[Path, ...]


def find_split(dataset_dir: str | Path, split: str) -> SplitFiles:
    """Detect the form of ``split`` in ``dataset_dir``; a ValueError lists what was looked for."""
    root = Path(dataset_dir)
    if not root.is_dir():
        raise ValueError(f"dataset_dir {root} is not a directory")
    candidates: tuple[tuple[Form, list[Path]], ...] = (
        ("verl", [root / f"{split}.parquet"]),
        ("geometry3k", sorted(root.glob(f"{split}-*.parquet")) + sorted(root.glob(f"data/{split}-*.parquet"))),
        ("jsonl", [root / f"{split}.jsonl"]),
    )
    for form, paths in candidates:
        found = tuple(p for p in paths if p.is_file())
        if found:
            return SplitFiles(form, found)
    looked = f"{split}.parquet, {split}-*.parquet, data/{split}-*.parquet, {split}.jsonl"
    present = sorted(p.name for p in root.iterdir())[:10]
    raise ValueError(f"dataset_dir {root} has no '{split}' split: looked for {looked}; it holds {present}")


def _parquet_records(path: Path) -> Iterator[dict[str, Any] | BadRow]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # a corrupt file is a data error, not a crash
        raise ValueError(f"cannot read {path}: {error}") from error
    for batch in parquet.iter_batches(batch_size=256):
        yield from batch.to_pylist()


def _jsonl_records(path: Path) -> Iterator[dict[str, Any] | BadRow]:
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                yield BadRow("invalid json line")
                continue
            yield record if isinstance(record, dict) else BadRow("json line is not an object")


def read_records(files: SplitFiles) -> Iterator[tuple[dict[str, Any] | BadRow, Path]]:
    """Every row of the split in file order, with the directory relative image paths resolve against."""
    reader = _jsonl_records if files.form == "jsonl" else _parquet_records
    for path in files.paths:
        for record in reader(path):
            yield record, path.parent


# ------------------------------------------------------------------------------------------------ fields
def lookup(record: dict[str, Any], key: str) -> Any:
    """The value at a dotted path (``reward_model.ground_truth``) or ``_MISSING``; None counts as missing."""
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            return _MISSING
        value = value[part]
    return value


def field_value(record: dict[str, Any], key: str) -> Any:
    """``key``'s value, else a fallback column of the raw geometry3k layout when ``key`` is the default."""
    for candidate in (key, *KEY_FALLBACKS.get(key, ())):
        value = lookup(record, candidate)
        if value is not _MISSING:
            return value
    raise BadRow(f"missing field '{key}'")


def answer_text(value: Any) -> str:
    """The ground truth as a string; numbers are accepted (jsonl), blanks and containers are not."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise BadRow("answer is not text")
    text = str(value).strip()
    if not text:
        raise BadRow("empty answer")
    return text


def _text_parts(text: str) -> list[dict[str, Any]]:
    """Split on ``<image>`` / ``<video>``: each placeholder becomes an image or video part, the text between text
    parts."""
    parts: list[dict[str, Any]] = []
    for chunk in re.split(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})", text):
        if chunk in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER):
            parts.append({"type": chunk[1:-1]})
        elif chunk:
            parts.append({"type": "text", "text": chunk})
    return parts


def _message(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRow("prompt message without a role")
    content = message.get("content")
    if isinstance(content, str):
        return {"role": message["role"], "content": _text_parts(content)}
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        return {"role": message["role"], "content": content}
    raise BadRow("prompt message content is neither text nor parts")


def _is_image_part(part: dict[str, Any]) -> bool:
    return part.get("type") == "image" or "image" in part or "image_url" in part


def _is_video_part(part: dict[str, Any]) -> bool:
    return part.get("type") == "video" or "video" in part or "video_url" in part


def build_messages(prompt: Any, instruction: str, num_images: int, num_videos: int = 0) -> list[dict[str, Any]]:
    """Chat messages with one image part per image and one video part per video.

    A text prompt is one user message with the instruction appended (unless the text already holds it); a
    message list is taken as is. With no placeholder of a kind at all, that kind's items go before the first user
    text (images, then videos), the Qwen convention; otherwise placeholders and items must agree in number.
    """
    if isinstance(prompt, str):
        text = f"{prompt} {instruction}" if instruction and instruction not in prompt else prompt
        messages = [{"role": "user", "content": _text_parts(text)}]
    elif isinstance(prompt, list) and prompt:
        messages = [_message(m) for m in prompt]
    else:
        raise BadRow("prompt is neither text nor a list of messages")
    user = next((m for m in messages if m["role"] == "user"), messages[-1])
    for kind, is_part, count in (("video", _is_video_part, num_videos), ("image", _is_image_part, num_images)):
        placeholders = sum(is_part(p) for m in messages for p in m["content"])
        if placeholders == 0 and count:
            user["content"] = [{"type": kind} for _ in range(count)] + user["content"]
        elif placeholders != count:
            raise BadRow(f"{kind} placeholders != {kind}s")
    return messages


# ------------------------------------------------------------------------------------------------ images
def _decode_base64(text: str) -> bytes:
    payload = text.split(",", 1)[1] if text.startswith("data:") else text
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise BadRow("image is neither a file nor base64") from error


def image_source(value: Any, base_dir: Path) -> ImageSource:
    """Where an image's encoded bytes are: the bytes themselves or a file (relative paths from ``base_dir``)."""
    if isinstance(value, dict):  # parquet {bytes, path} (HF Image feature, verl) or the same in jsonl
        if value.get("bytes") is not None:
            raw = value["bytes"]
            return raw if isinstance(raw, bytes) else _decode_base64(str(raw))
        value = value.get("path")
    if isinstance(value, bytes):
        return value
    if not isinstance(value, str) or not value:
        raise BadRow("image entry has neither bytes nor a path")
    if value.startswith("data:") or len(value) > 4096 or "\n" in value:
        return _decode_base64(value)
    path = base_dir / value
    return path if path.is_file() else _decode_base64(value)


def image_sources(value: Any, base_dir: Path) -> list[ImageSource]:
    entries = value if isinstance(value, list) else [value]
    return [image_source(entry, base_dir) for entry in entries]


def video_sources(value: Any, base_dir: Path) -> list[VideoSource]:
    """A row's videos: each a file (path, bytes, ``{bytes, path}``) or a list of frame images."""
    entries = value if isinstance(value, list) else [value]
    try:
        return [
            tuple(image_sources(entry, base_dir)) if isinstance(entry, list) else image_source(entry, base_dir)
            for entry in entries
        ]
    except BadRow as error:
        raise BadRow(error.reason.replace("image", "video")) from error


def open_video(source: VideoSource, sampling: VideoSampling) -> VideoClip:
    """The video's sampled frames (see :mod:`mm_rl.data.video`); BadRow when it does not decode."""
    try:
        if isinstance(source, tuple):
            return frames_clip([open_image(frame) for frame in source], sampling)
        return read_video(source, sampling)
    except BadRow as error:
        raise BadRow("undecodable video frame") from error
    except ValueError as error:
        raise BadRow("undecodable video") from error


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with transparency composited on white.

    Line drawings are often black on a transparent background; a plain ``convert("RGB")`` (what the HF image
    processor does) would turn them into a black square. Actor and rollout engine both get this RGB image, so
    neither converts it again differently.
    """
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def open_image(source: ImageSource) -> Image.Image:
    """Decode fully (so truncated files fail here, not later) and convert to RGB."""
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
            image.load()
            return to_rgb(image)
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise BadRow("undecodable image") from error


@dataclass(frozen=True)
class RowFields:
    """What a row holds before any pixel is decoded: its messages, image and video sources, and answer."""

    messages: list[dict[str, Any]]
    images: list[ImageSource]
    videos: list[VideoSource]
    ground_truth: str


def parse_fields(record: dict[str, Any], base_dir: Path, keys: Mapping[str, str], instruction: str) -> RowFields:
    """A row's fields: every check that needs neither the pixels nor the tokenizer (``keys``: the ``prompt``,
    ``answer``, ``image`` and ``video`` columns); raises BadRow."""
    prompt = field_value(record, keys["prompt"])
    truth = answer_text(field_value(record, keys["answer"]))
    raw_images, raw_videos = lookup(record, keys["image"]), lookup(record, keys.get("video", "videos"))
    images = [] if raw_images is _MISSING else image_sources(raw_images, base_dir)
    videos = [] if raw_videos is _MISSING else video_sources(raw_videos, base_dir)
    try:
        messages = build_messages(prompt, instruction, len(images), len(videos))
    except BadRow as error:
        for kind, raw in (("image", raw_images), ("video", raw_videos)):
            if raw is _MISSING and error.reason == f"{kind} placeholders != {kind}s":
                raise BadRow(f"missing field '{keys.get(kind, kind + 's')}'") from error
        raise
    return RowFields(messages, images, videos, truth)


# --------------------------------------------------------------------------------------------- processor
@dataclass
class Visuals:
    """A prompt's images and videos as the model takes them, in the order their pads appear in the prompt: pixel
    values [patches, C*T*P*P] and one grid row [t, h, w] per entry (a video whose processor puts text between its
    frame pairs, Qwen3-VL's timestamps, is one entry per frame pair), with each entry's mRoPE time step (1 for an
    image; a Qwen2.5-VL video's ``tokens_per_second x second_per_grid_t``)."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor  # [entries, 3] long
    time_steps: torch.Tensor  # [entries] float64


class PromptProcessor:
    """Chat template + Qwen2-VL image processor + tokenizer: the prompt inputs the Qwen2.5-VL processor makes.

    Built from a tokenizer and an image processor, so image-only data works without the video processor (which
    needs torchvision). Image pads are expanded on token ids, which equals the processor's string expansion because
    ``<|image_pad|>`` is a single special token. ``min_pixels`` / ``max_pixels`` go to the image processor. Videos
    use the checkpoint's own processor (loaded on the first video): its video processor for the pixels and its
    ``replace_video_token`` for the text a video pad becomes.
    """

    def __init__(
        self, model_name_or_path: str | Path, min_pixels: int, max_pixels: int, video: VideoSettings | None = None
    ) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        if not 0 < min_pixels <= max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {min_pixels} and {max_pixels}")
        self.model_name_or_path = model_name_or_path
        self.tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
        if not self.tokenizer.chat_template:
            raise ValueError(f"{model_name_or_path} has no chat template (chat_template.jinja / tokenizer_config)")
        self.image_processor = AutoImageProcessor.from_pretrained(
            model_name_or_path, min_pixels=min_pixels, max_pixels=max_pixels
        )
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.video = video or VideoSettings()
        self.merge_size: int = self.image_processor.merge_size
        self.image_pad, self.video_pad = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id: int = self.tokenizer.convert_tokens_to_ids(self.image_pad)
        self.video_token_id: int = self.tokenizer.convert_tokens_to_ids(self.video_pad)
        self._full: Any = None

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text for the rollout engine: chat template with the generation prompt, one pad per image and
        per video."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def image_tokens(self, width: int, height: int) -> int:
        """LLM tokens for an image of this size after the pixel bounds and the patch merger."""
        return self.image_processor.get_number_of_image_patches(height, width, {}) // self.merge_size**2

    def text_ids(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def expand(self, ids: list[int], counts: Sequence[int]) -> list[int]:
        """Replace the i-th image pad with ``counts[i]`` pads."""
        positions = [i for i, token in enumerate(ids) if token == self.image_token_id]
        if len(positions) != len(counts):
            raise BadRow("image pads in the text != images")
        out: list[int] = []
        start = 0
        for position, count in zip(positions, counts, strict=True):
            out += ids[start:position] + [self.image_token_id] * count
            start = position + 1
        return out + ids[start:]

    # ---------------------------------------------------------------------------------------------- videos
    @property
    def full(self) -> Any:
        """The checkpoint's own processor (tokenizer, image and video processors), loaded on first use."""
        if self._full is None:
            from transformers import AutoProcessor

            self._full = AutoProcessor.from_pretrained(self.model_name_or_path)
        return self._full

    def video_grid(self, clip: VideoClip) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel values [patches, C*T*P*P], grid [t, h, w]) of a clip with the job's settings."""
        out = self.full.video_processor(
            videos=[list(clip.frames)], video_metadata=[video_metadata(clip)], do_sample_frames=False,
            return_tensors="pt", **self.video.processor_kwargs(),
        )  # fmt: skip
        return out["pixel_values_videos"], out["video_grid_thw"][0].long()

    def video_text(self, clip: VideoClip, grid: torch.Tensor) -> str:
        """What the clip's one video pad becomes in the prompt text (the model's processor's own rule)."""
        inputs = {"video_grid_thw": grid[None], "video_metadata": [video_metadata(clip)]}
        return self.full.replace_video_token(inputs, 0)

    def video_time_step(self, clip: VideoClip) -> float:
        """The clip's mRoPE time step, as vLLM computes it (``vllm/model_executor/models/qwen2_vl.py``
        ``iter_mm_grid_thw``): the config's ``tokens_per_second`` (1 when absent) x ``second_per_grid_t``
        (``temporal_patch_size / sampled fps`` where the processor reports it, Qwen2.5-VL; else 1)."""
        if "second_per_grid_ts" not in self.full.model_input_names:
            return self.tokens_per_second
        sampled_fps = len(clip.frames_indices) / clip.total_num_frames * clip.fps
        return self.tokens_per_second * self.full.video_processor.temporal_patch_size / sampled_fps

    @functools.cached_property
    def tokens_per_second(self) -> float:
        """The checkpoint's ``vision_config.tokens_per_second`` (1 when absent, as vLLM reads it)."""
        from transformers import AutoConfig

        vision = getattr(AutoConfig.from_pretrained(self.model_name_or_path), "vision_config", None)
        return float(getattr(vision, "tokens_per_second", 1.0) or 1.0)

    def expand_videos(self, text: str, placeholders: Sequence[str]) -> str:
        """``text`` with its i-th video pad replaced by ``placeholders[i]`` (:meth:`video_text` of video i)."""
        pieces = text.split(self.video_pad)
        if len(pieces) - 1 != len(placeholders):
            raise BadRow("video pads in the text != videos")
        pairs = zip(placeholders, pieces[1:], strict=True)
        return pieces[0] + "".join(placeholder + piece for placeholder, piece in pairs)

    def frames_apart(self, placeholder: str) -> bool:
        """Whether a video's placeholder puts text between its frame pairs (Qwen3-VL's timestamps): the model then
        takes each frame pair as an entry of its own."""
        return len(re.findall(f"(?:{re.escape(self.video_pad)})+", placeholder)) > 1

    def count_video_grid(self, clip: VideoClip) -> torch.Tensor:
        """A grid with the clip's token counts (t, then h x w in one axis) without processing its pixels."""
        import torch

        width, height = clip.size
        kwargs = self.video.processor_kwargs()
        patches = self.full.video_processor.get_num_of_video_patches(len(clip.frames), height, width, kwargs)
        frames = -(-len(clip.frames) // self.full.video_processor.temporal_patch_size)
        return torch.tensor([frames, patches // frames, 1])

    # ---------------------------------------------------------------------------------------------- encode
    def num_tokens(self, text: str, sizes: Sequence[tuple[int, int]], clips: Sequence[VideoClip]) -> int:
        """A prompt's length, image and video tokens included, without processing any pixel."""
        if clips:
            text = self.expand_videos(text, [self.video_text(clip, self.count_video_grid(clip)) for clip in clips])
        return len(self.expand(self.text_ids(text), [self.image_tokens(w, h) for w, h in sizes]))

    def encode(self, text: str, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids [S], pixel_values [patches, C*T*P*P], image_grid_thw [images, 3]) for one image prompt."""
        ids, visuals = self.encode_prompt(text, images, ())
        return ids, visuals.pixel_values, visuals.grid_thw

    def encode_prompt(
        self, text: str, images: list[Image.Image], clips: Sequence[VideoClip]
    ) -> tuple[torch.Tensor, Visuals]:
        """(input_ids [S], the images' and videos' model inputs in the order their pads appear) for one prompt."""
        import torch

        patch_dim = 3 * self.image_processor.temporal_patch_size * self.image_processor.patch_size**2
        if images:
            vision = self.image_processor(images=images, return_tensors="pt")
            image_pixels, image_grid = vision["pixel_values"], vision["image_grid_thw"].long()
        else:
            image_pixels, image_grid = torch.zeros(0, patch_dim), torch.zeros(0, 3, dtype=torch.long)
        videos = [self.video_grid(clip) for clip in clips]
        placeholders = [self.video_text(clip, grid) for clip, (_, grid) in zip(clips, videos, strict=True)]
        if videos:
            text = self.expand_videos(text, placeholders)
        counts = (image_grid.prod(dim=-1) // self.merge_size**2).tolist()
        ids = torch.tensor(self.expand(self.text_ids(text), counts), dtype=torch.long)
        if not videos:
            return ids, Visuals(image_pixels, image_grid, torch.ones(len(image_grid), dtype=torch.float64))
        return ids, self._in_order(ids, image_pixels, image_grid, clips, videos, placeholders)

    def _in_order(
        self,
        ids: torch.Tensor,
        image_pixels: torch.Tensor,
        image_grid: torch.Tensor,
        clips: Sequence[VideoClip],
        videos: Sequence[tuple[torch.Tensor, torch.Tensor]],
        placeholders: Sequence[str],
    ) -> Visuals:
        """The images' and videos' entries in the order their first pads appear in ``ids``."""
        import torch

        offsets = torch.cat([image_grid.new_zeros(1), image_grid.prod(-1).cumsum(0)]).tolist()
        ones = torch.ones(1, dtype=torch.float64)
        image_entries = [
            (image_pixels[offsets[i] : offsets[i + 1]], image_grid[i : i + 1], ones) for i in range(len(image_grid))
        ]
        video_entries = []
        for clip, (pixels, grid), placeholder in zip(clips, videos, placeholders, strict=True):
            if self.frames_apart(placeholder):  # one entry per frame pair; pixels are frame-major already
                grids, step = grid.new_tensor([1, int(grid[1]), int(grid[2])]).repeat(int(grid[0]), 1), 1.0
            else:
                grids, step = grid[None], self.video_time_step(clip)
            video_entries.append((pixels, grids, torch.full((len(grids),), step, dtype=torch.float64)))
        sources = {self.image_token_id: iter(image_entries), self.video_token_id: iter(video_entries)}
        left = dict.fromkeys(sources, 0)  # pads of the current image / video still to pass
        entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for token in ids.tolist():
            if token in sources:
                if not left[token]:
                    entries.append(next(sources[token]))
                    left[token] = int(entries[-1][1].prod(-1).sum()) // self.merge_size**2
                left[token] -= 1
        return Visuals(
            torch.cat([e[0] for e in entries]), torch.cat([e[1] for e in entries]), torch.cat([e[2] for e in entries])
        )


def video_metadata(clip: VideoClip) -> Any:
    """The clip's metadata as transformers' video processors take it."""
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(**{k: v for k, v in clip.metadata().items() if k != "do_sample_frames"})


# -------------------------------------------------------------------------------------------------- items
@dataclass
class PromptItem:
    """One prompt, ready for the actor (ids, pixels) and the rollout engine (text, images, videos).

    ``pixel_values`` / ``image_grid_thw`` hold the images' and the videos' model inputs in the order their pads
    appear (:class:`Visuals`); ``mrope_time_steps`` their time steps when the prompt has a video (None without)."""

    row_id: int  # position of the row in its split (files in sorted order), stable across runs
    input_ids: torch.Tensor  # [S] long, image and video pads expanded (their tokens included)
    prompt_text: str  # chat-templated text with ONE <|image_pad|> per image, <|video_pad|> per video (vLLM's form)
    images: list[Image.Image]  # decoded RGB originals; the engine applies the same min/max pixels
    pixel_values: torch.Tensor  # [patches, 3 * temporal_patch * patch**2] float32
    image_grid_thw: torch.Tensor  # [entries, 3] long
    ground_truth: str
    videos: list[VideoClip] = field(default_factory=list)  # sampled frames; the engine gets the same ones
    mrope_time_steps: torch.Tensor | None = None  # [entries] float64


def prompt_item(
    processor: PromptProcessor, row_id: int, text: str, images: list[Image.Image], clips: list[VideoClip], truth: str
) -> PromptItem:
    """The processed prompt of a row's text, images and videos."""
    ids, visuals = processor.encode_prompt(text, images, clips)
    steps = visuals.time_steps if clips else None
    return PromptItem(row_id, ids, text, images, visuals.pixel_values, visuals.grid_thw, truth, clips, steps)


@dataclass(frozen=True)
class _Row:
    row_id: int
    prompt_text: str
    images: tuple[ImageSource, ...]
    ground_truth: str
    num_tokens: int
    videos: tuple[VideoSource, ...] = ()
    frames: tuple[int, ...] = ()  # sampled per video


@dataclass
class LoadStats:
    """What happened to the rows of a split when it was loaded."""

    rows: int = 0
    kept: int = 0
    bad: Counter[str] = field(default_factory=Counter)
    bad_ids: list[int] = field(default_factory=list)
    too_long: int = 0
    too_long_ids: list[int] = field(default_factory=list)
    longest: int = 0
    most_videos: int = 0  # the most videos one row holds (``count_usable_rows``'s rows)
    columns: list[str] = field(default_factory=list)  # of the first row, to name the keys a config could use

    def bad_summary(self) -> str:
        reasons = ", ".join(f"{n} {reason}" for reason, n in self.bad.most_common())
        return f"{reasons} (rows {_ids(self.bad_ids)})"

    def too_long_summary(self, limit: int) -> str:
        return (
            f"{self.too_long} longer than max_prompt_length={limit} tokens (longest {self.longest}; rows "
            f"{_ids(self.too_long_ids)})"
        )


def _ids(ids: list[int]) -> str:
    shown = ", ".join(str(i) for i in ids[:_SHOWN_ROWS])
    return shown + (", ..." if len(ids) > _SHOWN_ROWS else "")


def checked_rows(files: SplitFiles, parse: Callable[[dict[str, Any], Path, int], T], stats: LoadStats) -> Iterator[T]:
    """``parse(record, base_dir, row_id)`` of every row in file order; rows it rejects with BadRow (and lines that
    are no record) are counted in ``stats`` and skipped. Lazy, so a caller that has seen enough stops reading."""
    for row_id, (record, base_dir) in enumerate(read_records(files)):
        stats.rows += 1
        if not stats.columns and isinstance(record, dict):
            stats.columns = sorted(record)
        try:
            if isinstance(record, BadRow):
                raise record
            row = parse(record, base_dir, row_id)
        except BadRow as error:
            stats.bad[error.reason] += 1
            stats.bad_ids.append(row_id)
            continue
        yield row


def count_usable_rows(files: SplitFiles, basic: BasicDataParameters, instruction: str, enough: int) -> LoadStats:
    """The rows of a split that pass ``parse_fields`` (all but the image decode and the prompt length), read only
    until ``enough`` are found: what ``check`` can afford on a real data set. ``kept`` stops at ``enough``; the data
    set may keep fewer (images that do not decode, prompts too long). ValueError for a file that cannot be read."""
    keys = _keys(basic)
    stats = LoadStats()
    rows = checked_rows(files, lambda record, base_dir, _: parse_fields(record, base_dir, keys, instruction), stats)
    for row in itertools.islice(rows, max(1, enough)):
        stats.kept += 1
        stats.most_videos = max(stats.most_videos, len(row.videos))
    return stats


def sample_decodes(
    files: SplitFiles,
    basic: BasicDataParameters,
    instruction: str,
    sample: int = 16,
    kind: Literal["image", "video"] = "image",
    sampling: VideoSampling | None = None,
) -> tuple[int, int]:
    """(images / videos that do not decode, those tried) among the first ``sample`` of the split's usable rows:
    ``check``'s bounded look at the pixels (a data set whose images are all truncated fails here, not in ``train``)."""
    keys = _keys(basic)
    rows = checked_rows(
        files, lambda record, base_dir, _: parse_fields(record, base_dir, keys, instruction), LoadStats()
    )
    opened = ((open_image, source) for row in rows for source in row.images) if kind == "image" else (
        (functools.partial(open_video, sampling=sampling or VideoSampling()), source)
        for row in rows
        for source in row.videos
    )  # fmt: skip
    failed = tried = 0
    for open_one, source in itertools.islice(opened, sample):
        tried += 1
        try:
            open_one(source)
        except BadRow:
            failed += 1
    return failed, tried


def _keys(basic: BasicDataParameters) -> dict[str, str]:
    return {"prompt": basic.prompt_key, "answer": basic.answer_key, "image": basic.image_key, "video": basic.video_key}


# ------------------------------------------------------------------------------------------------ dataset
_DATA = "backend_config.data.dataset_param"


class NoUsableRows(ValueError):
    """A split none of whose rows can be used (``stats``: why)."""

    def __init__(self, message: str, stats: LoadStats) -> None:
        super().__init__(message)
        self.stats = stats

    def violation(self, dataset_dir: str, max_prompt_length: int) -> Violation:
        """The job key to change: ``max_prompt_length`` when every row read was only too long, else the data."""
        if self.stats.too_long and not self.stats.bad:
            return Violation(
                f"{_DATA}.preprocess_parameters.max_prompt_length", max_prompt_length, str(self),
                f"raise it to at least {self.stats.longest} (the longest prompt, image tokens included), or lower "
                "max_pixels so images take fewer tokens",
            )  # fmt: skip
        return Violation(
            f"{_DATA}.basic_parameters.dataset_dir", dataset_dir, str(self),
            "fix the rows named (the reasons say what is wrong), or point dataset_dir at another data set",
        )  # fmt: skip


class PromptDataset(Sequence[PromptItem]):
    """The usable prompts of one split; ``dataset[i]`` decodes and processes row i on access."""

    def __init__(
        self,
        dataset_dir: str | Path,
        split: str,
        processor: PromptProcessor,
        *,
        prompt_key: str = "prompt",
        answer_key: str = "reward_model.ground_truth",
        image_key: str = "images",
        video_key: str = "videos",
        instruction: str = DEFAULT_INSTRUCTION,
        max_prompt_length: int = 1024,
    ) -> None:
        self.dataset_dir, self.split, self.processor = Path(dataset_dir), split, processor
        self.keys = {"prompt": prompt_key, "answer": answer_key, "image": image_key, "video": video_key}
        self.instruction, self.max_prompt_length = instruction, max_prompt_length
        self.files = find_split(self.dataset_dir, split)
        self.stats = LoadStats()
        self._rows = self._scan()
        self._report()

    @classmethod
    def from_config(
        cls, data: DataConfig, which: Literal["train", "val"], processor: PromptProcessor | None = None
    ) -> PromptDataset:
        """The train or validation split of the job's data section (pass ``processor`` to share one)."""
        basic, pre = data.dataset_param.basic_parameters, data.dataset_param.preprocess_parameters
        processor = processor or PromptProcessor(
            pre.model_name_or_path, pre.min_pixels, pre.max_pixels, VideoSettings.from_config(pre)
        )
        try:
            return cls(
                basic.dataset_dir,
                basic.train_split if which == "train" else basic.val_split,
                processor,
                prompt_key=basic.prompt_key,
                answer_key=basic.answer_key,
                image_key=basic.image_key,
                video_key=basic.video_key,
                instruction=pre.instruction,
                max_prompt_length=pre.max_prompt_length,
            )
        except NoUsableRows as err:  # known only once every row is processed: check's format, at run time
            raise ConfigError([err.violation(basic.dataset_dir, pre.max_prompt_length)]) from None

    @property
    def form(self) -> Form:
        return self.files.form

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> PromptItem:  # type: ignore[override]
        row = self._rows[index]
        images = [open_image(source) for source in row.images]
        clips = [open_video(source, self.processor.video.sampling) for source in row.videos]
        return prompt_item(self.processor, row.row_id, row.prompt_text, images, clips, row.ground_truth)

    def num_tokens(self, index: int) -> int:
        """Prompt length of item ``index`` (image tokens included) without processing its images."""
        return self._rows[index].num_tokens

    def ground_truth(self, index: int) -> str:
        return self._rows[index].ground_truth

    def row_id(self, index: int) -> int:
        return self._rows[index].row_id

    def prompt_text(self, index: int) -> str:
        """The chat-templated prompt of item ``index`` (one image placeholder per image), without its images."""
        return self._rows[index].prompt_text

    def video_frames(self, index: int) -> list[int]:
        """The frames sampled from each of item ``index``'s videos (counted when the set was read)."""
        return list(self._rows[index].frames)

    # ----------------------------------------------------------------------------------------- loading
    def _parse(self, record: dict[str, Any], base_dir: Path, row_id: int) -> _Row:
        """Check one record completely (images and videos decoded once) and measure its prompt; raises BadRow."""
        fields = parse_fields(record, base_dir, self.keys, self.instruction)
        sizes = [open_image(source).size for source in fields.images]
        clips = [open_video(source, self.processor.video.sampling) for source in fields.videos]
        text = self.processor.render(fields.messages)
        num_tokens = self.processor.num_tokens(text, sizes, clips)
        frames = tuple(len(clip.frames) for clip in clips)
        return _Row(row_id, text, tuple(fields.images), fields.ground_truth, num_tokens, tuple(fields.videos), frames)

    def _scan(self) -> list[_Row]:
        rows: list[_Row] = []
        for row in checked_rows(self.files, self._parse, self.stats):
            if row.num_tokens > self.max_prompt_length:
                self.stats.too_long += 1
                self.stats.too_long_ids.append(row.row_id)
                self.stats.longest = max(self.stats.longest, row.num_tokens)
                continue
            rows.append(row)
        self.stats.kept = len(rows)
        return rows

    def _report(self) -> None:
        where = f"{self.dataset_dir} split '{self.split}' ({self.form})"
        if not self._rows:
            problems = [self.stats.bad_summary()] if self.stats.bad else []
            if self.stats.too_long:
                problems.append(self.stats.too_long_summary(self.max_prompt_length))
            detail = "; ".join(problems) or "the files hold no rows"
            raise NoUsableRows(f"no usable row in {where}: {self.stats.rows} rows read; {detail}", self.stats)
        if self.stats.bad:
            logger.warning(
                "%s: skipped %d of %d rows: %s",
                where,
                sum(self.stats.bad.values()),
                self.stats.rows,
                self.stats.bad_summary(),
            )
        if self.stats.too_long:
            logger.warning("%s: dropped %s", where, self.stats.too_long_summary(self.max_prompt_length))
