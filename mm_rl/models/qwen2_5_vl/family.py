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
    encoder_json,
    fixed_fields,
    fixed_keys,
    hf_config_for,
    model_dims,
    model_flags,
    need,
    text_decoder_json,
    vision_json,
    vl_json,
)

if TYPE_CHECKING:
    from mm_rl.config.schema import ModelConfig

# fmt: off
TENSORS: tuple[Entry, ...] = (
    PATCH_EMBED,
    Entry("vit_layer", V + "input_layernorm.weight", (VH + "norm1.weight",), (("vh",),)),
    *VIT_ATTENTION,
    Entry("vit_layer", V + "pre_mlp_layernorm.weight", (VH + "norm2.weight",), (("vh",),)),
    Entry("vit_layer", V + "mlp.linear_fc1.weight", (VH + "mlp.gate_proj.weight", VH + "mlp.up_proj.weight"),
          (("vffn", "vh"), ("vffn", "vh")), "glu", 0),
    Entry("vit_layer", V + "mlp.linear_fc1.bias", (VH + "mlp.gate_proj.bias", VH + "mlp.up_proj.bias"),
          (("vffn",), ("vffn",)), "glu", 0, when=VLIN),
    Entry("vit_layer", V + "mlp.linear_fc2.weight", (VH + "mlp.down_proj.weight",), (("vh", "vffn"),), split=1),
    Entry("vit_layer", V + "mlp.linear_fc2.bias", (VH + "mlp.down_proj.bias",), (("vh",),), when=VLIN),
    Entry("merger", P + "layernorm.weight", (PH + "ln_q.weight",), (("pin",),)),
    *MERGER_MLP,
    *TEXT,
)
# fmt: on


def model_json(config: Mapping[str, Any]) -> dict[str, Any]:
    """model.json content from a Qwen2.5-VL config.json (everything on one pipeline stage)."""
    vision = vision_json(config, LABEL)
    width, merge = need(vision, "hidden_size", LABEL), vision.get("spatial_merge_size", 2)
    decoder = text_decoder_json(config, LABEL)
    encoder = {
        **encoder_json(vision, width, need(vision, "intermediate_size", LABEL), LABEL),
        "window_size": vision.get("window_size", 112),
        "fullatt_block_indexes": list(vision.get("fullatt_block_indexes", [])),
    }
    projector = {
        "input_size": width,
        "hidden_size": vision.get("out_hidden_size", decoder["hidden_size"]),
        "ffn_hidden_size": width * merge**2,
    }
    return vl_json(MODEL_ID, config, encoder, projector, decoder)


_FIXED = fixed_keys({"swiglu": True, "normalization": "RMSNorm"}, {}, "RMSNorm")


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
    hf_config=hf_config_for,
    stage=qwen_vl.stage,
    decoder_layer=decoder_layer,
    tiny=tiny,
    rules=rules,
    hf_aliases=HF_ALIASES,
)
