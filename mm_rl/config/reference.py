"""The job-yaml reference (``docs/reference.md``), generated from the schema: every key path with its type (the
values it takes), its default and what it means, section by section. ``python -m mm_rl.config.reference`` prints it;
a test fails when the committed page differs, so it cannot go stale.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Iterator
from typing import Any

from mm_rl.config.schema import JobConfig, yaml_key

HEADER = """# The job yaml, key by key

Generated from the schema (`mm_rl/config/schema.py`) by `python -m mm_rl.config.reference`; do not edit by hand.
Every key a job yaml may hold, with the values it takes, its default and what it means. A default written
`${key}` follows that key (set the key it names, not this one). What `check` verifies beyond the types (sizes that
divide, paths that exist, the checkpoint's shapes) is in [job-yaml.md](job-yaml.md) and
[troubleshooting.md](troubleshooting.md). Back to the [README](../README.md).
"""


def _type_text(hint: Any) -> str:
    """The values a key takes, as a reader writes them in yaml."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        parts = [_type_text(a) for a in args if a is not type(None)]
        return " \\| ".join(parts) + (" \\| `null`" if type(None) in args else "")
    if origin in (list, tuple):
        return f"list of {_type_text(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    return getattr(hint, "__name__", str(hint))


def _default_text(field: dataclasses.Field[Any], value: Any) -> str:
    if "ref" in field.metadata:
        return f"`{field.metadata['ref']}`"
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def sections(cls: type = JobConfig, prefix: str = "", title: str = "top level") -> Iterator[tuple[str, str, list[str]]]:
    """(section path, section help, table rows) for ``cls`` and each of its sub-sections, depth first."""
    hints, instance = typing.get_type_hints(cls), cls()
    rows, nested = [], []
    for field in dataclasses.fields(cls):
        path, hint = f"{prefix}{yaml_key(field)}", hints[field.name]
        if dataclasses.is_dataclass(hint):
            nested.append((hint, path, field.metadata.get("help", "")))
            continue
        value = getattr(instance, field.name)
        rows.append(f"| `{path}` | {_type_text(hint)} | {_default_text(field, value)} | "
                    f"{_cell(field.metadata.get('help', ''))} |")  # fmt: skip
    if rows:
        yield prefix.rstrip(".") or title, "", rows
    for hint, path, help_text in nested:
        for name, text, sub_rows in sections(hint, path + ".", title):
            yield name, (help_text if name == path else text), sub_rows


def reference() -> str:
    """The whole page."""
    parts = [HEADER]
    for name, help_text, rows in sections():
        parts.append(f"\n## `{name}`\n" + (f"\n{help_text[0].upper()}{help_text[1:]}.\n" if help_text else ""))
        parts.append("\n| key | values | default | meaning |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    return "".join(parts)


if __name__ == "__main__":
    print(reference(), end="")
