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

import copy
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

# fmt: off
PATCH_EMBED = Entry("patch_embed", "image_encoder.encoder.patch_embed.proj.weight", ("visual.patch_embed.proj.weight",),
                    (("vh", "cin", "tps", "ps", "ps"),))


def pair(scope: Scope, mg: str, hf: str, dim: str, split: int | None = None) -> tuple[Entry, Entry]:
    """A weight-and-bias pair of 1D tensors: a LayerNorm, or a linear layer's bias with its weight elsewhere."""
    return (Entry(scope, mg + ".weight", (hf + ".weight",), ((dim,),), split=split),
            Entry(scope, mg + ".bias", (hf + ".bias",), ((dim,),), split=split))


def vit_attention(vh: str) -> tuple[Entry, ...]:
    """A ViT block's fused qkv and output projection (HF block prefix ``vh``)."""
    return (
        Entry("vit_layer", V + "self_attention.linear_qkv.weight", (vh + "attn.qkv.weight",), (("vqkv", "vh"),),
              "fused_qkv", 0, VIT_HEADS),
        Entry("vit_layer", V + "self_attention.linear_qkv.bias", (vh + "attn.qkv.bias",), (("vqkv",),),
              "fused_qkv", 0, VIT_HEADS, when=VQKV),
        Entry("vit_layer", V + "self_attention.linear_proj.weight", (vh + "attn.proj.weight",), (("vh", "vattn"),),
              split=1),
        Entry("vit_layer", V + "self_attention.linear_proj.bias", (vh + "attn.proj.bias",), (("vh",),), when=VLIN),
    )


def vit_plain_mlp(vh: str, fc1: str, fc2: str) -> tuple[Entry, ...]:
    """A ViT block's two-layer MLP with biases (Qwen2-VL's ``fc1`` / ``fc2``, Qwen3-VL's ``linear_fc1`` / ...)."""
    return (
        Entry("vit_layer", V + "mlp.linear_fc1.weight", (vh + f"mlp.{fc1}.weight",), (("vffn", "vh"),), split=0),
        Entry("vit_layer", V + "mlp.linear_fc1.bias", (vh + f"mlp.{fc1}.bias",), (("vffn",),), split=0, when=VLIN),
        Entry("vit_layer", V + "mlp.linear_fc2.weight", (vh + f"mlp.{fc2}.weight",), (("vh", "vffn"),), split=1),
        Entry("vit_layer", V + "mlp.linear_fc2.bias", (vh + f"mlp.{fc2}.bias",), (("vh",),), when=VLIN),
    )


MERGER_MLP: tuple[Entry, ...] = (
    Entry("merger", P + "encoder.linear_fc1.weight", (PH + "mlp.0.weight",), (("pffn", "pcat"),), split=0),
    Entry("merger", P + "encoder.linear_fc1.bias", (PH + "mlp.0.bias",), (("pffn",),), split=0),
    Entry("merger", P + "encoder.linear_fc2.weight", (PH + "mlp.2.weight",), (("ph", "pffn"),), split=1),
    Entry("merger", P + "encoder.linear_fc2.bias", (PH + "mlp.2.bias",), (("ph",),)),
)


def dense_mlp(lh: str, when: str | None = None) -> tuple[Entry, ...]:
    """An LLM layer's SwiGLU MLP (HF layer prefix ``lh``): gate and up fused into ``linear_fc1``."""
    return (
        Entry("llm_layer", L + "mlp.linear_fc1.weight", (lh + "mlp.gate_proj.weight", lh + "mlp.up_proj.weight"),
              (("ffn", "h"), ("ffn", "h")), "glu", 0, when=when),
        Entry("llm_layer", L + "mlp.linear_fc2.weight", (lh + "mlp.down_proj.weight",), (("h", "ffn"),), split=1,
              when=when),
    )


def text_table(hf: str, mlp: tuple[Entry, ...], qkv_bias: bool = True, qk_norm: bool = False) -> tuple[Entry, ...]:
    """The text decoder (HF prefix ``hf``: ``model.`` or ``model.language_model.``): embeddings, per layer the
    attention (q / k / v fused per query group; a qkv bias switched by model.json, Qwen3's per-head q / k norms)
    and ``mlp``, the final norm and the output layer (or, tied, a copy of the embeddings)."""
    lh = hf + "layers.{i}."
    qkv = tuple(lh + f"self_attn.{x}_proj." for x in "qkv")
    bias = (Entry("llm_layer", L + "self_attention.linear_qkv.bias", tuple(x + "bias" for x in qkv),
                  (("q",), ("kv",), ("kv",)), "qkv", 0, LLM_HEADS, when=LQKV),) if qkv_bias else ()
    norms = tuple(Entry("llm_layer", L + f"self_attention.{x}_layernorm.weight", (lh + f"self_attn.{x}_norm.weight",),
                        (("hd",),)) for x in "qk") if qk_norm else ()
    return (
        Entry("embedding", "text_decoder.embedding.word_embeddings.weight", (hf + "embed_tokens.weight",),
              (("vocab", "h"),), split=0),
        Entry("llm_layer", L + "input_layernorm.weight", (lh + "input_layernorm.weight",), (("h",),)),
        Entry("llm_layer", L + "self_attention.linear_qkv.weight", tuple(x + "weight" for x in qkv),
              (("q", "h"), ("kv", "h"), ("kv", "h")), "qkv", 0, LLM_HEADS),
        *bias,
        *norms,
        Entry("llm_layer", L + "self_attention.linear_proj.weight", (lh + "self_attn.o_proj.weight",), (("h", "q"),),
              split=1),
        Entry("llm_layer", L + "pre_mlp_layernorm.weight", (lh + "post_attention_layernorm.weight",), (("h",),)),
        *mlp,
        Entry("final_norm", "text_decoder.decoder.final_layernorm.weight", (hf + "norm.weight",), (("h",),)),
        Entry("output_layer", "text_decoder.output_layer.weight", ("lm_head.weight",), (("vocab", "h"),), split=0,
              when="untied"),
        Entry("output_layer", "text_decoder.output_layer.weight", (hf + "embed_tokens.weight",), (("vocab", "h"),),
              split=0, when="tied", duplicate=True),
    )
# fmt: on


VIT_ATTENTION = vit_attention(VH)
TEXT = text_table("model.", dense_mlp(LH))


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
            ("video_token_id", "video_token_id"),
            ("vision_start_token_id", "vision_start_token_id"),
        )
        if hf_key in config
    }


def vision_json(config: Mapping[str, Any], label: str) -> Mapping[str, Any]:
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        raise HfConfigError(f"config.json has no vision_config: not a {label} checkpoint")
    return vision


def hf_config_for(
    base: Mapping[str, Any], model: ModelConfig, projector_out: str = "out_hidden_size"
) -> dict[str, Any]:
    """The HF config.json of the job's model: the checkpoint's ``base`` with what model.json may change written
    back (the LLM's and ViT's layer counts, the LLM's width, MLP width, heads and key/value heads, its activation,
    ``rope_theta`` and ``mrope_section``; the merger's output, ``vision_config[projector_out]``, follows the LLM's
    width), wherever the checkpoint spells them (flat, ``text_config``, ``rope_scaling`` or transformers 5's
    ``rope_parameters``), so transformers, vLLM and the exported checkpoint build the model the actor trains."""
    config = copy.deepcopy(dict(base))
    text_cfg, vit = model.text_decoder, model.image_encoder.vision_encoder
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    kv_heads = text_cfg.num_query_groups if text_cfg.group_query_attention else text_cfg.num_attention_heads
    for section in {id(c): c for c in (config, text)}.values():
        for key, value in (("num_hidden_layers", text_cfg.num_layers), ("hidden_act", text_cfg.activation_func),
                           ("rope_theta", text_cfg.rope_theta), ("hidden_size", text_cfg.hidden_size),
                           ("intermediate_size", text_cfg.ffn_hidden_size),
                           ("num_attention_heads", text_cfg.num_attention_heads),
                           ("num_key_value_heads", kv_heads)):  # fmt: skip
            if key in section:
                section[key] = value
        if isinstance(section.get("layer_types"), list):
            section["layer_types"] = section["layer_types"][: text_cfg.num_layers]
        for rope in (section.get("rope_scaling"), section.get("rope_parameters")):
            if isinstance(rope, dict):
                if "rope_theta" in rope:
                    rope["rope_theta"] = text_cfg.rope_theta
                if "mrope_section" in rope and text_cfg.mrope_section:
                    rope["mrope_section"] = list(text_cfg.mrope_section)
    text["num_hidden_layers"] = text_cfg.num_layers
    vision = config.setdefault("vision_config", {})
    vision["depth"] = vit.num_layers
    if projector_out in vision:
        vision[projector_out] = model.image_encoder.vision_projector.hidden_size
    return config


def encoder_json(vision: Mapping[str, Any], width: int, ffn: int, label: str, patch_size: int = 14) -> dict[str, Any]:
    """model.json's ``vision_encoder`` fields every Qwen-VL ViT has (its width and MLP width as the family reads
    them)."""
    depth, heads = need(vision, "depth", label), need(vision, "num_heads", label)
    return {
        "num_layers": depth,
        "pipeline_num_layers": [depth],
        "hidden_size": width,
        "ffn_hidden_size": ffn,
        "num_attention_heads": heads,
        "num_query_groups": heads,
        "in_channels": vision.get("in_channels", vision.get("in_chans", 3)),
        "patch_size": vision.get("patch_size", patch_size),
        "temporal_patch_size": vision.get("temporal_patch_size", 2),
        "spatial_merge_size": vision.get("spatial_merge_size", 2),
    }


def layernorm_projector(width: int, hidden: int, merge: int) -> dict[str, Any]:
    """model.json's ``vision_projector`` of a merger with a LayerNorm (Qwen2-VL, Qwen3-VL): ``width`` in,
    ``hidden`` (the LLM's) out, over ``merge`` x ``merge`` patches."""
    return {
        "model_id": "lnmlp",
        "input_size": width,
        "hidden_size": hidden,
        "ffn_hidden_size": width * merge**2,
        "normalization": "LayerNorm",
    }


def vl_json(model_id: str, config: Mapping[str, Any], encoder: dict[str, Any], projector: dict[str, Any],
            decoder: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """model.json content: the family's ``model_id``, the special tokens' ids and the three parts."""
    return {
        "model_id": model_id,
        **token_ids_json(config),
        "image_encoder": {"vision_encoder": encoder, "vision_projector": projector},
        "text_decoder": decoder,
    }


# ---------------------------------------------------------------------------------------- model rules
def fixed_keys(vision: Mapping[str, Any], text: Mapping[str, Any], projector_norm: str) -> dict[str, Any]:
    """The model.json keys a family's checkpoints fix, from the ViT and text fields its model.json sets (a list of
    indexes is data, not structure) and its merger's norm; every Qwen-VL LLM has a SwiGLU MLP."""
    return {
        **{
            f"image_encoder.vision_encoder.{key}": value for key, value in vision.items() if not isinstance(value, list)
        },
        **{f"text_decoder.{key}": value for key, value in text.items()},
        "image_encoder.vision_projector.normalization": projector_norm,
        "text_decoder.swiglu": True,
        # transformers' and vLLM's Qwen decoders have RMSNorm only: the engine and the exported checkpoint could not
        # follow another norm
        "text_decoder.normalization": "RMSNorm",
    }


def fixed_fields(model: ModelConfig, fixed: Mapping[str, Any], label: str) -> Iterator[ModelFinding]:
    """Fields the family's checkpoints fix (a different value builds a model no checkpoint of it fills)."""
    for key, want in fixed.items():
        value: Any = model
        for part in key.split("."):
            value = getattr(value, part)
        if value != want:
            yield key, value, f"{label} checkpoints have {want!r} here", f"set it to {want!r} (or remove the key)"
