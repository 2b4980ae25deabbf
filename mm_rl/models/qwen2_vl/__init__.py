"""Qwen2-VL: the shared Qwen-VL stage (``mm_rl.models.qwen_vl``) with the older ViT, which the model.json
fields select: LayerNorm, a plain quick-GELU MLP with biases, full attention in every block (``window_size`` 0),
and a LayerNorm before the merger. The text decoder (Qwen2 with mRoPE [16, 24, 24]) and the rope index are the
same. This package holds what differs: the tensor names, model.json from config.json, the tiny model.
"""
