"""Qwen2-VL as a model family, run as the shared Qwen-VL stage (``mm_rl.models.qwen_vl``) with the older ViT
(MindSpeed-MM's ``qwen2vl`` layout: ``fc1`` / ``fc2`` become ``linear_fc1`` /
``linear_fc2`` split by rows / columns, the norms keep their biases)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from mm_rl.models import qwen_vl
from mm_rl.models.family import Entry, ModelFamily, ModelFinding
from mm_rl.models.qwen2_vl import tiny
from mm_rl.models.qwen_vl.layers import decoder_layer
from mm_rl.models.qwen_vl.tensors import (
    HF_ALIASES,
    MERGER_MLP,
    PATCH_EMBED,
    PH,
    TEXT,
    VH,
    VIT_ATTENTION,
    P,
    V,
    encoder_json,
    fixed_fields,
    fixed_keys,
    hf_config_for,
    layernorm_projector,
    model_dims,
    model_flags,
    need,
    pair,
    text_decoder_json,
    vision_json,
    vit_plain_mlp,
    vl_json,
)

if TYPE_CHECKING:
    from mm_rl.config.schema import ModelConfig

LABEL, MODEL_ID = "Qwen2-VL", "qwen2vl"


TENSORS: tuple[Entry, ...] = (
    PATCH_EMBED,
    *pair("vit_layer", V + "input_layernorm", VH + "norm1", "vh"),
    *VIT_ATTENTION,
    *pair("vit_layer", V + "pre_mlp_layernorm", VH + "norm2", "vh"),
    *vit_plain_mlp(VH, "fc1", "fc2"),
    *pair("merger", P + "layernorm", PH + "ln_q", "pin"),
    *MERGER_MLP,
    *TEXT,
)


def model_json(config: Mapping[str, Any]) -> dict[str, Any]:
    """model.json content from a Qwen2-VL config.json (``embed_dim`` is the ViT width, ``hidden_size`` the
    merger's output)."""
    vision = vision_json(config, LABEL)
    width, merge = need(vision, "embed_dim", LABEL), vision.get("spatial_merge_size", 2)
    decoder = text_decoder_json(config, LABEL)
    encoder = {**encoder_json(vision, width, int(width * vision.get("mlp_ratio", 4)), LABEL), **_VISION_FIXED}
    projector = layernorm_projector(width, vision.get("hidden_size", decoder["hidden_size"]), merge)
    return vl_json(MODEL_ID, config, encoder, projector, decoder)


# The ViT's structure: no windows, LayerNorm, plain quick-GELU MLP, biases everywhere.
_VISION_FIXED: dict[str, Any] = {
    "window_size": 0,
    "fullatt_block_indexes": [],
    "normalization": "LayerNorm",
    "activation_func": "quick_gelu",
    "swiglu": False,
    "add_qkv_bias": True,
    "add_bias_linear": True,
}
_FIXED = fixed_keys(_VISION_FIXED, {}, "LayerNorm")


def rules(model: ModelConfig) -> Iterator[ModelFinding]:
    yield from fixed_fields(model, _FIXED, LABEL)


FAMILY = ModelFamily(
    name="qwen2_vl",
    label=LABEL,
    model_id=MODEL_ID,
    hf_model_types=("qwen2_vl",),
    hf_architecture="Qwen2VLForConditionalGeneration",
    tensors=TENSORS,
    model_dims=model_dims,
    model_flags=model_flags,
    model_json=model_json,
    hf_config=partial(hf_config_for, projector_out="hidden_size"),  # Qwen2-VL's merger output is hidden_size
    stage=qwen_vl.stage,
    decoder_layer=decoder_layer,
    tiny=tiny,
    rules=rules,
    hf_aliases=HF_ALIASES,
)
