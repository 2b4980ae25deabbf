"""The tiny Qwen3-VL (``mm_rl.demo.tiny`` builds it): 4 Qwen3 layers (head_dim 32, interleaved mRoPE
[6, 5, 5]) and a 3-block ViT with 16-pixel patches, a 4 x 4 learned position table and DeepStack from
blocks 0 and 1 into LLM layers 0 and 1. With ``num_experts=4`` it is the tiny Qwen3-VL-MoE: every layer's MLP
is 4 experts of width 32, top-2 (``tiny_qwen3_vl_moe``; EP 2 gives each rank two)."""

from __future__ import annotations

from typing import Any

PROCESSOR_CLASS = "Qwen3VLProcessor"
IMAGE_PROCESSOR: dict[str, Any] = {"patch_size": 16}
VISION_CONFIG: dict[str, Any] = {
    "depth": 3,
    "hidden_size": 64,
    "num_heads": 4,
    "intermediate_size": 128,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 128,
    "in_channels": 3,
    "hidden_act": "gelu_pytorch_tanh",
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0, 1],
}
TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "rope_theta": 5e6,
    "mrope_section": [6, 5, 5],
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "vocab_size": 1024,  # the tiny tokenizer's ids (mm_rl.demo.tiny.VOCAB_SIZE; a test holds them equal)
    "hidden_act": "silu",
    # MoE (Qwen3-VL-MoE) when num_experts > 0: every layer routes each token to 2 of the experts
    "num_experts": 0,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,  # 2 x 32 != hidden 128: transformers tells the fused layouts apart by shape
    # transformers 5's config class dropped it (its router always renormalises); published config.json files and
    # vLLM's Qwen3-MoE block (``config.norm_topk_prob``) have it
    "norm_topk_prob": True,
}
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")


def hf_config(**fields: Any) -> Any:
    """Qwen3-VL, or Qwen3-VL-MoE when the text fields ask for experts."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    text = fields["text_config"]
    text["rope_parameters"]["mrope_interleaved"] = True
    if text["num_experts"]:
        return Qwen3VLMoeConfig(**fields)
    for key in MOE_FIELDS:
        del text[key]
    return Qwen3VLConfig(**fields)
