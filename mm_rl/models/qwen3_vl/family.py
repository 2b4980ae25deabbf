"""Qwen3-VL (dense and MoE) as a model family: MindSpeed-MM's megatron layout (``checkpoint/vlm_model/converters/
qwen3vl_megatron.py``: ``image_encoder.encoder.pos_embed``, the DeepStack mergers under their ViT blocks as
``...blocks.layers.N.deepstack_layer.*``, ``q_layernorm`` / ``k_layernorm``; MoE: ``mlp.router.weight`` and
``mlp.experts.local_experts.E.linear_fc1 / linear_fc2``, E local to the EP rank). Published Qwen3-VL checkpoints
name their tensors ``model.visual.*`` / ``model.language_model.*``, which the table uses as they are; the MoE
checkpoints store each layer's experts fused (``experts.gate_up_proj`` [E, H, 2F], ``experts.down_proj``
[E, F, H]), which the table names per expert (:class:`~mm_rl.models.family.Fused`). MindSpeed-MM uses
``model_id`` qwen3_vl for both; ``text_decoder.num_moe_experts`` tells them apart."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from mm_rl.models import qwen_vl
from mm_rl.models.family import Entry, Fused, HfConfigError, ModelFamily, ModelFinding, Scope
from mm_rl.models.qwen3_vl import tiny
from mm_rl.models.qwen_vl.layers import decoder_layer
from mm_rl.models.qwen_vl.tensors import (
    VLIN,
    VQKV,
    P,
    V,
    dense_mlp,
    encoder_json,
    fixed_fields,
    fixed_keys,
    hf_config_for,
    layernorm_projector,
    model_dims,
    need,
    pair,
    text_decoder_json,
    text_table,
    vision_json,
    vit_attention,
    vit_plain_mlp,
    vl_json,
)

if TYPE_CHECKING:
    from mm_rl.config.schema import ModelConfig

LABEL, MODEL_ID = "Qwen3-VL", "qwen3_vl"
VH, PH, DH = "model.visual.blocks.{i}.", "model.visual.merger.", "model.visual.deepstack_merger_list.{i}."
L, LH = "text_decoder.decoder.layers.{i}.", "model.language_model.layers.{i}."
D = V + "deepstack_layer."
EH = LH + "mlp.experts.{e}."  # one expert's tensors (stored fused, see FUSED)
FUSED = (
    Fused(LH + "mlp.experts.gate_up_proj", (EH + "gate_proj.weight", EH + "up_proj.weight")),
    Fused(LH + "mlp.experts.down_proj", (EH + "down_proj.weight",)),
)


def _merger(scope: Scope, mg: str, hf: str, norm: str) -> tuple[Entry, ...]:
    return (
        *pair(scope, mg + "layernorm", hf + "norm", norm),
        Entry(scope, mg + "encoder.linear_fc1.weight", (hf + "linear_fc1.weight",), (("pffn", "pcat"),), split=0),
        Entry(scope, mg + "encoder.linear_fc1.bias", (hf + "linear_fc1.bias",), (("pffn",),), split=0),
        Entry(scope, mg + "encoder.linear_fc2.weight", (hf + "linear_fc2.weight",), (("ph", "pffn"),), split=1),
        Entry(scope, mg + "encoder.linear_fc2.bias", (hf + "linear_fc2.bias",), (("ph",),)),
    )


# fmt: off
TENSORS: tuple[Entry, ...] = (
    Entry("patch_embed", "image_encoder.encoder.patch_embed.proj.weight", ("model.visual.patch_embed.proj.weight",),
          (("vh", "cin", "tps", "ps", "ps"),)),
    Entry("patch_embed", "image_encoder.encoder.patch_embed.proj.bias", ("model.visual.patch_embed.proj.bias",),
          (("vh",),)),
    Entry("patch_embed", "image_encoder.encoder.pos_embed.weight", ("model.visual.pos_embed.weight",),
          (("vpos", "vh"),)),
    *pair("vit_layer", V + "input_layernorm", VH + "norm1", "vh"),
    *vit_attention(VH),
    *pair("vit_layer", V + "pre_mlp_layernorm", VH + "norm2", "vh"),
    *vit_plain_mlp(VH, "linear_fc1", "linear_fc2"),
    *_merger("merger", P, PH, "pin"),
    *_merger("deepstack", D, DH, "pcat"),
    *text_table("model.language_model.", qkv_bias=False, qk_norm=True, mlp=(
        *dense_mlp(LH, when="dense"),
        Entry("llm_layer", L + "mlp.router.weight", (LH + "mlp.gate.weight",), (("experts", "h"),), when="moe"),
        Entry("llm_layer", L + "mlp.experts.local_experts.{e}.linear_fc1.weight", (EH + "gate_proj.weight",
              EH + "up_proj.weight"), (("eff", "h"), ("eff", "h")), "glu", 0, when="moe", expert=True),
        Entry("llm_layer", L + "mlp.experts.local_experts.{e}.linear_fc2.weight", (EH + "down_proj.weight",),
              (("h", "eff"),), split=1, when="moe", expert=True),
    )),
)
# fmt: on


def qwen3_dims(model: ModelConfig) -> dict[str, int]:
    text = model.text_decoder
    return {
        **model_dims(model),
        "vpos": model.image_encoder.vision_encoder.num_position_embeddings,
        "experts": text.num_moe_experts or 0,
        "eff": text.moe_intermediate_size or 0,
    }


def qwen3_flags(model: ModelConfig) -> dict[str, bool]:
    text, vit = model.text_decoder, model.image_encoder.vision_encoder
    moe = bool(text.num_moe_experts)
    return {
        VQKV: vit.add_qkv_bias,
        VLIN: vit.add_bias_linear,
        "untied": text.untie_embeddings_and_output_weights,
        "tied": not text.untie_embeddings_and_output_weights,
        "moe": moe,
        "dense": not moe,
    }


def moe_json(text: Mapping[str, Any]) -> dict[str, Any]:
    """model.json's MoE fields from a Qwen3-VL-MoE ``text_config`` (empty for a dense one). Every layer must be
    sparse: transformers' ``mlp_only_layers`` / ``decoder_sparse_step`` would mix in dense layers, which no
    published Qwen3-VL-MoE has and mm_rl does not build."""
    experts = text.get("num_experts") or text.get("num_local_experts")  # transformers 5 saves the latter
    if not experts:
        return {}
    if text.get("mlp_only_layers") or text.get("decoder_sparse_step", 1) != 1:
        raise HfConfigError(
            f"config.json mixes dense and MoE layers (mlp_only_layers {text.get('mlp_only_layers')}, "
            f"decoder_sparse_step {text.get('decoder_sparse_step')}): mm_rl builds every layer "
            "as MoE, as the published Qwen3-VL-MoE checkpoints have"
        )
    return {
        "num_moe_experts": experts,
        "moe_router_topk": need(text, "num_experts_per_tok", LABEL),
        "moe_intermediate_size": need(text, "moe_intermediate_size", LABEL),
        "norm_topk_prob": True,
    }  # transformers' Qwen3-VL-MoE router always renormalises the top k


def model_json(config: Mapping[str, Any]) -> dict[str, Any]:
    """model.json content from a Qwen3-VL config.json (transformers' spelling: ``text_config`` with
    ``rope_parameters``; ``tie_word_embeddings`` at the top level or in ``text_config``)."""
    vision = vision_json(config, LABEL)
    width, merge = need(vision, "hidden_size", LABEL), vision.get("spatial_merge_size", 2)
    text = config.get("text_config") or config
    decoder = {**text_decoder_json(config, LABEL), **_TEXT_FIXED, "model_id": "qwen3_lm", **moe_json(text)}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    decoder["mrope_section"] = list(rope.get("mrope_section", [24, 20, 20]))
    decoder["mrope_interleaved"] = bool(rope.get("mrope_interleaved", True))
    encoder = {
        "model_id": "qwen3vit",
        **encoder_json(vision, width, need(vision, "intermediate_size", LABEL), LABEL, patch_size=16),
        "num_position_embeddings": vision.get("num_position_embeddings", 2304),
        "deepstack_visual_indexes": list(vision.get("deepstack_visual_indexes", [8, 16, 24])),
        "activation_func": vision.get("hidden_act", "gelu_pytorch_tanh"),
        **_VISION_FIXED,
    }
    projector = layernorm_projector(width, vision.get("out_hidden_size", decoder["hidden_size"]), merge)
    return vl_json(MODEL_ID, config, encoder, projector, decoder)


_VISION_FIXED: dict[str, Any] = {
    "window_size": 0,
    "fullatt_block_indexes": [],
    "normalization": "LayerNorm",
    "swiglu": False,
    "add_qkv_bias": True,
    "add_bias_linear": True,
    "patch_embed_bias": True,
}
_TEXT_FIXED: dict[str, Any] = {"qk_layernorm": True, "add_qkv_bias": False}
_FIXED = fixed_keys(_VISION_FIXED, _TEXT_FIXED, "LayerNorm")


def moe_rules(text: Any) -> Iterator[ModelFinding]:
    if not text.num_moe_experts:
        return
    if not text.moe_intermediate_size:
        yield (
            "text_decoder.moe_intermediate_size",
            text.moe_intermediate_size,
            "an MoE model needs the experts' width",
            "set it from config.json's moe_intermediate_size",
        )
    if not 1 <= text.moe_router_topk <= text.num_moe_experts:
        yield (
            "text_decoder.moe_router_topk",
            text.moe_router_topk,
            f"must lie in [1, num_moe_experts = {text.num_moe_experts}]",
            "set it from config.json's num_experts_per_tok",
        )


def rules(model: ModelConfig) -> Iterator[ModelFinding]:
    yield from fixed_fields(model, _FIXED, LABEL)
    vit, text = model.image_encoder.vision_encoder, model.text_decoder
    yield from moe_rules(text)
    deepstack = vit.deepstack_visual_indexes
    key = "image_encoder.vision_encoder.deepstack_visual_indexes"
    if any(not 0 <= i < vit.num_layers for i in deepstack):
        yield key, deepstack, f"indexes must lie in [0, num_layers = {vit.num_layers})", "drop the ones past the end"
    if len(deepstack) > text.num_layers:
        yield (
            key,
            deepstack,
            f"each feeds one of the first LLM layers; there are {text.num_layers}",
            f"keep at most {text.num_layers}",
        )
    if deepstack and len([n for n in vit.pipeline_num_layers if n]) > 1:
        yield (
            "image_encoder.vision_encoder.pipeline_num_layers",
            vit.pipeline_num_layers,
            "DeepStack needs the whole ViT on one pipeline stage",
            f"put all {vit.num_layers} blocks on one stage",
        )
    first_llm = next((n for n in text.pipeline_num_layers if n), 0)
    if len(text.pipeline_num_layers) > 1 and first_llm < len(deepstack):
        yield (
            "text_decoder.pipeline_num_layers",
            text.pipeline_num_layers,
            f"the first {len(deepstack)} LLM layers take DeepStack features: they must be on the first LLM stage",
            f"give the first LLM stage at least {len(deepstack)} layers",
        )


FAMILY = ModelFamily(
    name="qwen3_vl",
    label=LABEL,
    model_id=MODEL_ID,
    hf_model_types=("qwen3_vl", "qwen3_vl_moe"),
    hf_architecture="Qwen3VLForConditionalGeneration",
    tensors=TENSORS,
    model_dims=qwen3_dims,
    model_flags=qwen3_flags,
    model_json=model_json,
    hf_config=hf_config_for,
    stage=qwen_vl.stage,
    decoder_layer=decoder_layer,
    tiny=tiny,
    rules=rules,
    hf_fused=FUSED,
)
