"""Qwen2-VL: Qwen2.5-VL's megatron model (``mm_rl.models.qwen2_5_vl``) with the older ViT, which the model.json
fields select: LayerNorm, a plain quick-GELU MLP with biases, full attention in every block (``window_size`` 0),
and a LayerNorm before the merger. The text decoder (Qwen2 with mRoPE [16, 24, 24]) and the rope index are the
same. This package holds what differs: the tensor names, model.json from config.json, the tiny model.
"""
