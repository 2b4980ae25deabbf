"""Qwen2.5-VL as a model family: its tensor mapping (MindSpeed-MM's megatron layout), model.json from an HF
config.json, and the structural fields its checkpoints fix. It runs as the shared Qwen-VL stage
(``mm_rl.models.qwen_vl``) with every LLM layer the same."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from mm_rl.models import qwen_vl
from mm_rl.models.family import Entry, ModelFamily, ModelFinding
from mm_rl.models.qwen2_5_vl import tiny
from mm_rl.models.qwen_vl.layers import decoder_layer
from mm_rl.models.qwen_vl.tensors import (
    HF_ALIASES,
    MERGER_MLP,
    PATCH_EMBED,
    PH,
    TEXT,
    VH,
    VIT_ATTENTION,
    VLIN,
    P,
    V,
    fixed_fields,
    model_dims,
    model_flags,
    need,
    text_decoder_json,
    token_ids_json,
    vision_json,
)

if TYPE_CHECKING:
    from mm_rl.config.schema import ModelConfig

TENSORS: tuple[Entry, ...] = (
    PATCH_EMBED,
    Entry("vit_layer", V + "input_layernorm.weight", (VH + "norm1.weight",), (("vh",),)),
    *VIT_ATTENTION,
    Entry("vit_layer", V + "pre_mlp_layernorm.weight", (VH + "norm2.weight",), (("vh",),)),
    Entry(
        "vit_layer",
        V + "mlp.linear_fc1.weight",
        (VH + "mlp.gate_proj.weight", VH + "mlp.up_proj.weight"),
        (("vffn", "vh"), ("vffn", "vh")),
        "glu",
        0,
    ),
    Entry(
        "vit_layer",
        V + "mlp.linear_fc1.bias",
        (VH + "mlp.gate_proj.bias", VH + "mlp.up_proj.bias"),
        (("vffn",), ("vffn",)),
        "glu",
        0,
        when=VLIN,
    ),
    Entry("vit_layer", V + "mlp.linear_fc2.weight", (VH + "mlp.down_proj.weight",), (("vh", "vffn"),), split=1),
    Entry("vit_layer", V + "mlp.linear_fc2.bias", (VH + "mlp.down_proj.bias",), (("vh",),), when=VLIN),
    Entry("merger", P + "layernorm.weight", (PH + "ln_q.weight",), (("pin",),)),
    *MERGER_MLP,
    *TEXT,
)


def model_json(config: Mapping[str, Any]) -> dict[str, Any]:
    """model.json content from a Qwen2.5-VL config.json (everything on one pipeline stage)."""
    vision = vision_json(config, LABEL)
    depth, vit_hidden = need(vision, "depth", LABEL), need(vision, "hidden_size", LABEL)
    merge = vision.get("spatial_merge_size", 2)
    decoder = text_decoder_json(config, LABEL)
    encoder = {
        "num_layers": depth,
        "pipeline_num_layers": [depth],
        "hidden_size": vit_hidden,
        "ffn_hidden_size": need(vision, "intermediate_size", LABEL),
        "num_attention_heads": need(vision, "num_heads", LABEL),
        "num_query_groups": need(vision, "num_heads", LABEL),
        "in_channels": vision.get("in_channels", vision.get("in_chans", 3)),
        "patch_size": vision.get("patch_size", 14),
        "temporal_patch_size": vision.get("temporal_patch_size", 2),
        "spatial_merge_size": merge,
        "window_size": vision.get("window_size", 112),
        "fullatt_block_indexes": list(vision.get("fullatt_block_indexes", [])),
    }
    projector = {
        "input_size": vit_hidden,
        "hidden_size": vision.get("out_hidden_size", decoder["hidden_size"]),
        "ffn_hidden_size": vit_hidden * merge**2,
    }
    return {
        "model_id": MODEL_ID,
        **token_ids_json(config),
        "image_encoder": {"vision_encoder": encoder, "vision_projector": projector},
        "text_decoder": decoder,
    }


_FIXED = {
    "image_encoder.vision_encoder.swiglu": True,
    "image_encoder.vision_encoder.normalization": "RMSNorm",
    "image_encoder.vision_projector.normalization": "RMSNorm",
    "text_decoder.swiglu": True,
}


def rules(model: ModelConfig) -> Iterator[ModelFinding]:
    yield from fixed_fields(model, _FIXED, LABEL)


LABEL, MODEL_ID = "Qwen2.5-VL", "qwen2_5vl"

FAMILY = ModelFamily(
    name="qwen2_5_vl",
    label=LABEL,
    model_id=MODEL_ID,
    hf_model_types=("qwen2_5_vl",),
    hf_architecture="Qwen2_5_VLForConditionalGeneration",
    tensors=TENSORS,
    model_dims=model_dims,
    model_flags=model_flags,
    model_json=model_json,
    stage=qwen_vl.stage,
    decoder_layer=decoder_layer,
    tiny=tiny,
    rules=rules,
    hf_aliases=HF_ALIASES,
)
