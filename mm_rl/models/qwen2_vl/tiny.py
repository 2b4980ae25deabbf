"""The tiny Qwen2-VL (``mm_rl.demo.tiny`` builds it): the tiny Qwen2.5-VL's text decoder and a 2-block
full-attention ViT of the same width."""

from __future__ import annotations

from typing import Any

from mm_rl.models.qwen2_5_vl.tiny import TEXT_CONFIG as TEXT_CONFIG

PROCESSOR_CLASS = "Qwen2VLProcessor"
IMAGE_PROCESSOR: dict[str, Any] = {"patch_size": 14}
VISION_CONFIG: dict[str, Any] = {
    "depth": 2,
    "embed_dim": 64,
    "hidden_size": 128,
    "num_heads": 4,
    "mlp_ratio": 2,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "in_channels": 3,
    "hidden_act": "quick_gelu",
}


def hf_config(**fields: Any) -> Any:
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(**fields)
