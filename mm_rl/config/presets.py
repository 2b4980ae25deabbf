"""Model presets for `ascendfactory-cli config`: a model.json template plus run settings that suit it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
MODEL_DIR = CONFIG_DIR / "models"
BACKENDS = ("mm_rl",)


@dataclass(frozen=True)
class Preset:
    """``model``: model.json content; ``run``: yaml values (nested dict) that fit the model; targets for the
    planner's batch sizes."""

    name: str
    model: dict[str, Any]
    run: dict[str, Any] = field(default_factory=dict)
    target_gbs: int = 64
    target_prompts: int = 32
    embedded: bool = False  # the model (and data) are built by mm_rl itself


# Settings of a real Qwen2.5-VL run on geo3k (seq budget 1024 prompt + 1024 response; images upscaled to 512^2).
_REAL_RUN: dict[str, Any] = {
    "backend_config": {
        "training": {"seq-length": 2048, "use-distributed-optimizer": True},
        "actor_config": {"lr": 1e-6, "min_lr": 1e-7},
        "rl_config": {"n_samples_per_prompt": 8},
        "generate_config": {"sampling_config": {"max_tokens": 1024}},
    }
}

# The embedded default: small images and short answers so that a GRPO run on 2 CPU cores takes minutes.
# lr 2e-4 with cosine decay and a KL weight of 0.05. The warm-up (mm_rl.demo.tiny_warmup) leaves the model
# boxing the number it read in a quarter of its samples and its successor in the rest, so greedy validation
# starts near 0. Measured on 2 cores (AMD EPYC, AVX2): sampled accuracy 0.34 at step 1, 0.75 at step 10, 0.85-0.97
# from step 15; greedy validation accuracy 0.78 at step 10, 1.0 from step 20. The earlier warm-up left the boxed
# digit at chance with nothing to amplify, and whether RL found the skill within 120 steps depended on the CPU
# (step ~30 on one machine, ~90 on another, not at all on a third). At 3e-4 constant with KL 0.01 the reward rose
# as fast, then responses ran to the length limit and the reward collapsed.
_TINY_RUN: dict[str, Any] = {
    "af_output_dir": "./output/${exp_name}",
    "backend_config": {
        "training": {"seq-length": 320, "seed": 1234, "lr-decay-style": "cosine"},
        "actor_config": {"lr": 2e-4, "min_lr": 2e-5, "micro_batch_size": 8},
        "megatron_training": {
            "tokenizer_name_or_path": "${af_output_dir}/tiny_hf",
            "train_iters": 40,
            "save_interval": 20,
        },
        "data": {
            "dataset_param": {
                "basic_parameters": {"dataset_dir": "${af_output_dir}/geo3k_synthetic"},
                "preprocess_parameters": {"max_prompt_length": 256, "min_pixels": 56 * 56, "max_pixels": 224 * 224},
            }
        },
        "rl_config": {"n_samples_per_prompt": 8, "kl_loss_coef": 0.05, "val_freq": 10, "val_before_train": True},
        "generate_config": {"sampling_config": {"max_tokens": 64}, "gpu_memory_utilization": 0.3},
    },
}


# The embedded multi-turn demo (`make demo MODEL=tiny_tools`): the tiny Qwen2.5-VL calls a calculator (and looks at
# the figure through crop_image) on problems that need one step of arithmetic (mm_rl.demo.tool_warmup). Each model
# turn is at most 96 tokens (a crop call takes ~70 of the tiny tokenizer's), a trajectory at most 320 after its
# prompt; the compact template lists the tools by name. lr 4e-4 after a 10% warm-up: at 6e-4 (no warm-up) the first
# update broke the tool calls' JSON (accuracy 0.22 -> 0.0 at step 2, not back by step 30), at 3e-4 it dipped to 0.05
# and recovered; 2e-4 learnt steadily but slowly (0.22 -> 0.45 in 30 steps).
_TOOLS_RUN: dict[str, Any] = {
    "backend_config": {
        "training": {"seq-length": 576, "lr-warmup-fraction": 0.1},
        "actor_config": {"lr": 4e-4, "min_lr": 4e-5},
        "rl_config": {
            "multi_turn": {
                "enable": True,
                "tools": ["calculator", "crop_image"],
                "chat_template": "compact_tools",
                "max_turns": 4,
                "max_tokens": 320,
            }
        },
        "generate_config": {"sampling_config": {"max_tokens": 96}},
    }
}
# The embedded video demo (`make demo MODEL=tiny_video`): the format-warmed tiny Qwen2.5-VL on clips of the demo's
# figures, clips of numbers and prompts of one to three figures (mm_rl.demo.synthetic_video). Clips of 6 frames at
# 2 fps of 84 px: 3 frame pairs of 9 tokens each.
_VIDEO_RUN: dict[str, Any] = {
    "backend_config": {
        "data": {
            "dataset_param": {
                "basic_parameters": {"dataset_dir": "${af_output_dir}/video_synthetic"},
                "preprocess_parameters": {"video_min_pixels": 56 * 56, "video_max_pixels": 84 * 84, "max_frames": 8},
            }
        },
        "generate_config": {"max_images_per_prompt": 3, "max_videos_per_prompt": 1},
    }
}
# name -> (the preset it varies, the run settings it adds)
_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny_tools": ("tiny", _TOOLS_RUN),
    "tiny_video": ("tiny", _VIDEO_RUN),
}


def model_names() -> list[str]:
    return sorted([p.stem for p in MODEL_DIR.glob("*.json")] + list(_VARIANTS))


def load_preset(name: str) -> Preset:
    """The preset called ``name``; KeyError listing the known ones otherwise."""
    if name in _VARIANTS:
        base, run = _VARIANTS[name]
        preset = load_preset(base)
        return Preset(name, preset.model, _merged(preset.run, run), preset.target_gbs, preset.target_prompts, True)
    path = MODEL_DIR / f"{name}.json"
    if not path.is_file():
        raise KeyError(f"unknown model '{name}'; known models: {', '.join(model_names())}")
    model = json.loads(path.read_text())
    if name.startswith("tiny"):  # tiny (Qwen2.5-VL), tiny_qwen2_vl, tiny_qwen3_vl, tiny_qwen3_5...: the family's tiny
        return Preset(name, model, _TINY_RUN, target_gbs=32, target_prompts=8, embedded=True)
    return Preset(name, model, _REAL_RUN)


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra``'s values on top, nested dicts merged."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
