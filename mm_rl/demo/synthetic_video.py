"""A small synthetic video set: clips of the synthetic geo3k figures and of numbers, with "Find x." questions.

Three kinds of problem, in turn:

- ``turning``: the demo's figure (:data:`mm_rl.demo.synthetic.DEMO_TEMPLATES`: the question states the answer) drawn
  in every frame, turned a little further each frame; what the tiny model learns by RL in minutes on 2 cores, as in
  the image demo;
- ``last_frame``: every frame shows a number, the question asks for the number of the last frame: only the frames
  answer it (a prompt that needs more than one frame's worth of looking);
- ``figures``: one to three figures as images (``images/``), the question stating the last one's answer: prompts
  with several images, their count varying.

The visuals come first and the question right after, as in the prompts the tiny model's format warm-up saw.

Videos are stored both ways the data path reads, in turn: MP4 files (``videos/``, written with OpenCV at ``FPS``)
and lists of PNG frames (``frames/``, taken as recorded at the job's ``fps``). The rows are jsonl
(``train.jsonl``, ``test.jsonl``: ``prompt`` text with a ``<video>`` tag, ``videos``, ``reward_model.ground_truth``);
a set written with the same arguments (recorded in a marker) is reused, another is replaced atomically.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from mm_rl.demo.synthetic import ANSWERS, DEMO_TEMPLATES, INSTRUCTION, SPLITS, _font, render_problem
from mm_rl.files import replace_dir

MARKER = "synthetic_video.json"
FPS = 2.0
KINDS = ("turning", "last_frame", "figures")
_FORMAT_VERSION = 1


def _turning(rng: np.random.Generator, answer: int, size: int, frames: int) -> tuple[str, list[Image.Image]]:
    """The demo's figure for ``answer``, turned by a few degrees more in every frame."""
    _, problem, png = render_problem(rng, answer, size, DEMO_TEMPLATES)
    figure = Image.open(io.BytesIO(png)).convert("RGB")
    background = figure.getpixel((0, 0))
    step = float(rng.uniform(4.0, 10.0)) * (1 if rng.integers(2) else -1)
    clip = [figure.rotate(step * k, resample=Image.Resampling.BILINEAR, fillcolor=background) for k in range(frames)]
    return problem, clip


def _last_frame(rng: np.random.Generator, answer: int, size: int, frames: int) -> tuple[str, list[Image.Image]]:
    """A number per frame (the last one ``answer``), each in a colour of its own."""
    numbers = [int(rng.choice(ANSWERS)) for _ in range(frames - 1)] + [answer]
    font = _font(max(12, size // 2))
    clip = []
    for number in numbers:
        shade = tuple(int(v) for v in rng.integers(170, 256, 3))
        frame = Image.new("RGB", (size, size), shade)  # type: ignore[arg-type]
        ImageDraw.Draw(frame).text((size / 2, size / 2), str(number), fill=(20, 20, 20), font=font, anchor="mm")
        clip.append(frame)
    return "Each frame of the clip shows a number; x is the number in the last frame. Find x.", clip


def _figures(rng: np.random.Generator, answer: int, size: int) -> tuple[str, list[Image.Image]]:
    """One to three figures, the last one's for ``answer`` (the question states it)."""
    count = int(rng.integers(1, 4))
    others = [render_problem(rng, int(rng.choice(ANSWERS)), size, DEMO_TEMPLATES)[2] for _ in range(count - 1)]
    _, problem, png = render_problem(rng, answer, size, DEMO_TEMPLATES)
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in [*others, png]]
    return "<image>" * count + problem, images


def _write_mp4(frames: list[Image.Image], path: Path) -> None:
    import cv2

    width, height = frames[0].size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), FPS, (width, height))
    try:
        for frame in frames:
            writer.write(cv2.cvtColor(np.asarray(frame), cv2.COLOR_RGB2BGR))
    finally:
        writer.release()


def _row(directory: Path, split: str, index: int, rng: np.random.Generator, answer: int, args: dict[str, Any]) -> dict:
    kind = KINDS[index % len(KINDS)]
    row: dict[str, Any] = {"reward_model": {"ground_truth": str(answer)}, "extra_info": {"split": split,
                           "index": index, "kind": kind}}  # fmt: skip
    if kind == "figures":
        question, images = _figures(rng, answer, args["image_size"])
        names = [f"images/{split}_{index:05d}_{k}.png" for k in range(len(images))]
        for image, name in zip(images, names, strict=True):
            image.save(directory / name, format="PNG", compress_level=6)
        return row | {"prompt": f"{question} {INSTRUCTION}", "images": names}
    build = _turning if kind == "turning" else _last_frame
    question, frames = build(rng, answer, args["image_size"], args["frames"])
    if (index // len(KINDS)) % 2 == 0:
        video: Any = f"videos/{split}_{index:05d}.mp4"
        _write_mp4(frames, directory / video)
    else:
        video = [f"frames/{split}_{index:05d}_{k}.png" for k in range(len(frames))]
        for frame, name in zip(frames, video, strict=True):
            frame.save(directory / name, format="PNG", compress_level=6)
    return row | {"prompt": f"<video>{question} {INSTRUCTION}", "videos": [video]}


def write_synthetic_video(
    out_dir: str | Path,
    seed: int = 0,
    train_size: int = 256,
    test_size: int = 32,
    image_size: int = 84,
    frames: int = 6,
) -> Path:
    """Write (or reuse) the set in ``out_dir``; return it. ``frames`` per clip (at ``FPS``: 3 s by default)."""
    if min(train_size, test_size) < 0 or frames < 1:
        raise ValueError(f"need sizes >= 0 and frames >= 1, got {train_size}, {test_size}, {frames}")
    out_dir = Path(out_dir).absolute()
    args = {"format": _FORMAT_VERSION, "seed": seed, "train_size": train_size, "test_size": test_size,
            "image_size": image_size, "frames": frames}  # fmt: skip
    try:
        if json.loads((out_dir / MARKER).read_text(encoding="utf-8")) == args:
            return out_dir
    except (OSError, ValueError):
        if out_dir.is_dir() and any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} holds something else than a synthetic video set: not replaced") from None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.writing-", dir=out_dir.parent))
    try:
        for folder in ("videos", "frames", "images"):
            (staging / folder).mkdir()
        for split, size in zip(SPLITS, (train_size, test_size), strict=True):
            rng = np.random.default_rng([seed, SPLITS.index(split), _FORMAT_VERSION])
            answers = rng.permutation(np.arange(size) % len(ANSWERS) + 1).tolist()
            rows = [_row(staging, split, i, rng, answer, args) for i, answer in enumerate(answers)]
            lines = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
            (staging / f"{split}.jsonl").write_text(lines, encoding="utf-8")
        (staging / MARKER).write_text(json.dumps(args, sort_keys=True), encoding="utf-8")  # last: complete
        replace_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
