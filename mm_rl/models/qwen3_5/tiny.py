"""The tiny Qwen3.5 (``mm_rl.demo.tiny`` builds it): 4 LLM layers, Gated DeltaNet and gated full attention in turn
(``full_attention_interval`` 2; the published models have 3 : 1, which the parity tests build with
``full_attention_interval=4``), and a 2-block ViT with 16-pixel patches and a 4 x 4 learned position
table (Qwen3-VL's ViT without DeepStack). With ``num_experts=4`` it is the tiny Qwen3.5-MoE: every layer's MLP is 4
experts of width 32, top-2, and a gated shared expert of width 64 (``tiny_qwen3_5_moe``).

The linear-attention heads are 128 wide, as in every published Qwen3.5: vLLM 0.32's CPU Gated DeltaNet kernel
(``cpu_gdn_attention_core``) refuses 16 and 32. Two key and two value heads, so TP 2 gives each rank one of each. The
full attention has 4 query heads of 64 in 2 groups, the rotary on the first quarter of each head (16 channels:
interleaved mRoPE sections [3, 3, 2])."""

from __future__ import annotations

from typing import Any

from mm_rl.models.qwen3_vl.tiny import VISION_CONFIG as QWEN3_VL_VISION

PROCESSOR_CLASS = "Qwen3VLProcessor"
IMAGE_PROCESSOR: dict[str, Any] = {"patch_size": 16}
# Qwen3-VL's tiny ViT, two blocks, without DeepStack
VISION_CONFIG: dict[str, Any] = {
    **{key: value for key, value in QWEN3_VL_VISION.items() if key != "deepstack_visual_indexes"},
    "depth": 2,
}
TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "intermediate_size": 256,
    "rope_theta": 1e7,
    "mrope_section": [3, 3, 2],
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "vocab_size": 1024,  # the tiny tokenizer's ids (mm_rl.demo.tiny.VOCAB_SIZE)
    "hidden_act": "silu",
    # 1 : 1, as one attention layer in four leaves the 4-layer tiny unable to learn to copy the question's number
    # (warm-up accuracy 0.16; GRPO moved greedy validation 0.11 -> 0.34 -> 0.23 over 30 steps)
    "full_attention_interval": 2,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    # Qwen3.5-MoE when num_experts > 0: every layer routes each token to 2 of the experts, beside a gated shared
    # expert
    "num_experts": 0,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
}
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


def hf_config(**fields: Any) -> Any:
    """transformers' Qwen3.5 config, or Qwen3.5-MoE's when the text fields ask for experts (the rotary share and
    interleaving live in ``rope_parameters``)."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    text = fields["text_config"]
    rope = text["rope_parameters"]
    rope["mrope_interleaved"] = True
    rope["partial_rotary_factor"] = text.pop("partial_rotary_factor")
    if text["num_experts"]:
        del text["intermediate_size"]
        return Qwen3_5MoeConfig(**fields)
    for key in MOE_FIELDS:
        del text[key]
    return Qwen3_5Config(**fields)
