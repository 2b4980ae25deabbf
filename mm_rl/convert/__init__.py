"""Checkpoint conversion between HuggingFace checkpoints and Megatron shards in MindSpeed-MM's layout.

- ``mapping``: the rules that apply a model family's tensor table (names, layouts, tensor-parallel splits; also
  used by the weight sync).
- ``stages``: which pipeline stage holds which layers and tensors.
- ``hf_reader`` / ``hf_writer``: HuggingFace safetensors checkpoints, read by slices and written by streaming.
- ``layout``: MindSpeed-MM's directory layout, the latest-iteration file, rank files and atomic directories.
- ``hf2mg`` / ``mg2hf``: the two conversions; ``model_config``: model.json from an HF config.json;
  ``cli``: ``ascendfactory-cli convert``.

Entry points: ``hf2mg``, ``mg2hf`` (library, used by the trainer) and ``model_config_from_hf``, re-exported
here; ``mm_rl.convert.mapping.merge_tp_shards`` / ``megatron_to_hf`` for the weight sync. The re-exported
functions shadow their modules as attributes of this package: reach a module with ``importlib.import_module``.

The conversions stream: they read exactly the rows or columns each output shard needs and hold one output file
(hf2mg) or one tensor (mg2hf) in memory, never the whole model.
"""

from mm_rl.convert.errors import ConversionError
from mm_rl.convert.hf2mg import hf2mg
from mm_rl.convert.mg2hf import mg2hf
from mm_rl.convert.model_config import model_config_from_hf

__all__ = ["ConversionError", "hf2mg", "mg2hf", "model_config_from_hf"]
