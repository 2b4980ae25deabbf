"""Training metrics: one jsonl line per step (the record of truth), TensorBoard, optional wandb / swanlab.

The jsonl file is flushed after every step so a killed run keeps every finished step; a torn last line (a
crash mid-write) is tolerated when reading and repaired when a logger reopens the file. ``rewind`` cuts the
history back when a run starts: to the checkpoint's step on a resume, to nothing on a fresh start, in the jsonl
file and in TensorBoard's event files alike, so no step is ever recorded twice. ``step_line`` is the one console
line per step and ``plot_metrics`` draws a PNG of the curves, both from the same keys.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mm_rl.files import atomic_path, write_atomic

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
_EVENT_FILES = "events.out.tfevents.*"  # SummaryWriter's names (TensorBoard reads every name holding "tfevents")
DEFAULT_PLOT_KEYS = ("reward/score", "reward/accuracy", "actor/kl_loss", "response_length/mean")
DEFAULT_VAL_KEYS = ("val/reward/score", "val/reward/accuracy")
VAL_PREFIX = "val/"

# (metric key, console label, format) in the order the console line shows them.
_STEP_LINE_FIELDS = (
    ("reward/score", "reward", "{:.3f}"),
    ("reward/accuracy", "acc", "{:.3f}"),
    ("actor/kl_loss", "kl", "{:.2e}"),
    ("response_length/mean", "len", "{:.0f}"),
    ("timing/step", "time", "{:.1f}s"),
    ("throughput/tok_per_s", "tok/s", "{:,.0f}"),
)


def to_float(value: Any) -> float:
    """A plain float from a Python number, a one-element tensor or a numpy scalar (what step code produces)."""
    if hasattr(value, "item"):
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError) as error:
        raise TypeError(f"metric value {value!r} is not a number") from error


def _json_value(value: float) -> float | None:
    """JSON has no NaN/inf: a non-finite value is written as null so every line stays strict JSON."""
    return value if math.isfinite(value) else None


def _complete_lines(path: Path) -> list[str]:
    """The file's lines that parse; an unparsable last line is a torn write and is dropped, one mid-file is an error."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        return []
    try:
        json.loads(lines[-1])
    except json.JSONDecodeError:
        logger.warning("%s: dropping a torn last line (a run stopped mid-write)", path)
        lines = lines[:-1]
    return lines


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """Every step record in a metrics jsonl file, tolerating a torn last line; a missing file is no history."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(_complete_lines(path), start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not a JSON line ({error})") from error
    return records


def truncate_after(path: Path | str, step: int) -> None:
    """Drop records with ``step`` past a checkpoint's, so a resumed run continues the history without duplicates."""
    path = Path(path)
    if not path.exists():
        return
    kept = [line for line in _complete_lines(path) if json.loads(line)["step"] <= step]
    write_atomic(path, "".join(f"{line}\n" for line in kept), sync=False)


def rewind(out_dir: Path | str, step: int | None, files: Sequence[str] = (METRICS_FILE,)) -> None:
    """Cut ``out_dir``'s history (the jsonl ``files``, whose records carry ``step``, and TensorBoard) back to
    checkpoint ``step`` before a run continues from it, or to nothing (``None``) before a fresh start, so a
    repeated step never appears twice (as it would after runs killed before their first checkpoint).

    TensorBoard's event files are rewritten too, keeping only events up to ``step``: its readers do not replace a
    step logged twice by the later value (they show both, or purge by heuristics that depend on the reader), so
    leaving the old events would show the steps past the checkpoint beside the rerun ones."""
    out_dir = Path(out_dir)
    for name in files:
        truncate_after(out_dir / name, -1 if step is None else step)
    _rewind_events(out_dir / TENSORBOARD_DIR, step)


def _rewind_events(tb_dir: Path, step: int | None) -> None:
    """Keep the events up to ``step`` (every kind: scalars, text) in one file that takes the oldest file's name,
    so that it sorts before the files a resumed run writes; delete the rest. ``None`` deletes them all."""
    files = sorted(tb_dir.glob(_EVENT_FILES))
    if not files:
        return
    if step is not None:
        from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter

        kept = [
            record
            for path in files
            for record in RawEventFileLoader(str(path)).Load()  # a torn tail ends it
            if Event.FromString(record).step <= step
        ]
        with atomic_path(files[0], mode=0o644) as tmp, open(tmp, "wb") as f:
            writer = RecordWriter(f)
            for record in kept:
                writer.write(record)
        files = files[1:]
    for path in files:
        path.unlink()


def _repair_torn_tail(path: Path) -> None:
    """Rewrite a file whose last line is torn, so the next append starts on a line of its own."""
    if path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        write_atomic(path, "".join(f"{line}\n" for line in _complete_lines(path)), sync=False)


def _import_optional(name: str) -> Any:
    """The module, or None with one notice: a missing tracker must never stop training."""
    try:
        return __import__(name)
    except ImportError:
        logger.warning(
            "%s logging was requested but %s is not installed; skipping it (pip install %s)", name, name, name
        )
        return None


class MetricsLogger:
    """Writes each step's metrics to jsonl (always), TensorBoard (by default) and wandb / swanlab (when asked)."""

    def __init__(
        self,
        out_dir: Path | str,
        *,
        tensorboard: bool = True,
        wandb: bool = False,
        swanlab: bool = False,
        run_name: str = "",
        project: str = "mm_rl",
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / METRICS_FILE
        _repair_torn_tail(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = self._open_tensorboard() if tensorboard else None
        self._wandb = self._open_wandb(project, run_name) if wandb else None
        self._swanlab = self._open_swanlab(project, run_name) if swanlab else None

    def _open_tensorboard(self) -> Any:
        """Imported here so building a logger without TensorBoard never pays for torch's writer."""
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(self.out_dir / TENSORBOARD_DIR))

    def _open_wandb(self, project: str, run_name: str) -> Any:
        module = _import_optional("wandb")
        if module is not None:
            module.init(project=project, name=run_name or None, dir=str(self.out_dir))
        return module

    def _open_swanlab(self, project: str, run_name: str) -> Any:
        module = _import_optional("swanlab")
        if module is not None:
            module.init(project=project, experiment_name=run_name or None, logdir=str(self.out_dir / "swanlab"))
        return module

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one step; the jsonl line is flushed before returning so a crash loses no finished step."""
        values = {key: to_float(value) for key, value in metrics.items()}
        record = {"step": int(step), **{key: _json_value(value) for key, value in values.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        for tracker in (self._wandb, self._swanlab):
            if tracker is not None:
                tracker.log(values, step=step)

    def log_generations(self, step: int, split: str, entries: Sequence[dict[str, Any]]) -> None:
        """A step's generation records (see :mod:`mm_rl.trainer.generations`): TensorBoard text, wandb / swanlab
        tables."""
        from mm_rl.trainer.generations import COLUMNS, markdown, table_rows

        tag = f"generations/{split}"
        if self._tb is not None:
            self._tb.add_text(tag, markdown(entries), global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({tag: self._wandb.Table(columns=list(COLUMNS), data=table_rows(entries))}, step=step)
        if self._swanlab is not None:
            self._swanlab.log({tag: [self._swanlab.Text(markdown([e])) for e in entries]}, step=step)

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for tracker in (self._wandb, self._swanlab):
            if tracker is not None:
                tracker.finish()
        self._wandb = self._swanlab = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def step_line(step: int, total: int, metrics: Mapping[str, Any]) -> str:
    """The one console line per step: progress first, then the numbers a user watches; missing keys are skipped."""
    parts = [f"step {step:>{len(str(total))}}/{total}"]
    for key, label, fmt in _STEP_LINE_FIELDS:
        value = metrics.get(key)
        if value is None:
            continue
        number = to_float(value)
        parts.append(f"{label} {fmt.format(number) if math.isfinite(number) else number}")
    return " | ".join(parts)


def _series(records: Iterable[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) for one key, skipping steps where it is absent or null."""
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def _panels(records: list[dict[str, Any]], keys: Sequence[str], val_keys: Sequence[str]) -> dict[str, list[str]]:
    """Panel title -> keys drawn on it: a val key joins its training key's panel, else gets its own."""
    panels: dict[str, list[str]] = {key: [key] for key in keys if _series(records, key)[0]}
    for val_key in val_keys:
        if not _series(records, val_key)[0]:
            continue
        train_key = val_key.removeprefix(VAL_PREFIX)
        panels.setdefault(train_key if train_key in keys else val_key, []).append(val_key)
    return panels


def plot_metrics(
    jsonl_path: Path | str,
    png_path: Path | str,
    keys: Sequence[str] = DEFAULT_PLOT_KEYS,
    val_keys: Sequence[str] = DEFAULT_VAL_KEYS,
) -> Path:
    """Draw one panel per metric against step (validation overlaid) to a PNG, written atomically; returns its path."""
    from matplotlib.figure import Figure  # Figure needs no pyplot, so no global backend or GUI state

    records = read_metrics(jsonl_path)
    panels = _panels(records, keys, val_keys)
    columns = min(2, max(1, len(panels)))
    rows = max(1, math.ceil(len(panels) / columns))
    figure = Figure(figsize=(6 * columns, 3.5 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, (title, panel_keys) in zip(axes, panels.items(), strict=False):
        for key in panel_keys:
            steps, values = _series(records, key)
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(panel_keys) > 1:
            ax.legend(fontsize="small")
    for ax in axes[len(panels) :]:
        ax.axis("off")
    if not panels:
        axes[0].text(0.5, 0.5, "no metrics yet", ha="center", va="center")
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(png_path, suffix=".png") as tmp:
        figure.savefig(tmp, format="png", dpi=100)
    return png_path
