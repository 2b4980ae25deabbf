"""The tensor table pieces and model.json readers the Qwen-VL families share: the ViT attention and the
Qwen2.5-VL merger MLP in MindSpeed-MM's names, the Qwen2 text decoder with mRoPE, the dimension names of
``Entry.shapes`` and the config.json fields every Qwen-VL checkpoint spells the same way.

Tensor layouts (see ``mm_rl.convert.mapping`` for how pieces are cut):

- ``plain``: one HF tensor, rank r holds the r-th contiguous chunk along ``split`` (or all of it).
- ``glu``: ``linear_fc1`` = cat(gate, up); rank r holds cat(gate_r, up_r), so each rank can apply
  activation(gate) * up on its own. The TP-merged (full) tensor is cat(gate, up), not cat of the shards.
- ``qkv``: the LLM's separate q/k/v become one tensor interleaved per query group, [q heads of group g, k_g, v_g]
  for g = 0..G-1, so a contiguous chunk gives each rank whole groups.
- ``fused_qkv``: the ViT's fused [Q; K; V] is re-laid per head, [q_h, k_h, v_h] (the ViT has one group per head).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from mm_rl.models.family import Entry, HfConfigError, ModelFinding, Scope

if TYPE_CHECKING:
    from mm_rl.config.schema import ModelConfig

V, VH = "image_encoder.encoder.blocks.layers.{i}.", "visual.blocks.{i}."
L, LH = "text_decoder.decoder.layers.{i}.", "model.layers.{i}."
P, PH = "image_encoder.projector.", "visual.merger."
VIT_HEADS = ("vheads", "vheads", "vhd")
LLM_HEADS = ("heads", "groups", "hd")
VLIN, VQKV, LQKV = "vit_linear_bias", "vit_qkv_bias", "llm_qkv_bias"

PATCH_EMBED = Entry(
    "patch_embed",
    "image_encoder.encoder.patch_embed.proj.weight",
    ("visual.patch_embed.proj.weight",),
    (("vh", "cin", "tps", "ps", "ps"),),
)

VIT_ATTENTION: tuple[Entry, ...] = (
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
)

MERGER_MLP: tuple[Entry, ...] = (
    Entry("merger", P + "encoder.linear_fc1.weight", (PH + "mlp.0.weight",), (("pffn", "pcat"),), split=0),
    Entry("merger", P + "encoder.linear_fc1.bias", (PH + "mlp.0.bias",), (("pffn",),), split=0),
    Entry("merger", P + "encoder.linear_fc2.weight", (PH + "mlp.2.weight",), (("ph", "pffn"),), split=1),
    Entry("merger", P + "encoder.linear_fc2.bias", (PH + "mlp.2.bias",), (("ph",),)),
)

TEXT: tuple[Entry, ...] = (
    Entry(
        "embedding",
        "text_decoder.embedding.word_embeddings.weight",
        ("model.embed_tokens.weight",),
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
    Entry(
        "llm_layer",
        L + "self_attention.linear_qkv.bias",
        (LH + "self_attn.q_proj.bias", LH + "self_attn.k_proj.bias", LH + "self_attn.v_proj.bias"),
        (("q",), ("kv",), ("kv",)),
        "qkv",
        0,
        LLM_HEADS,
        when=LQKV,
    ),
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
    ),
    Entry("llm_layer", L + "mlp.linear_fc2.weight", (LH + "mlp.down_proj.weight",), (("h", "ffn"),), split=1),
    Entry("final_norm", "text_decoder.decoder.final_layernorm.weight", ("model.norm.weight",), (("h",),)),
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
        ("model.embed_tokens.weight",),
        (("vocab", "h"),),
        split=0,
        when="tied",
        duplicate=True,
    ),
)


def pair(scope: Scope, mg: str, hf: str, dim: str, split: int | None = None) -> tuple[Entry, Entry]:
    """A weight-and-bias pair of 1D tensors: a LayerNorm, or a linear layer's bias with its weight elsewhere."""
    return (
        Entry(scope, mg + ".weight", (hf + ".weight",), ((dim,),), split=split),
        Entry(scope, mg + ".bias", (hf + ".bias",), ((dim,),), split=split),
    )


# Newer transformers releases nest the LLM and the ViT under ``model.``; output keeps the published names.
HF_ALIASES: tuple[tuple[str, str], ...] = (("model.language_model.", "model."), ("model.visual.", "visual."))


def model_dims(model: ModelConfig) -> dict[str, int]:
    """The dimension names used in ``Entry.shapes``, from model.json."""
    text, vit = model.text_decoder, model.image_encoder.vision_encoder
    proj = model.image_encoder.vision_projector
    groups = text.num_query_groups if text.group_query_attention else text.num_attention_heads
    hd = text.kv_channels or text.hidden_size // text.num_attention_heads
    vhd = vit.hidden_size // vit.num_attention_heads
    return {
        "vocab": text.vocab_size,
        "h": text.hidden_size,
        "ffn": text.ffn_hidden_size,
        "heads": text.num_attention_heads,
        "groups": groups,
        "hd": hd,
        "q": text.num_attention_heads * hd,
        "kv": groups * hd,
        "vh": vit.hidden_size,
        "vffn": vit.ffn_hidden_size,
        "vheads": vit.num_attention_heads,
        "vhd": vhd,
        "vattn": vit.num_attention_heads * vhd,
        "vqkv": 3 * vit.num_attention_heads * vhd,
        "cin": vit.in_channels,
        "tps": vit.temporal_patch_size,
        "ps": vit.patch_size,
        "pin": proj.input_size,
        "pcat": proj.input_size * vit.spatial_merge_size**2,
        "pffn": proj.ffn_hidden_size,
        "ph": proj.hidden_size,
    }


def model_flags(model: ModelConfig) -> dict[str, bool]:
    """The switches named by ``Entry.when``."""
    text, vit = model.text_decoder, model.image_encoder.vision_encoder
    return {
        "vit_qkv_bias": vit.add_qkv_bias,
        "vit_linear_bias": vit.add_bias_linear,
        "llm_qkv_bias": text.add_qkv_bias,
        "untied": text.untie_embeddings_and_output_weights,
        "tied": not text.untie_embeddings_and_output_weights,
    }


# ------------------------------------------------------------------------------ model.json from config.json
def need(section: Mapping[str, Any], key: str, label: str) -> Any:
    if key not in section:
        raise HfConfigError(f"config.json lacks {key}: not a {label} config")
    return section[key]


def text_decoder_json(config: Mapping[str, Any], label: str) -> dict[str, Any]:
    """model.json's ``text_decoder`` from config.json: the published flat spelling or ``text_config``, with
    ``rope_scaling`` or transformers 5's ``rope_parameters``."""
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or text.get("rope_scaling") or config.get("rope_scaling") or {}
    heads, hidden = need(text, "num_attention_heads", label), need(text, "hidden_size", label)
    layers = need(text, "num_hidden_layers", label)
    decoder = {
        "num_layers": layers,
        "pipeline_num_layers": [layers],
        "hidden_size": hidden,
        "ffn_hidden_size": need(text, "intermediate_size", label),
        "num_attention_heads": heads,
        "num_query_groups": text.get("num_key_value_heads", heads),
        "kv_channels": text.get("head_dim") or hidden // heads,
        "vocab_size": need(text, "vocab_size", label),
        "rope_theta": float(rope.get("rope_theta", text.get("rope_theta", 1000000.0))),
        "untie_embeddings_and_output_weights": not text.get(
            "tie_word_embeddings", config.get("tie_word_embeddings", False)
        ),
        "layernorm_epsilon": float(text.get("rms_norm_eps", 1e-6)),
    }
    for key, source in (("max_position_embeddings", text), ("mrope_section", rope)):
        if key in source:
            decoder[key] = list(source[key]) if key == "mrope_section" else source[key]
    return decoder


def token_ids_json(config: Mapping[str, Any]) -> dict[str, int]:
    return {
        key: config[hf_key]
        for key, hf_key in (
            ("img_context_token_id", "image_token_id"),
            ("vision_start_token_id", "vision_start_token_id"),
        )
        if hf_key in config
    }


def vision_json(config: Mapping[str, Any], label: str) -> Mapping[str, Any]:
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        raise HfConfigError(f"config.json has no vision_config: not a {label} checkpoint")
    return vision


# ---------------------------------------------------------------------------------------- model rules
def fixed_fields(model: ModelConfig, fixed: Mapping[str, Any], label: str) -> Iterator[ModelFinding]:
    """Fields the family's checkpoints fix (a different value builds a model no checkpoint of it fills)."""
    for key, want in fixed.items():
        value: Any = model
        for part in key.split("."):
            value = getattr(value, part)
        if value != want:
            yield key, value, f"{label} checkpoints have {want!r} here", f"set it to {want!r} (or remove the key)"
