"""What the model says: a sample of each step's prompts with their n responses, and every validation generation.

``af_output_dir/generations.jsonl`` gets one record per prompt (step, split, data-set row, prompt, ground truth and
the group's responses with reward, accuracy, length, finish reason, advantage), so a user can read what the model
answers at step 1 and at step 60 without writing code; the same goes to TensorBoard as text and to wandb / swanlab
as tables through :class:`~mm_rl.trainer.metrics.MetricsLogger`. Records carry ``step`` like the metrics, so a
resumed run cuts the file back with the same function.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mm_rl.trainer.batch import Sample

GENERATIONS_FILE = "generations.jsonl"
COLUMNS = ("step", "split", "row", "prompt", "ground_truth", "response", "reward", "accuracy", "length", "finish")


def groups_of(samples: Sequence[Sample]) -> list[list[Sample]]:
    """The samples grouped by prompt, in the order their prompts first appear."""
    groups: dict[tuple[int, int], list[Sample]] = {}
    for sample in samples:
        groups.setdefault((sample.group, sample.index), []).append(sample)
    return list(groups.values())


def pick(groups: Sequence[list[Sample]], k: int) -> list[list[Sample]]:
    """``k`` groups spread evenly over the step's (first, ..., last): the same choice every run, no RNG touched."""
    if k <= 0 or not groups:
        return []
    if k >= len(groups):
        return list(groups)
    if k == 1:
        return [groups[0]]
    return [groups[i * (len(groups) - 1) // (k - 1)] for i in range(k)]


def _response(sample: Sample) -> dict[str, Any]:
    advantage = sample.advantages
    return {
        "text": sample.text,
        "reward": sample.reward,
        "accuracy": sample.components.get("accuracy"),
        "length": sample.response_len,
        "finish": sample.finish_reason,
        "advantage": float(advantage[0]) if advantage is not None and advantage.numel() else None,
    } | _turns(sample)


def _turns(sample: Sample) -> dict[str, Any]:
    """A multi-turn trajectory's counts (its text shows every turn)."""
    turns = sample.turns
    if turns is None:
        return {}
    return {"turns": turns.turns, "tool_calls": turns.tool_calls, "tool_errors": turns.tool_errors}


def records(
    step: int,
    split: str,
    groups: Sequence[list[Sample]],
    row_of: Callable[[int], int],
    prompt_of: Callable[[int], str],
    frames_of: Callable[[int], list[int]] = lambda _: [],
) -> list[dict[str, Any]]:
    """One record per prompt: the prompt (as the model sees it, chat template and image / video placeholders
    included), the frames sampled from each of its videos (``video_frames``, when it has videos) and its
    responses."""
    out = []
    for group in groups:
        index = group[0].index
        record = {"step": step, "split": split, "row": row_of(index), "prompt": prompt_of(index)}
        if frames := frames_of(index):
            record["video_frames"] = frames
        out.append(record | {"ground_truth": group[0].ground_truth, "responses": [_response(s) for s in group]})
    return out


def table_rows(entries: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """One row per response in :data:`COLUMNS` order (wandb / swanlab tables)."""
    return [
        [
            e["step"],
            e["split"],
            e["row"],
            e["prompt"],
            e["ground_truth"],
            r["text"],
            r["reward"],
            r["accuracy"],
            r["length"],
            r["finish"],
        ]
        for e in entries
        for r in e["responses"]
    ]


def markdown(entries: Sequence[dict[str, Any]]) -> str:
    """The records as TensorBoard markdown: a heading per prompt, a line per response."""
    lines: list[str] = []
    for e in entries:
        lines.append(f"**row {e['row']}** (answer `{e['ground_truth']}`)\n\n```\n{e['prompt']}\n```\n")
        for r in e["responses"]:
            accuracy = "" if r["accuracy"] is None else f", acc {r['accuracy']:.0f}"
            text = r["text"].replace("\n", " ")
            lines.append(f"- reward {r['reward']:.3f}{accuracy}, {r['length']} tokens ({r['finish']}): `{text}`")
        lines.append("")
    return "\n".join(lines)


class GenerationLog:
    """Appends records to ``generations.jsonl`` (flushed per call, like the metrics) and hands them to ``sink``
    (anything with ``log_generations(step, split, records)``, the metrics logger)."""

    def __init__(self, out_dir: Path | str, per_step: int, prompts: Any, sink: Any = None) -> None:
        self.per_step, self.prompts, self.sink = per_step, prompts, sink
        self.path = Path(out_dir) / GENERATIONS_FILE
        self._file = self.path.open("a", encoding="utf-8") if per_step > 0 else None

    def log(self, step: int, split: str, samples: Sequence[Sample]) -> None:
        """``per_step`` prompts of a train step; every prompt of a validation."""
        if self._file is None:
            return
        groups = groups_of(samples)
        chosen = pick(groups, self.per_step) if split == "train" else groups
        entries = records(
            step,
            split,
            chosen,
            lambda i: self.prompts.row_id(i, split),
            lambda i: self.prompts.prompt_text(i, split),
            lambda i: self.prompts.video_frames(i, split),
        )
        for entry in entries:
            self._file.write(json.dumps(entry) + "\n")
        self._file.flush()
        if self.sink is not None and entries:
            self.sink.log_generations(step, split, entries)

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()

    def __enter__(self) -> GenerationLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
