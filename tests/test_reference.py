"""The job-yaml reference page (docs/reference.md) is generated from the schema and committed: it must be what the
generator writes today, and name every key of the schema."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from mm_rl.config.loader import all_key_paths
from mm_rl.config.reference import reference
from mm_rl.config.schema import JobConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"


def test_the_committed_reference_is_the_generated_one():
    assert PAGE.read_text() == reference(), "stale: run `python -m mm_rl.config.reference > docs/reference.md`"


def _sections(cls: type = JobConfig, prefix: str = "") -> set[str]:
    hints, out = typing.get_type_hints(cls), set()
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            name = f"{prefix}{f.metadata.get('key', f.name)}"
            out |= {name} | _sections(hints[f.name], name + ".")
    return out


def test_every_key_has_a_row():
    rows = {line.split("`")[1] for line in reference().splitlines() if line.startswith("| `")}
    assert rows == set(all_key_paths()) - _sections()
