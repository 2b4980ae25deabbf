"""A small synthetic geo3k-style data set: PIL-rendered geometry figures with "Find x." questions.

The files follow the verl / MindSpeed geo3k parquet layout (``train.parquet`` and ``test.parquet`` with the
columns data_source, prompt, images, ability, reward_model, extra_info), so the same reader, reward and trainer
code serves this set and the real geo3k.

Design constraint: this set feeds the GRPO demo that trains a TINY randomly initialised Qwen2.5-VL (vocab 1024,
4 layers, hidden 128) on 2 CPU cores for a few minutes, and the demo's mean reward must rise. Hence:

- the answer space is small: every answer is an integer 1..9, exactly one character, so the accuracy part of the
  reward is reachable by a model that can barely write ``\\boxed{7}``;
- the classes are balanced: each split draws its answers as a shuffled, near-uniform cycle over 1..9 (counts
  differ by at most one) and then a template that can produce that answer, so no class dominates;
- problems are short (under 30 words) and every answer is derivable from the figure or the text. Several
  templates make the mapping trivial (the answer is the only single-digit number printed in the question, or
  is the label on the equal side in the figure); the others need one step of arithmetic or counting;
- images are small (``image_size`` square, default 112 px -> 8x8 patches of 14 px -> 16 LLM tokens after the
  Qwen2.5-VL 2x2 patch merger) and labels use PIL's default font at a legible size.

Determinism: a seed gives identical parquet bytes (numpy Generators seeded from (seed, split), fixed PNG and
parquet writer options). Train and test use different seed streams. ``write_synthetic_geo3k`` writes into a
temporary directory beside ``out_dir`` and renames it into place; a complete set written with the same
arguments (recorded in a marker json, together with per-split class and template counts) is reused as is.
"""

from __future__ import annotations

import colorsys
import io
import json
import math
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFont

from mm_rl.files import replace_dir

INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)
DATA_SOURCE = "geo3k_synthetic"
ANSWERS: tuple[int, ...] = tuple(range(1, 10))
MARKER = "synthetic_geo3k.json"
SPLITS: tuple[str, ...] = ("train", "test")
MIN_IMAGE_SIZE = 56
_FORMAT_VERSION = 1
_DATA_FILES = ("train.parquet", "test.parquet")

SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string())]
            ),
        ),
    ]
)

Point = tuple[float, float]
RGB = tuple[int, int, int]


def answer_space() -> list[str]:
    """Every ground truth the set can contain, as strings: "1" .. "9"."""
    return [str(a) for a in ANSWERS]


# ---------------------------------------------------------------------------------------------------- drawing


@dataclass(frozen=True)
class Style:
    background: RGB
    fill: RGB
    line: RGB
    text: RGB


@dataclass
class Canvas:
    """One figure being drawn: the PIL drawing context plus the random stream and style it uses."""

    draw: ImageDraw.ImageDraw
    size: int
    font: ImageFont.FreeTypeFont | ImageFont.ImageFont
    font_px: int
    style: Style
    rng: np.random.Generator

    def uniform(self, low: float, high: float) -> float:
        return float(self.rng.uniform(low, high))

    def integer(self, low: int, high: int) -> int:
        """A uniform integer in [low, high] (both ends included)."""
        return int(self.rng.integers(low, high + 1))

    def choice(self, options: Sequence[int]) -> int:
        return int(options[int(self.rng.integers(len(options)))])


def _hsv(h: float, s: float, v: float) -> RGB:
    r, g, b = colorsys.hsv_to_rgb(h % 1.0, s, v)
    return round(r * 255), round(g * 255), round(b * 255)


def _random_style(rng: np.random.Generator) -> Style:
    """Light background, pale fill, dark outline and text: varied hues, always legible."""
    u = rng.uniform(size=8)
    return Style(
        background=_hsv(u[0], 0.12 * u[1], 0.94 + 0.06 * u[2]),
        fill=_hsv(u[3], 0.12 + 0.2 * u[4], 0.9 + 0.1 * u[5]),
        line=_hsv(u[6], 0.5 + 0.4 * u[7], 0.2 + 0.3 * u[1]),
        text=_hsv(u[3] + 0.5, 0.6, 0.1 + 0.15 * u[2]),
    )


@lru_cache(maxsize=8)
def _font(font_px: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """PIL's default font; the scalable version when this Pillow has FreeType, else the fixed bitmap font."""
    try:
        return ImageFont.load_default(size=font_px)
    except (TypeError, ImportError, OSError):
        return ImageFont.load_default()


def _rotate(points: Sequence[Point], degrees: float) -> list[Point]:
    c, s = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
    return [(x * c - y * s, x * s + y * c) for x, y in points]


def _fit(canvas: Canvas, points: Sequence[Point], fill: float, margin_fonts: float = 1.4) -> list[Point]:
    """Scale ``points`` so their larger extent is about ``fill`` of the free area, at a random position."""
    margin = margin_fonts * canvas.font_px
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    width, height = max(xs) - min(xs), max(ys) - min(ys)
    room = canvas.size - 2 * margin
    scale = fill * canvas.uniform(0.85, 1.0) * room / max(width, height, 1e-9)
    left = margin + canvas.uniform(0.0, max(room - width * scale, 0.0))
    top = margin + canvas.uniform(0.0, max(room - height * scale, 0.0))
    return [(left + (x - min(xs)) * scale, top + (y - min(ys)) * scale) for x, y in points]


def _centroid(points: Sequence[Point]) -> Point:
    return sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points)


def _text(canvas: Canvas, at: Point, text: str) -> None:
    """Draw ``text`` centred on ``at``, shifted as needed to stay inside the image."""
    left, top, right, bottom = canvas.draw.textbbox(at, text, font=canvas.font, anchor="mm")
    dx = max(1 - left, 0) - max(right - (canvas.size - 1), 0)
    dy = max(1 - top, 0) - max(bottom - (canvas.size - 1), 0)
    canvas.draw.text((at[0] + dx, at[1] + dy), text, fill=canvas.style.text, font=canvas.font, anchor="mm")


def _normal_away(p: Point, q: Point, away_from: Point) -> Point:
    """The unit normal of segment pq that points away from ``away_from``."""
    dx, dy = q[0] - p[0], q[1] - p[1]
    length = math.hypot(dx, dy) or 1.0
    nx, ny = -dy / length, dx / length
    mx, my = (p[0] + q[0]) / 2, (p[1] + q[1]) / 2
    if nx * (mx - away_from[0]) + ny * (my - away_from[1]) < 0:
        return -nx, -ny
    return nx, ny


def _side_label(canvas: Canvas, p: Point, q: Point, text: str, away_from: Point) -> None:
    """Label the side pq just outside it (on the side opposite ``away_from``)."""
    nx, ny = _normal_away(p, q, away_from)
    offset = 0.85 * canvas.font_px + 1
    _text(canvas, ((p[0] + q[0]) / 2 + nx * offset, (p[1] + q[1]) / 2 + ny * offset), text)


def _point_label(canvas: Canvas, point: Point, toward: Point, text: str) -> None:
    """Label ``point`` with ``text`` placed next to it in the direction of ``toward``, clear of the point."""
    dx, dy = toward[0] - point[0], toward[1] - point[1]
    length = math.hypot(dx, dy) or 1.0
    ux, uy = dx / length, dy / length
    left, top, right, bottom = canvas.draw.textbbox((0, 0), text, font=canvas.font, anchor="mm")
    offset = min((right - left) / 2 / max(abs(ux), 1e-6), (bottom - top) / 2 / max(abs(uy), 1e-6)) + 2
    _text(canvas, (point[0] + ux * offset, point[1] + uy * offset), text)


def _tick(canvas: Canvas, p: Point, q: Point) -> None:
    """A small congruence tick across the middle of pq."""
    dx, dy = q[0] - p[0], q[1] - p[1]
    length = math.hypot(dx, dy) or 1.0
    nx, ny = -dy / length * 3, dx / length * 3
    mx, my = (p[0] + q[0]) / 2, (p[1] + q[1]) / 2
    canvas.draw.line([(mx - nx, my - ny), (mx + nx, my + ny)], fill=canvas.style.line, width=1)


def _polygon(canvas: Canvas, points: Sequence[Point]) -> None:
    canvas.draw.polygon(list(points), fill=canvas.style.fill, outline=canvas.style.line, width=2)


def _outline(canvas: Canvas) -> dict[str, Any]:
    return {"fill": canvas.style.fill, "outline": canvas.style.line, "width": 2}


def _dot(canvas: Canvas, p: Point, radius: float = 2.0) -> None:
    box = (p[0] - radius, p[1] - radius, p[0] + radius, p[1] + radius)
    canvas.draw.ellipse(box, fill=canvas.style.line)


def _label_sides(canvas: Canvas, points: Sequence[Point], labels: dict[int, str]) -> None:
    """Label side i (from vertex i to vertex i+1) of a convex polygon with ``labels[i]``."""
    centre = _centroid(points)
    for i, text in labels.items():
        _side_label(canvas, points[i], points[(i + 1) % len(points)], text, centre)


# -------------------------------------------------------------------------------------------------- templates


def _others(answer: int) -> list[int]:
    return [a for a in ANSWERS if a != answer]


def _rectangle(canvas: Canvas, width: int, height: int, tilt: float = 30.0) -> list[Point]:
    """A rectangle roughly in the proportion width:height (clamped to 1:2), tilted, placed and drawn."""
    ratio = min(max(height / width, 0.5), 2.0)
    corners = _rotate([(0, 0), (1, 0), (1, ratio), (0, ratio)], canvas.uniform(-tilt, tilt))
    points = _fit(canvas, corners, 0.9)
    _polygon(canvas, points)
    return points


def _rect_opposite(canvas: Canvas, answer: int) -> str:
    other = canvas.choice(_others(answer))
    points = _rectangle(canvas, answer, other)
    _label_sides(canvas, points, {0: str(answer), 1: str(other), 2: "x"})
    return "Opposite sides of the rectangle are equal. Find x."


def _square_side(canvas: Canvas, answer: int) -> str:
    points = _rectangle(canvas, 1, 1)
    first = canvas.integer(0, 3)
    _label_sides(canvas, points, {first: str(answer), (first + canvas.integer(1, 3)) % 4: "x"})
    return f"All four sides of the square are equal. One side is {answer}. Find x."


def _square_perimeter(canvas: Canvas, answer: int) -> str:
    points = _rectangle(canvas, 1, 1)
    _label_sides(canvas, points, {canvas.integer(0, 3): "x"})
    return f"The perimeter of the square is {4 * answer}. Find x."


def _rect_perimeter(canvas: Canvas, answer: int) -> str:
    width = canvas.choice(_others(answer))
    points = _rectangle(canvas, width, answer)
    _label_sides(canvas, points, {0: str(width), 1: "x"})
    return f"The perimeter of the rectangle is {2 * (answer + width)}. Find x."


def _isosceles_leg(canvas: Canvas, answer: int) -> str:
    base = canvas.integer(1, min(9, 2 * answer - 1))
    half_apex = max(math.asin(base / (2 * answer)), math.radians(14))
    shape = [(0.0, 0.0), (math.sin(half_apex), math.cos(half_apex)), (-math.sin(half_apex), math.cos(half_apex))]
    points = _fit(canvas, _rotate(shape, canvas.uniform(0, 360)), 0.85)
    _polygon(canvas, points)
    _tick(canvas, points[0], points[1])
    _tick(canvas, points[2], points[0])
    _label_sides(canvas, points, {0: str(answer), 1: str(base), 2: "x"})
    return f"The triangle is isosceles with one leg {answer}. Find x."


def _triangle_from_angles(a_deg: float, b_deg: float) -> list[Point]:
    """Vertices with interior angles a (at vertex 0) and b (at vertex 1), side 0-1 of length 1."""
    c_rad = math.radians(180 - a_deg - b_deg)
    side = math.sin(math.radians(b_deg)) / math.sin(c_rad)
    return [(0.0, 0.0), (1.0, 0.0), (side * math.cos(math.radians(a_deg)), -side * math.sin(math.radians(a_deg)))]


def _triangle_angle(canvas: Canvas, answer: int) -> str:
    rest = 180 - 10 * answer
    first = 5 * canvas.integer(4, rest // 5 - 4)
    second = rest - first
    # Not to scale (like geo3k): angles are pulled towards 60 degrees so thin triangles stay readable.
    shown = [60 + 0.45 * (angle - 60) for angle in (first, second)]
    points = _fit(canvas, _rotate(_triangle_from_angles(*shown), canvas.uniform(0, 360)), 0.95, 2.0)
    _polygon(canvas, points)
    centre = _centroid(points)
    for vertex, text in zip(points, (f"{first}°", f"{second}°", "10x°"), strict=True):
        _point_label(canvas, vertex, (2 * vertex[0] - centre[0], 2 * vertex[1] - centre[1]), text)
    return f"Two angles of the triangle are {first} and {second} degrees. The third is 10x degrees. Find x."


def _circle_diameter(canvas: Canvas, answer: int) -> str:
    box = _fit(canvas, [(-1.0, -1.0), (1.0, 1.0)], 0.8)
    (cx, cy), radius = _centroid(box), (box[1][0] - box[0][0]) / 2
    canvas.draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), **_outline(canvas))
    p, q = [(cx + x, cy + y) for x, y in _rotate([(-radius, 0.0), (radius, 0.0)], canvas.uniform(0, 180))]
    canvas.draw.line([p, q], fill=canvas.style.line, width=2)
    _dot(canvas, (cx, cy))
    _text(canvas, ((cx + q[0]) / 2 + (q[1] - cy) * 0.25, (cy + q[1]) / 2 - (q[0] - cx) * 0.25), str(2 * answer))
    return f"The diameter of the circle is {2 * answer}. Find the radius x."


def _polygon_sides(canvas: Canvas, answer: int) -> str:
    angles = [math.radians(360 * k / answer) for k in range(answer)]
    shape = _rotate([(math.cos(t), math.sin(t)) for t in angles], canvas.uniform(0, 360))
    points = _fit(canvas, shape, 0.9)
    _polygon(canvas, points)
    for point in points:
        _dot(canvas, point)
    return "The regular polygon has x sides. Find x."


def _segment_sum(canvas: Canvas, answer: int) -> str:
    first = canvas.integer(1, 9)
    total = first + answer
    split = 0.2 + 0.6 * first / total  # not to scale: keeps A, B and C apart
    shape = _rotate([(0.0, 0.0), (split, 0.0), (1.0, 0.0)], canvas.uniform(-25, 25))
    a, b, c = _fit(canvas, shape, 0.9)
    canvas.draw.line([a, c], fill=canvas.style.line, width=2)
    below = (b[0] - (c[1] - a[1]), b[1] + (c[0] - a[0]))  # a point on the lower side of the line
    for point, name in zip((a, b, c), "ABC", strict=True):
        _dot(canvas, point)
        _point_label(canvas, point, below, name)
    _side_label(canvas, a, b, str(first), below)
    _side_label(canvas, b, c, "x", below)
    return f"Point B is on segment AC. AC = {total} and AB = {first}. Find x."


@dataclass(frozen=True)
class Template:
    """One kind of problem: ``build`` draws the figure for ``answer`` and returns the question text."""

    name: str
    answers: tuple[int, ...]
    source: str  # where the answer comes from: "text", "figure" or "text+figure"
    description: str
    build: Callable[[Canvas, int], str]


TEMPLATES: tuple[Template, ...] = (
    Template(
        "rect_opposite", ANSWERS, "figure", "rectangle; x is opposite the side labelled with the answer", _rect_opposite
    ),
    Template("square_side", ANSWERS, "text", "square; the question states one side, x labels another", _square_side),
    Template(
        "isosceles_leg",
        ANSWERS,
        "text",
        "isosceles triangle; the question states one leg, x is the other",
        _isosceles_leg,
    ),
    Template(
        "square_perimeter",
        ANSWERS,
        "text",
        "square with side x; the question gives the perimeter 4x",
        _square_perimeter,
    ),
    Template(
        "rect_perimeter",
        ANSWERS,
        "text+figure",
        "rectangle with sides w (labelled) and x; perimeter in text",
        _rect_perimeter,
    ),
    Template(
        "triangle_angle", ANSWERS, "text", "triangle with angles A, B and 10x degrees (also labelled)", _triangle_angle
    ),
    Template(
        "circle_diameter", ANSWERS, "text", "circle with a labelled diameter 2x; x is the radius", _circle_diameter
    ),
    Template(
        "polygon_sides", tuple(range(3, 10)), "figure", "regular polygon with x sides (count them)", _polygon_sides
    ),
    Template("segment_sum", ANSWERS, "text", "segment AC split at B; AC and AB given, x = BC", _segment_sum),
)


# ------------------------------------------------------------------------------------------------------- rows


# The embedded GRPO demo's problems: the question states the answer (one side of a square, one leg of an isosceles
# triangle), so a 4-layer model that learned to restate the givens can learn by RL, in minutes on 2 CPU cores, to
# box what it read. The other templates need arithmetic or counting that it does not learn in that time.
DEMO_TEMPLATES: tuple[str, ...] = ("square_side", "isosceles_leg")


def _templates_for(answer: int, names: Sequence[str] | None = None) -> list[Template]:
    return [t for t in TEMPLATES if answer in t.answers and (names is None or t.name in names)]


def render_problem(
    rng: np.random.Generator, answer: int, image_size: int, templates: Sequence[str] | None = None
) -> tuple[str, str, bytes]:
    """Draw one figure for ``answer``: (template name, question text, PNG bytes); ``templates`` limits the
    choice to those names (None: all)."""
    options = _templates_for(answer, templates)
    template = options[int(rng.integers(len(options)))]
    style = _random_style(rng)
    image = Image.new("RGB", (image_size, image_size), style.background)
    font_px = max(9, round(image_size * 0.105))
    canvas = Canvas(ImageDraw.Draw(image), image_size, _font(font_px), font_px, style, rng)
    problem = template.build(canvas, answer)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=6)
    return template.name, problem, buffer.getvalue()


def _row(split: str, index: int, problem: str, answer: int, png: bytes) -> dict[str, Any]:
    truth = str(answer)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": "<image>" + problem + " " + INSTRUCTION}],
        "images": [{"bytes": png, "path": None}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "answer": truth, "question": problem},
    }


def _split_rng(seed: int, split: str) -> np.random.Generator:
    """Independent streams per split, so test never replays train's draws."""
    return np.random.default_rng([seed, SPLITS.index(split), _FORMAT_VERSION])


def build_split(
    split: str,
    size: int,
    seed: int,
    image_size: int,
    templates: Sequence[str] | None = None,
) -> tuple[list[dict[str, Any]], Counter[str]]:
    """The rows of one split and how often each template was used."""
    rng = _split_rng(seed, split)
    answers = rng.permutation(np.arange(size) % len(ANSWERS) + 1)
    rows, used = [], Counter[str]()
    for index, answer in enumerate(answers.tolist()):
        name, problem, png = render_problem(rng, answer, image_size, templates)
        rows.append(_row(split, index, problem, answer, png))
        used[name] += 1
    return rows, used


def class_counts(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Rows per ground truth, for every answer in the answer space (zeros included)."""
    counts = Counter(row["reward_model"]["ground_truth"] for row in rows)
    return {answer: counts.get(answer, 0) for answer in answer_space()}


# ------------------------------------------------------------------------------------------------------ files


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    pq.write_table(table, path, compression="zstd", compression_level=3, row_group_size=1024)


def _args(
    seed: int, train_size: int, test_size: int, image_size: int, templates: Sequence[str] | None
) -> dict[str, Any]:
    args: dict[str, Any] = {
        "format": _FORMAT_VERSION,
        "seed": seed,
        "train_size": train_size,
        "test_size": test_size,
        "image_size": image_size,
    }
    if templates is not None:  # absent for the full set, so sets written before the option keep matching
        args["templates"] = sorted(templates)
    return args


def read_marker(out_dir: str | Path) -> dict[str, Any] | None:
    """The marker of a written set (arguments, class counts and template counts per split), or None."""
    try:
        return json.loads((Path(out_dir) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _is_complete(out_dir: Path, args: dict[str, Any]) -> bool:
    marker = read_marker(out_dir)
    return marker is not None and marker.get("args") == args and all((out_dir / name).is_file() for name in _DATA_FILES)


def _write_set(directory: Path, args: dict[str, Any]) -> None:
    sizes = {"train": args["train_size"], "test": args["test_size"]}
    marker: dict[str, Any] = {"args": args, "classes": {}, "templates": {}}
    for split in SPLITS:
        rows, templates = build_split(split, sizes[split], args["seed"], args["image_size"], args.get("templates"))
        _write_parquet(rows, directory / f"{split}.parquet")
        marker["classes"][split] = class_counts(rows)
        marker["templates"][split] = {t.name: templates.get(t.name, 0) for t in TEMPLATES}
    # Written last: its presence with matching args means the directory is complete.
    (directory / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for path in directory.iterdir():
        path.chmod(0o644)
    directory.chmod(0o755)


def _check_replaceable(out_dir: Path) -> None:
    """Only an empty directory or one of our own sets may be replaced; never a user's directory."""
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and not (out_dir / MARKER).is_file() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not a synthetic geo3k set; refusing to overwrite it")


def _swap_in(staging: Path, out_dir: Path, args: dict[str, Any]) -> None:
    """Rename the finished set into place; an existing out_dir (empty, or our set with other arguments) is
    moved aside and removed."""
    try:
        replace_dir(staging, out_dir)
    except OSError:
        if not _is_complete(out_dir, args):  # lost a race: fine only if the winner wrote the same set
            raise


def write_synthetic_geo3k(
    out_dir: str | Path,
    seed: int = 0,
    train_size: int = 512,
    test_size: int = 64,
    image_size: int = 112,
    templates: Sequence[str] | None = None,
) -> Path:
    """Write (or reuse) ``train.parquet`` and ``test.parquet`` of the synthetic set in ``out_dir``; return it.

    ``templates`` limits the problems to those template names (e.g. ``DEMO_TEMPLATES``; None: all of them).

    A set already written there with the same arguments is reused untouched; one written with other arguments
    is replaced atomically; any other non-empty ``out_dir`` is an error.
    """
    if train_size < 0 or test_size < 0:
        raise ValueError(f"split sizes must be >= 0, got train_size={train_size}, test_size={test_size}")
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be >= {MIN_IMAGE_SIZE} for legible labels, got {image_size}")
    out_dir = Path(out_dir).absolute()
    unknown = sorted(set(templates or ()) - {t.name for t in TEMPLATES})
    if unknown or (templates is not None and not templates):
        raise ValueError(f"unknown templates {unknown}; known: {[t.name for t in TEMPLATES]}")
    args = _args(seed, train_size, test_size, image_size, templates)
    if _is_complete(out_dir, args):
        return out_dir
    _check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.writing-", dir=out_dir.parent))
    try:
        _write_set(staging, args)
        _swap_in(staging, out_dir, args)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
