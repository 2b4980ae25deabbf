"""Videos of a prompt: where a row's video is, how its frames are sampled, and the decoded clip both the actor and
the rollout engine receive.

A video is a file (path or encoded bytes, decoded with OpenCV's FFmpeg reader, the one decoder that installs from the
package index beside every pinned torch) or a list of frame images (taken as recorded at ``fps``). Frames are sampled
as qwen-vl-utils does: ``duration x fps`` frames, at least ``min_frames`` and at most ``max_frames`` (nor more than
the video has), an even count (the ViT pairs frames, ``temporal_patch_size`` 2), spread evenly over the whole video;
a one-frame video gives its frame twice. mm_rl samples once, here, and hands the sampled frames with their
metadata (source fps, frame count, the indices taken) to the processor and to vLLM with frame sampling off, so the
two never sample differently and Qwen3-VL's timestamps and Qwen2.5-VL's time positions come from the same numbers.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mm_rl.config.schema import PreprocessParameters

FRAME_FACTOR = 2  # frames the ViT pairs into one temporal patch (Qwen2-VL .. Qwen3.5: temporal_patch_size 2)


@dataclass(frozen=True)
class VideoSampling:
    """How frames are taken from a video (the job's ``fps`` / ``min_frames`` / ``max_frames``)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 32

    def frame_indices(self, total: int, native_fps: float) -> list[int]:
        """The source frames taken from a video of ``total`` frames recorded at ``native_fps``."""
        if total <= 0:
            raise ValueError("a video needs at least one frame")
        wanted = total / native_fps * self.fps
        count = min(max(round(wanted), self.min_frames), self.max_frames)
        # an even count, never more frames than the video has (one pair at least: a one-frame video's frame twice)
        count = max(FRAME_FACTOR, min(count, total) // FRAME_FACTOR * FRAME_FACTOR)
        return np.linspace(0, total - 1, count).round().astype(int).tolist()


@dataclass(frozen=True)
class VideoSettings:
    """How a job's videos are sampled and sized (``preprocess_parameters``: fps, min / max frames, video pixels)."""

    sampling: VideoSampling = field(default_factory=VideoSampling)
    min_pixels: int = PreprocessParameters().video_min_pixels
    max_pixels: int = PreprocessParameters().video_max_pixels

    @classmethod
    def from_config(cls, pre: PreprocessParameters) -> VideoSettings:
        return cls(VideoSampling(pre.fps, pre.min_frames, pre.max_frames), pre.video_min_pixels, pre.video_max_pixels)

    def processor_kwargs(self) -> dict[str, Any]:
        """The model's video processor's settings, for the actor's processor and vLLM's alike (``size`` is per frame
        for Qwen2-VL / Qwen2.5-VL and the whole clip for Qwen3-VL / Qwen3.5, each processor's own meaning;
        ``cap_pixels_per_frame`` set so transformers' default, due to change in 5.22, cannot part them)."""
        return {
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "cap_pixels_per_frame": False,
        }


@dataclass(frozen=True)
class VideoClip:
    """A video's sampled frames (RGB) and where they came from: what the processor and vLLM both get."""

    frames: tuple[Image.Image, ...]
    fps: float  # the source's frames per second
    total_num_frames: int  # the source's frame count
    frames_indices: tuple[int, ...]  # the source frames taken, one per entry of ``frames``

    @property
    def size(self) -> tuple[int, int]:
        return self.frames[0].size

    def metadata(self) -> dict[str, Any]:
        """transformers' ``VideoMetadata`` fields, and vLLM's (which also reads ``do_sample_frames``): the frames
        are sampled already."""
        width, height = self.size
        return {
            "total_num_frames": self.total_num_frames,
            "fps": self.fps,
            "width": width,
            "height": height,
            "duration": self.total_num_frames / self.fps,
            "video_backend": "opencv",
            "frames_indices": list(self.frames_indices),
            "do_sample_frames": False,
        }

    def array(self) -> np.ndarray:
        """The frames as one uint8 array [T, H, W, 3] (what vLLM's video input holds)."""
        return np.stack([np.asarray(frame) for frame in self.frames])


def read_video(source: bytes | Path, sampling: VideoSampling) -> VideoClip:
    """Decode the sampled frames of a video file (path or encoded bytes); ValueError when it does not decode."""
    if isinstance(source, bytes):
        handle, name = tempfile.mkstemp(suffix=".video")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(source)
            return read_video(Path(name), sampling)
        finally:
            os.unlink(name)
    import cv2

    capture = cv2.VideoCapture(str(source))
    try:
        if not capture.isOpened():
            raise ValueError("the file does not open as a video")
        total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        native_fps = float(capture.get(cv2.CAP_PROP_FPS))
        if total <= 0 or not math.isfinite(native_fps) or native_fps <= 0:
            raise ValueError("the video reports no frames or no frame rate")
        indices = sampling.frame_indices(total, native_fps)
        wanted, frames = set(indices), {}
        for index in range(max(indices) + 1):  # sequential reads: seeking is inexact in some codecs
            if not capture.grab():
                raise ValueError(f"the video ends at frame {index} of the {total} it reports")
            if index in wanted:
                ok, frame = capture.retrieve()
                if not ok:
                    raise ValueError(f"frame {index} does not decode")
                frames[index] = Image.fromarray(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    finally:
        capture.release()
    return VideoClip(tuple(frames[i] for i in indices), native_fps, total, tuple(indices))


def frames_clip(frames: Sequence[Image.Image], sampling: VideoSampling) -> VideoClip:
    """A video given as frame images, taken as recorded at ``sampling.fps``, sampled like a file."""
    if not frames:
        raise ValueError("a video needs at least one frame")
    sizes = {frame.size for frame in frames}
    if len(sizes) > 1:
        raise ValueError(f"the frames differ in size: {sorted(sizes)}")
    indices = sampling.frame_indices(len(frames), sampling.fps)
    return VideoClip(tuple(frames[i] for i in indices), sampling.fps, len(frames), tuple(indices))
