"""Qwen3.5 (dense and MoE) as a model family: a hybrid LLM (``layer_types``: Gated DeltaNet linear attention, and every
fourth layer gated full attention) behind Qwen3-VL's ViT without DeepStack.

The layers' tensors in MindSpeed-MM's megatron layout for Qwen3.5 (its bridge, ``bridge/models/qwen_vl/
qwen3_5_bridge.py`` with ``bridge/models/conversion/param_mapping.py``): a linear-attention layer's
``self_attention.in_proj`` holds, per TP rank, [q_r, k_r, v_r, z_r, b_r, a_r] cut from the checkpoint's
``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, its ``conv1d`` [q_r, k_r, v_r]; ``A_log`` and
``dt_bias`` split by value head; ``out_norm`` (the gated RMSNorm, weight as stored) replicated; a full-attention
layer's ``linear_qkv`` is megatron's gated layout [q heads of group g, their gates, k_g, v_g] from the checkpoint's
``q_proj`` (query and gate interleaved per head), ``k_proj``, ``v_proj``. Every other norm is zero-centred
(y = norm(x) (1 + w)) in both, copied as stored. The module tree keeps mm_rl's ``text_decoder.`` / ``image_encoder.``
prefixes, as for the other families (MindSpeed-MM's bridge names them ``language_model.`` / ``vision_model.``).

Multi-token-prediction tensors (``mtp.*``) are not part of the RL model: MindSpeed-MM's megatron path does not build
them either; hf2mg leaves them out and mg2hf writes the trained model without them (transformers and vLLM load a
Qwen3.5 checkpoint without MTP; vLLM's speculative decoding then needs the base checkpoint's)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from mm_rl.models import qwen_vl
from mm_rl.models.family import Entry, HfConfigError, ModelFamily, ModelFinding
from mm_rl.models.qwen3_5 import tiny
from mm_rl.models.qwen3_vl import family as qwen3_vl
from mm_rl.models.qwen_vl.tensors import (
    LLM_HEADS,
    dense_mlp,
    fixed_fields,
    fixed_keys,
    hf_config_for,
    need,
    text_table,
    vision_json,
)

if TYPE_CHECKING:
    from mm_rl.config.schema import ModelConfig, TextDecoderConfig

LABEL, MODEL_ID = "Qwen3.5", "qwen3_5"
L, LH = "text_decoder.decoder.layers.{i}.", "model.language_model.layers.{i}."
A, AH, G = L + "self_attention.", LH + "self_attn.", LH + "linear_attn."
LINEAR, FULL = "linear_attention", "full_attention"

# fmt: off
GATED_DELTA_NET: tuple[Entry, ...] = (
    Entry("llm_layer", A + "in_proj.weight", (G + "in_proj_qkv.weight", G + "in_proj_z.weight", G + "in_proj_b.weight",
          G + "in_proj_a.weight"), (("lconv", "h"), ("lv", "h"), ("lvh", "h"), ("lvh", "h")), "sections", 0,
          layer=LINEAR, sections=(("lk", "lk", "lv"), ("lv",), ("lvh",), ("lvh",))),
    Entry("llm_layer", A + "conv1d.weight", (G + "conv1d.weight",), (("lconv", "one", "lkw"),), "sections", 0,
          layer=LINEAR, sections=(("lk", "lk", "lv"),)),
    Entry("llm_layer", A + "A_log", (G + "A_log",), (("lvh",),), split=0, layer=LINEAR),
    Entry("llm_layer", A + "dt_bias", (G + "dt_bias",), (("lvh",),), split=0, layer=LINEAR),
    Entry("llm_layer", A + "out_norm.weight", (G + "norm.weight",), (("lvd",),), layer=LINEAR),
    Entry("llm_layer", A + "out_proj.weight", (G + "out_proj.weight",), (("h", "lv"),), split=1, layer=LINEAR),
)
EH, S = LH + "mlp.experts.{e}.", L + "mlp.shared_experts."
SH = LH + "mlp.shared_expert."
# Qwen3-VL-MoE's router and experts (stored one tensor per expert, as transformers' qwen2_moe conversion reads them),
# and a gated shared expert
MOE: tuple[Entry, ...] = (
    Entry("llm_layer", L + "mlp.router.weight", (LH + "mlp.gate.weight",), (("experts", "h"),), when="moe"),
    Entry("llm_layer", L + "mlp.experts.local_experts.{e}.linear_fc1.weight", (EH + "gate_proj.weight",
          EH + "up_proj.weight"), (("eff", "h"), ("eff", "h")), "glu", 0, when="moe", expert=True),
    Entry("llm_layer", L + "mlp.experts.local_experts.{e}.linear_fc2.weight", (EH + "down_proj.weight",),
          (("h", "eff"),), split=1, when="moe", expert=True),
    Entry("llm_layer", S + "linear_fc1.weight", (SH + "gate_proj.weight", SH + "up_proj.weight"),
          (("sffn", "h"), ("sffn", "h")), "glu", 0, when="moe"),
    Entry("llm_layer", S + "linear_fc2.weight", (SH + "down_proj.weight",), (("h", "sffn"),), split=1, when="moe"),
    Entry("llm_layer", S + "gate_weight", (LH + "mlp.shared_expert_gate.weight",), (("one", "h"),), when="moe"),
)
GATED_ATTENTION: tuple[Entry, ...] = (
    Entry("llm_layer", A + "linear_qkv.weight", tuple(AH + f"{x}_proj.weight" for x in "qkv"),
          (("q2", "h"), ("kv", "h"), ("kv", "h")), "gated_qkv", 0, LLM_HEADS, layer=FULL),
    *(Entry("llm_layer", A + f"{x}_layernorm.weight", (AH + f"{x}_norm.weight",), (("hd",),), layer=FULL)
      for x in "qk"),
    Entry("llm_layer", A + "linear_proj.weight", (AH + "o_proj.weight",), (("h", "q"),), split=1, layer=FULL),
)
# fmt: on
VISION = tuple(e for e in qwen3_vl.TENSORS if e.scope in ("patch_embed", "vit_layer", "merger"))
TEXT = tuple(
    e for e in text_table("model.language_model.", dense_mlp(LH, when="dense")) if "self_attention." not in e.mg
)
TENSORS: tuple[Entry, ...] = (*VISION, *TEXT, *GATED_DELTA_NET, *GATED_ATTENTION, *MOE)


def qwen3_5_dims(model: ModelConfig) -> dict[str, int]:
    text = model.text_decoder
    lk = text.linear_num_key_heads * text.linear_key_head_dim
    lv = text.linear_num_value_heads * text.linear_value_head_dim
    dims = qwen3_vl.qwen3_dims(model)
    return {
        **dims,
        "q2": 2 * dims["q"],
        "lk": lk,
        "lv": lv,
        "lconv": 2 * lk + lv,
        "lvh": text.linear_num_value_heads,
        "lvd": text.linear_value_head_dim,
        "lkw": text.linear_conv_kernel_dim,
        "one": 1,
        "sffn": text.moe_shared_expert_intermediate_size or 0,
    }


def layer_types(text: Mapping[str, Any]) -> list[str]:
    """The LLM's layer kinds from config.json: ``layer_types``, else every ``full_attention_interval``-th layer
    full attention (transformers' default, 4)."""
    layers = need(text, "num_hidden_layers", LABEL)
    kinds = text.get("layer_types")
    if kinds is None:
        interval = text.get("full_attention_interval", 4)
        kinds = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {LINEAR, FULL}:
        raise HfConfigError(f"config.json's layer_types {kinds} must name {layers} layers, each {LINEAR} or {FULL}")
    return list(kinds)


def model_json(config: Mapping[str, Any]) -> dict[str, Any]:
    """model.json content from a Qwen3.5 config.json: Qwen3-VL's reading (ViT without DeepStack) plus the hybrid
    decoder's fields."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise HfConfigError(f"config.json has no text_config: not a {LABEL} checkpoint")
    moe = bool(text.get("num_experts"))
    if moe:  # no dense MLP: the shared expert's width stands in for the field every Qwen text config has
        text = {"intermediate_size": need(text, "shared_expert_intermediate_size", LABEL), **text}
    vision = {**vision_json(config, LABEL), "deepstack_visual_indexes": []}
    out = qwen3_vl.model_json({**config, "text_config": text, "vision_config": vision})
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    out["model_id"] = MODEL_ID
    out["text_decoder"].update(
        {
            "model_id": "qwen3_5_lm",
            **_TEXT_FIXED,
            "rotary_percent": float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
            "mrope_section": list(rope.get("mrope_section", [11, 11, 10])),
            "layer_types": layer_types(text),
            **{key: need(text, key, LABEL) for key in _LINEAR_KEYS},
        }
    )
    if moe:
        out["text_decoder"]["moe_shared_expert_intermediate_size"] = text["shared_expert_intermediate_size"]
        out["text_decoder"]["moe_shared_expert_gate"] = True
    return out


_LINEAR_KEYS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
_TEXT_FIXED: dict[str, Any] = {
    "qk_layernorm": True,
    "add_qkv_bias": False,
    "layernorm_zero_centered_gamma": True,
    "attention_output_gate": True,
    "mrope_interleaved": True,
}
_FIXED = {
    **fixed_keys(qwen3_vl._VISION_FIXED, _TEXT_FIXED, "LayerNorm"),
    "image_encoder.vision_encoder.deepstack_visual_indexes": [],
}


def _linear_rules(text: TextDecoderConfig) -> Iterator[ModelFinding]:
    kinds = text.layer_types
    if len(kinds) != text.num_layers or set(kinds) - {LINEAR, FULL}:
        yield (
            "text_decoder.layer_types",
            kinds,
            f"one entry per LLM layer (num_layers = {text.num_layers}), each {LINEAR} or {FULL}",
            "take it from config.json's layer_types (cut to num_layers)",
        )
    if text.linear_num_value_heads % text.linear_num_key_heads:
        yield (
            "text_decoder.linear_num_value_heads",
            text.linear_num_value_heads,
            f"must be a multiple of linear_num_key_heads = {text.linear_num_key_heads} (each key head serves as many)",
            "set both from config.json",
        )


def rules(model: ModelConfig) -> Iterator[ModelFinding]:
    text = model.text_decoder
    yield from fixed_fields(model, _FIXED, LABEL)
    yield from _linear_rules(text)
    yield from qwen3_vl.moe_rules(text)
    shared = bool(text.moe_shared_expert_intermediate_size) and text.moe_shared_expert_gate
    if bool(text.num_moe_experts) != shared:
        yield (
            "text_decoder.moe_shared_expert_intermediate_size",
            text.moe_shared_expert_intermediate_size,
            f"{LABEL}-MoE layers have a gated shared expert (moe_shared_expert_gate true) and dense ones none",
            "set both from config.json's shared_expert_intermediate_size (or remove them for a dense model)",
        )


def qwen3_5_flags(model: ModelConfig) -> dict[str, bool]:
    return qwen3_vl.qwen3_flags(model)


def decoder_layer(text: TextDecoderConfig, index: int, ulysses: bool) -> Any:
    """Qwen3.5's layer ``index``: the Qwen-VL layer (zero-centred norms and the gated attention come from the
    config), with megatron-core's Gated DeltaNet as its mixer where ``layer_types`` says linear attention."""
    from mm_rl.models.qwen_vl.layers import PlainNorm, llm_layer_spec

    spec = llm_layer_spec(text.normalization, ulysses, qk_layernorm=True, num_experts=text.num_moe_experts)
    if text.layer_types[index] == LINEAR:
        from mm_rl.models.qwen3_5.linear_attention import gated_delta_net_spec

        spec.submodules.self_attention = gated_delta_net_spec(PlainNorm)
    return spec


FAMILY = ModelFamily(
    name="qwen3_5",
    label=LABEL,
    model_id=MODEL_ID,
    hf_model_types=("qwen3_5", "qwen3_5_moe"),
    hf_architecture="Qwen3_5ForConditionalGeneration",
    tensors=TENSORS,
    model_dims=qwen3_5_dims,
    model_flags=qwen3_5_flags,
    model_json=model_json,
    hf_config=hf_config_for,
    stage=qwen_vl.stage,
    decoder_layer=decoder_layer,
    tiny=tiny,
    rules=rules,
    hf_unused=("mtp.",),
    # vLLM 0.32's CPU Gated DeltaNet kernel takes bf16 only (``cpu_gdn_attention_core`` asserts it,
    # vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py)
    cpu_engine_dtype="bfloat16",
)
