"""Qwen2.5-VL on megatron-core: the vision encoder + merger, the mRoPE text decoder, the full model with
pipeline stages, 3D rope position ids and vocab-parallel log-probs / entropy for the RL loss. The same model,
configured by model.json's switches, is Qwen2-VL's and Qwen3-VL's (``mm_rl.models.qwen2_vl``, ``.qwen3_vl``).

Modules:
- ``vision``: the ViT (window attention, 2D vision rotary) and patch merger built from megatron-core blocks.
- ``config``: model.json + training flags -> megatron ``TransformerConfig`` for the text decoder.
- ``rope_index``: Qwen2.5-VL 3D (t, h, w) position ids [3, B, S] from token ids, image grids and the mask.
- ``model``: the full model for one pipeline stage (MindSpeed-MM state-dict names).
- ``llm_attention``: the LLM's core attention and packed micro-batches (padding removed, attention per sequence).
- ``logprobs``: per-token log-probs of labels and entropy from vocab-parallel logits, without gathering vocab.
- ``rotary``: interleaved mRoPE (Qwen3-VL) on megatron's multimodal rotary.
- ``family``: the family object (tensor table, model.json from config.json, fixed fields); ``tiny``: its tiny model.
"""
