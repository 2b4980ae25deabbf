"""The tiny Qwen3-VL (``mm_rl.models.tiny`` builds it): 4 Qwen3 layers (head_dim 32, interleaved mRoPE
[6, 5, 5]) and a 3-block ViT with 16-pixel patches, a 4 x 4 learned position table and DeepStack from
blocks 0 and 1 into LLM layers 0 and 1."""

from __future__ import annotations

from typing import Any

from mm_rl.models.tiny import VOCAB_SIZE

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
    "vocab_size": VOCAB_SIZE,
    "hidden_act": "silu",
}


def hf_config(**fields: Any) -> Any:
    from transformers import Qwen3VLConfig

    fields["text_config"]["rope_parameters"]["mrope_interleaved"] = True
    return Qwen3VLConfig(**fields)
