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
    LLM_HEADS,
    VIT_HEADS,
    VLIN,
    VQKV,
    P,
    V,
    fixed_fields,
    model_dims,
    need,
    pair,
    text_decoder_json,
    token_ids_json,
    vision_json,
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


TENSORS: tuple[Entry, ...] = (
    Entry(
        "patch_embed",
        "image_encoder.encoder.patch_embed.proj.weight",
        ("model.visual.patch_embed.proj.weight",),
        (("vh", "cin", "tps", "ps", "ps"),),
    ),
    Entry(
        "patch_embed",
        "image_encoder.encoder.patch_embed.proj.bias",
        ("model.visual.patch_embed.proj.bias",),
        (("vh",),),
    ),
    Entry(
        "patch_embed", "image_encoder.encoder.pos_embed.weight", ("model.visual.pos_embed.weight",), (("vpos", "vh"),)
    ),
    *pair("vit_layer", V + "input_layernorm", VH + "norm1", "vh"),
    Entry(
        "vit_layer",
        V + "self_attention.linear_qkv.weight",
        (VH + "attn.qkv.weight",),
        (("vqkv", "vh"),),
        "fused_qkv",
        0,
        VIT_HEADS,
    ),
    Entry(
        "vit_layer",
        V + "self_attention.linear_qkv.bias",
        (VH + "attn.qkv.bias",),
        (("vqkv",),),
        "fused_qkv",
        0,
        VIT_HEADS,
        when=VQKV,
    ),
    Entry(
        "vit_layer", V + "self_attention.linear_proj.weight", (VH + "attn.proj.weight",), (("vh", "vattn"),), split=1
    ),
    Entry("vit_layer", V + "self_attention.linear_proj.bias", (VH + "attn.proj.bias",), (("vh",),), when=VLIN),
    *pair("vit_layer", V + "pre_mlp_layernorm", VH + "norm2", "vh"),
    Entry("vit_layer", V + "mlp.linear_fc1.weight", (VH + "mlp.linear_fc1.weight",), (("vffn", "vh"),), split=0),
    Entry("vit_layer", V + "mlp.linear_fc1.bias", (VH + "mlp.linear_fc1.bias",), (("vffn",),), split=0, when=VLIN),
    Entry("vit_layer", V + "mlp.linear_fc2.weight", (VH + "mlp.linear_fc2.weight",), (("vh", "vffn"),), split=1),
    Entry("vit_layer", V + "mlp.linear_fc2.bias", (VH + "mlp.linear_fc2.bias",), (("vh",),), when=VLIN),
    *_merger("merger", P, PH, "pin"),
    *_merger("deepstack", D, DH, "pcat"),
    Entry(
        "embedding",
        "text_decoder.embedding.word_embeddings.weight",
        ("model.language_model.embed_tokens.weight",),
        (("vocab", "h"),),
        split=0,
    ),
    Entry("llm_layer", L + "input_layernorm.weight", (LH + "input_layernorm.weight",), (("h",),)),
    Entry(
        "llm_layer",
        L + "self_attention.linear_qkv.weight",
        (LH + "self_attn.q_proj.weight", LH + "self_attn.k_proj.weight", LH + "self_attn.v_proj.weight"),
        (("q", "h"), ("kv", "h"), ("kv", "h")),
        "qkv",
        0,
        LLM_HEADS,
    ),
    Entry("llm_layer", L + "self_attention.q_layernorm.weight", (LH + "self_attn.q_norm.weight",), (("hd",),)),
    Entry("llm_layer", L + "self_attention.k_layernorm.weight", (LH + "self_attn.k_norm.weight",), (("hd",),)),
    Entry(
        "llm_layer", L + "self_attention.linear_proj.weight", (LH + "self_attn.o_proj.weight",), (("h", "q"),), split=1
    ),
    Entry("llm_layer", L + "pre_mlp_layernorm.weight", (LH + "post_attention_layernorm.weight",), (("h",),)),
    Entry(
        "llm_layer",
        L + "mlp.linear_fc1.weight",
        (LH + "mlp.gate_proj.weight", LH + "mlp.up_proj.weight"),
        (("ffn", "h"), ("ffn", "h")),
        "glu",
        0,
        when="dense",
    ),
    Entry(
        "llm_layer", L + "mlp.linear_fc2.weight", (LH + "mlp.down_proj.weight",), (("h", "ffn"),), split=1, when="dense"
    ),
    Entry("llm_layer", L + "mlp.router.weight", (LH + "mlp.gate.weight",), (("experts", "h"),), when="moe"),
    Entry(
        "llm_layer",
        L + "mlp.experts.local_experts.{e}.linear_fc1.weight",
        (EH + "gate_proj.weight", EH + "up_proj.weight"),
        (("eff", "h"), ("eff", "h")),
        "glu",
        0,
        when="moe",
        expert=True,
    ),
    Entry(
        "llm_layer",
        L + "mlp.experts.local_experts.{e}.linear_fc2.weight",
        (EH + "down_proj.weight",),
        (("h", "eff"),),
        split=1,
        when="moe",
        expert=True,
    ),
    Entry(
        "final_norm", "text_decoder.decoder.final_layernorm.weight", ("model.language_model.norm.weight",), (("h",),)
    ),
    Entry(
        "output_layer",
        "text_decoder.output_layer.weight",
        ("lm_head.weight",),
        (("vocab", "h"),),
        split=0,
        when="untied",
    ),
    Entry(
        "output_layer",
        "text_decoder.output_layer.weight",
        ("model.language_model.embed_tokens.weight",),
        (("vocab", "h"),),
        split=0,
        when="tied",
        duplicate=True,
    ),
)


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
    depth, width = need(vision, "depth", LABEL), need(vision, "hidden_size", LABEL)
    heads, merge = need(vision, "num_heads", LABEL), vision.get("spatial_merge_size", 2)
    text = config.get("text_config") or config
    decoder = {**text_decoder_json(config, LABEL), **_TEXT_FIXED, "model_id": "qwen3_lm", **moe_json(text)}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    decoder["mrope_section"] = list(rope.get("mrope_section", [24, 20, 20]))
    decoder["mrope_interleaved"] = bool(rope.get("mrope_interleaved", True))
    encoder = {
        "model_id": "qwen3vit",
        "num_layers": depth,
        "pipeline_num_layers": [depth],
        "hidden_size": width,
        "ffn_hidden_size": need(vision, "intermediate_size", LABEL),
        "num_attention_heads": heads,
        "num_query_groups": heads,
        "in_channels": vision.get("in_channels", 3),
        "patch_size": vision.get("patch_size", 16),
        "temporal_patch_size": vision.get("temporal_patch_size", 2),
        "spatial_merge_size": merge,
        "num_position_embeddings": vision.get("num_position_embeddings", 2304),
        "deepstack_visual_indexes": list(vision.get("deepstack_visual_indexes", [8, 16, 24])),
        "activation_func": vision.get("hidden_act", "gelu_pytorch_tanh"),
        **_VISION_FIXED,
    }
    projector = {
        "model_id": "lnmlp",
        "input_size": width,
        "hidden_size": vision.get("out_hidden_size", decoder["hidden_size"]),
        "ffn_hidden_size": width * merge**2,
        "normalization": "LayerNorm",
    }
    return {
        "model_id": MODEL_ID,
        **token_ids_json(config),
        "image_encoder": {"vision_encoder": encoder, "vision_projector": projector},
        "text_decoder": decoder,
    }


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
_FIXED = {
    **{
        f"image_encoder.vision_encoder.{key}": value
        for key, value in _VISION_FIXED.items()
        if key != "fullatt_block_indexes"
    },
    **{f"text_decoder.{key}": value for key, value in _TEXT_FIXED.items()},
    "image_encoder.vision_projector.normalization": "LayerNorm",
    "text_decoder.swiglu": True,
}


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
    stage=qwen_vl.stage,
    decoder_layer=decoder_layer,
    tiny=tiny,
    rules=rules,
    hf_fused=FUSED,
)
