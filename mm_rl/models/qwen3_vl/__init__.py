"""Qwen3-VL (dense and MoE): the shared Qwen-VL stage (``mm_rl.models.qwen_vl``) configured by model.json's
switches — a ViT with 16-pixel patches, a learned position table interpolated to each image's grid, LayerNorm and a
tanh-GELU MLP with biases, full attention in every block and DeepStack mergers; a Qwen3 text decoder with
per-head query / key RMSNorm, no qkv bias, an explicit head_dim and interleaved mRoPE. This package holds what
differs: the tensor names (MindSpeed-MM's ``qwen3vl`` megatron layout), model.json from config.json, the tiny model.
"""
