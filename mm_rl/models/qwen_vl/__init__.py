"""The Qwen-VL model on megatron-core, shared by the Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense and MoE) families:
the vision encoder + merger, the mRoPE text decoder, one pipeline stage of the whole model, 3D rope position ids
and vocab-parallel log-probs / entropy for the RL loss. model.json's switches select each family's variant; the
family packages hold only their facts (tensor table, model.json rules, tiny model).

Modules:
- ``model``: one pipeline stage of the model (MindSpeed-MM state-dict names) and ``build_model``.
- ``layers``: the LLM decoder layer specs (``decoder_layer``: the seam a family fills) and the norms.
- ``vision`` / ``vision_attention``: the ViT (window attention, 2D vision rotary) and the patch merger.
- ``config``: model.json + training flags -> megatron ``TransformerConfig`` for the text decoder.
- ``rope_index``: 3D (t, h, w) position ids [3, B, S]; ``rotary``: interleaved mRoPE (Qwen3-VL).
- ``llm_attention``: the LLM's core attention and packed micro-batches (padding removed, attention per sequence).
- ``logprobs``: per-token log-probs of labels and entropy from vocab-parallel logits, without gathering vocab.
- parallelism mechanics: ``pipeline`` (stage layout, embedding ranks), ``context_parallel`` (Ulysses),
  ``sequence_parallel`` (token shares, output rows); ``routing``: MoE routing counts.
- ``tensors``: the tensor-table pieces and config.json readers the families share.

Importing this package is light: megatron-core and torch load with :func:`stage` (a process that builds a model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mm_rl.models.family import MegatronStage


def stage() -> MegatronStage:
    """The module that builds a pipeline stage (``ModelFamily.stage``; imports megatron-core)."""
    from mm_rl.models.qwen_vl import model

    return model
