"""model.json (``ModelConfig``) from a HuggingFace Qwen2.5-VL config.json, for conversions run without a job.

Reads both spellings of config.json: the published one (text fields at the top level, ``rope_scaling``,
``in_chans``) and newer transformers' (``text_config``, ``rope_parameters``, ``in_channels``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mm_rl.config.loader import load_section
from mm_rl.config.schema import ModelConfig
from mm_rl.convert.errors import ConversionError


def model_config_from_hf(config_json: str | Path | Mapping[str, Any],
                         overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    """The model.json of the checkpoint whose config.json is ``config_json`` (a path or its parsed content).

    ``overrides`` is a nested dict merged over the result before it is type-checked (e.g. fewer layers)."""
    config = _read(config_json)
    data = model_dict(config)
    for key, value in (overrides or {}).items():
        _merge(data, key, value)
    return load_section(ModelConfig, data)


def model_dict(config: Mapping[str, Any]) -> dict[str, Any]:
    """The model.json content as a plain dict (pipeline split: everything on one stage)."""
    text = config.get("text_config") or config
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        raise ConversionError("config.json has no vision_config: not a Qwen2.5-VL checkpoint")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or config.get("rope_scaling") or {}
    heads = _need(text, "num_attention_heads")
    hidden = _need(text, "hidden_size")
    layers, depth = _need(text, "num_hidden_layers"), _need(vision, "depth")
    vit_hidden, merge = _need(vision, "hidden_size"), vision.get("spatial_merge_size", 2)
    decoder = {
        "num_layers": layers, "pipeline_num_layers": [layers], "hidden_size": hidden,
        "ffn_hidden_size": _need(text, "intermediate_size"), "num_attention_heads": heads,
        "num_query_groups": text.get("num_key_value_heads", heads),
        "kv_channels": text.get("head_dim") or hidden // heads,
        "vocab_size": _need(text, "vocab_size"),
        "rope_theta": float(rope.get("rope_theta", text.get("rope_theta", 1000000.0))),
        "untie_embeddings_and_output_weights": not text.get("tie_word_embeddings",
                                                            config.get("tie_word_embeddings", False)),
        "layernorm_epsilon": float(text.get("rms_norm_eps", 1e-6)),
    }
    for key, source in (("max_position_embeddings", text), ("mrope_section", rope)):
        if key in source:
            decoder[key] = list(source[key]) if key == "mrope_section" else source[key]
    encoder = {
        "num_layers": depth, "pipeline_num_layers": [depth], "hidden_size": vit_hidden,
        "ffn_hidden_size": _need(vision, "intermediate_size"), "num_attention_heads": _need(vision, "num_heads"),
        "num_query_groups": _need(vision, "num_heads"),
        "in_channels": vision.get("in_channels", vision.get("in_chans", 3)),
        "patch_size": vision.get("patch_size", 14), "temporal_patch_size": vision.get("temporal_patch_size", 2),
        "spatial_merge_size": merge, "window_size": vision.get("window_size", 112),
        "fullatt_block_indexes": list(vision.get("fullatt_block_indexes", [])),
    }
    projector = {"input_size": vit_hidden, "hidden_size": vision.get("out_hidden_size", hidden),
                 "ffn_hidden_size": vit_hidden * merge ** 2}
    ids = {key: config[hf_key] for key, hf_key in (("img_context_token_id", "image_token_id"),
                                                   ("vision_start_token_id", "vision_start_token_id"))
           if hf_key in config}
    return {**ids, "image_encoder": {"vision_encoder": encoder, "vision_projector": projector},
            "text_decoder": decoder}


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


def _need(section: Mapping[str, Any], key: str) -> Any:
    if key not in section:
        raise ConversionError(f"config.json lacks {key}: not a Qwen2.5-VL config")
    return section[key]


def _merge(data: dict[str, Any], key: str, value: Any) -> None:
    if isinstance(value, Mapping) and isinstance(data.get(key), dict):
        for sub_key, sub_value in value.items():
            _merge(data[key], sub_key, sub_value)
    else:
        data[key] = value
