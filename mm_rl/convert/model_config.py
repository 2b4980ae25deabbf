"""model.json (``ModelConfig``) from a HuggingFace config.json, for conversions run without a job.

The checkpoint's model family (its ``model_type``) reads it; each reads both spellings of config.json: the
published one (text fields at the top level, ``rope_scaling``) and newer transformers' (``text_config``,
``rope_parameters``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mm_rl.config.loader import load_section
from mm_rl.config.schema import ModelConfig
from mm_rl.convert.errors import ConversionError
from mm_rl.models.family import HfConfigError, UnknownFamily
from mm_rl.models.registry import family_for_hf


def model_config_from_hf(
    config_json: str | Path | Mapping[str, Any], overrides: Mapping[str, Any] | None = None
) -> ModelConfig:
    """The model.json of the checkpoint whose config.json is ``config_json`` (a path or its parsed content).

    ``overrides`` is a nested dict merged over the result before it is type-checked (e.g. fewer layers)."""
    config = _read(config_json)
    data = model_dict(config)
    for key, value in (overrides or {}).items():
        _merge(data, key, value)
    return load_section(ModelConfig, data)


def model_dict(config: Mapping[str, Any]) -> dict[str, Any]:
    """The model.json content as a plain dict (pipeline split: everything on one stage), by the checkpoint's
    model family."""
    try:
        return family_for_hf(config).model_json(config)
    except (UnknownFamily, HfConfigError) as err:
        raise ConversionError(str(err)) from None


def _read(config_json: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(config_json, Mapping):
        return config_json
    path = Path(config_json)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path} does not exist: pass the HuggingFace checkpoint directory or its config.json")
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise ConversionError(f"{path} is not valid JSON ({err})") from None


def _merge(data: dict[str, Any], key: str, value: Any) -> None:
    if isinstance(value, Mapping) and isinstance(data.get(key), dict):
        for sub_key, sub_value in value.items():
            _merge(data[key], sub_key, sub_value)
    else:
        data[key] = value
