"""The tiny Qwen2.5-VL (``mm_rl.demo.tiny`` builds it): its HF config class and the sizes of the tiny default.

ViT: 2 blocks with block 1 full attention, so both window attention (window 112 = 8 patches of 14) and the
full-attention path, the 2D vision rotary and the 2x2 patch merger all run.
"""

from __future__ import annotations

from typing import Any

PROCESSOR_CLASS = "Qwen2_5_VLProcessor"
IMAGE_PROCESSOR: dict[str, Any] = {"patch_size": 14}

VISION_CONFIG: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 64,
    "num_heads": 4,
    "intermediate_size": 128,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [1],
    "out_hidden_size": 128,
    "in_channels": 3,
    "hidden_act": "silu",
    "tokens_per_second": 2,
}
TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "rope_theta": 1e6,
    "mrope_section": [4, 6, 6],
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "vocab_size": 1024,  # the tiny tokenizer's ids (mm_rl.demo.tiny.VOCAB_SIZE; a test holds them equal)
    "hidden_act": "silu",
}


def hf_config(**fields: Any) -> Any:
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(**fields)
