"""Write a job as a commented yaml: every key with its help text, ``${...}`` links kept as written."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from mm_rl.config.schema import JobConfig, yaml_key


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, allow_unicode=True)
    return text.removesuffix("\n...\n").strip()


def _lines(node: DictConfig, cls: type, indent: int) -> list[str]:
    hints = typing.get_type_hints(cls)
    pad = "  " * indent
    out: list[str] = []
    for f in dataclasses.fields(cls):
        key = yaml_key(f)
        help_text = f.metadata.get("help", "")
        raw = node._get_node(key)
        if dataclasses.is_dataclass(hints[f.name]):
            if help_text:
                out.append(f"{pad}# {help_text}")
            out.append(f"{pad}{key}:")
            out += _lines(typing.cast(DictConfig, raw), hints[f.name], indent + 1)
            continue
        value = OmegaConf.to_container(raw, resolve=False) if isinstance(raw, ListConfig | DictConfig) else raw._value()
        comment = f"  # {help_text}" if help_text else ""
        out.append(f"{pad}{key}: {_flow(value)}{comment}")
    return out


def job_yaml(node: DictConfig, header: str = "") -> str:
    """The yaml text of a composed (unresolved) job."""
    lines = [f"# {line}" for line in header.splitlines()] + _lines(node, JobConfig, 0)
    return "\n".join(lines) + "\n"


def write_job_yaml(node: DictConfig, path: str | Path, header: str = "") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(job_yaml(node, header))
    tmp.replace(path)
    return path
