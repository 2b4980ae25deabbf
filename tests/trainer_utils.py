"""Shared set-up of the trainer tests: one tiny model + synthetic data set per session, short job yamls."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import budget

from mm_rl.config.loader import load_job
from mm_rl.config.schema import JobConfig

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "mm_rl_cli.main"]
CONFIG_CLI = str(Path(sys.executable).parent / "ascendfactory-cli")

ASSET_KEYS = (
    "af_output_dir",
    "backend_config.megatron_training.tokenizer_name_or_path",
    "backend_config.data.dataset_param.basic_parameters.dataset_dir",
)
# A short run: 4 prompts x 8 samples, GBS 16 (two optimizer steps per GRPO step), 24-token answers.
SHORT = (
    "backend_config.rl_config.rollout_batch_size=4",
    "backend_config.megatron_training.global_batch_size=16",
    "backend_config.generate_config.sampling_config.max_tokens=24",
    "backend_config.actor_config.lr=2e-4",
)


def configure(preset: str, job: Path, *overrides: str) -> Path:
    """``ascendfactory-cli config --af_model_name <preset>`` writing ``job`` (outputs beside it unless an override
    moves them): the tiny model and its warm-up come from the cache, built there the first time on a machine.
    That first build (~3 min a model) is the machine's, not the calling test file's (``budget.cache_build``)."""
    with budget.cache_build():
        subprocess.run(
            [
                CONFIG_CLI,
                "config",
                "--af_model_name",
                preset,
                "--exp_name",
                f"{preset}_test",
                "--output_file_path",
                str(job),
                f"af_output_dir={job.parent}",
                *overrides,
            ],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
            timeout=2400,  # the tiny Qwen3.5's warm-up: ~17 min on 2 cores (transformers' torch Gated DeltaNet)
        )
    return job


def write_job(base: Path, folder: Path) -> Path:
    """A job yaml in ``folder`` (outputs in ``folder/out``) on the session's tiny checkpoint and data."""
    from omegaconf import OmegaConf

    node = OmegaConf.load(base / "job.yaml")
    for key, value in zip(
        ASSET_KEYS, (str(folder / "out"), str(base / "tiny_hf"), str(base / "geo3k_synthetic")), strict=True
    ):
        OmegaConf.update(node, key, value)
    path = folder / "job.yaml"
    OmegaConf.save(node, path)
    return path


def overrides(assets: Path, out: Path, *extra: str) -> list[str]:
    """Point a run at its own output directory while sharing the assets (checkpoint, data)."""
    values = (str(out), str(assets / "tiny_hf"), str(assets / "geo3k_synthetic"))
    return [f"{key}={value}" for key, value in zip(ASSET_KEYS, values, strict=True)] + [*SHORT, *extra]


def job_for(job_yaml: Path, assets: Path, out: Path, *extra: str) -> JobConfig:
    return load_job(job_yaml, overrides(assets, out, *extra))


def run_job_in_process(job: JobConfig) -> tuple[Any, list[str]]:
    """``run_job`` in this process (Ray shut down after it): its result and the lines it reported."""
    import ray

    from mm_rl.job.run import run_job

    lines: list[str] = []
    try:
        result = run_job(job, report=lines.append)
    finally:
        ray.shutdown()
    return result, lines


def train_cli(job_yaml: Path, assets: Path, out: Path, *extra: str, **popen: Any) -> subprocess.Popen[str]:
    """``ascendfactory-cli train`` in a child process (its own Ray instance)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [*CLI, "train", str(job_yaml), *overrides(assets, out, *extra)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


# Every line the console of ``train`` may show: the stage, Ray, role, step, validation, checkpoint and summary
# lines, notices and the user warnings of the job itself.
OUR_LINE = re.compile(
    r"\[[123]/3\] |      done in |ray: |actor: |reference: |rollout: |notice: |warning: "
    r"|waiting for Ray |step +\d+/\d+ \||validation |checkpoint: |resumed from |done in "
    r"|  [A-Za-z ]+: "
)
ENGINE_LINE = "rollout engine (vllm) started in pid"

DETERMINISTIC_PREFIXES = (
    "reward/",
    "actor/",
    "advantages/",
    "response_length/",
    "batch/",
    "val/reward",
    "rollout/logprob_gap",
)


def deterministic(record: dict[str, Any]) -> dict[str, Any]:
    """The metrics that must repeat exactly (everything but wall times and rates)."""
    return {k: v for k, v in record.items() if k.startswith(DETERMINISTIC_PREFIXES)}


# An embedded default's learning bar: the sampled reward's rise from the first 5 steps to the last 5, greedy validation
# accuracy at the end and its rise. The warm-up's weights, and so where RL starts, depend on the CPU's rounding.
# Measured (tiny, on policy): AMD EPYC (AVX2) reward 0.47 -> 0.92, greedy val 0.14 .. 1.0; Intel Xeon (AVX-512)
# 0.55 -> 0.92, 0.33 .. 1.0. The tiny Qwen3.5 (Gated DeltaNet and attention in turn, a bf16 engine) learns less
# far, and the suite runs its first 10 steps only (~11 s a step on 2 cores): Intel Xeon, TP1, 40 steps: reward 0.40
# -> 0.61, greedy 0.22, 0.70, 0.67, 0.67, 0.67; its first 10 steps at TP1: 0.40 -> 0.48, greedy 0.22 -> 0.70; at TP2
# 0.40 -> 0.47, 0.22 -> 0.67. Greedy validation is the sharp check there; the sampled reward only has to rise.
LEARNING_BAR = {"reward_gain": 0.25, "val_end": 0.7, "val_gain": 0.4}
QWEN3_5_LEARNING_BAR = {"reward_gain": 0.03, "val_end": 0.6, "val_gain": 0.35}


def assert_learns(
    records: list[dict[str, Any]], label: str, steps: int = 40, bar: dict[str, float] = LEARNING_BAR
) -> None:
    """The learning bar of an embedded default's first ``steps`` steps (validation before training and every 10
    steps): the sampled reward of the last 5 steps clearly above that of the first 5, and greedy validation
    accuracy from few answers right (the warm-up's off-by-one habit) to most."""
    rewards = [r["reward/score"] for r in records if r["step"] > 0]
    val = [r["val/reward/accuracy"] for r in records if "val/reward/accuracy" in r]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(
        f"\n{label}: reward of the first 5 steps {first:.3f}, of the last 5 {last:.3f}; greedy val accuracy at "
        f"steps 0, 10, .., {steps}: {[round(v, 3) for v in val]}"
    )
    assert len(rewards) == steps and first <= 0.6 and last >= first + bar["reward_gain"]
    assert len(val) == steps // 10 + 1 and val[0] <= 0.4
    assert val[-1] >= bar["val_end"] and val[-1] >= val[0] + bar["val_gain"]
