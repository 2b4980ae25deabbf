"""Device smoke suite: what only a GPU or an NPU can show. Skipped, with the reason, on a machine without one.

Run it on one accelerator (about 5 minutes on one GPU for the Qwen2.5-VL cases)::

    .venv/bin/python -m pytest tests/device -v -s

Each case: hf2mg -> 3 colocated bf16 GRPO steps (the engine wakes and sleeps every step, the actor offloads its
parameters, gradients and Adam state while it generates) -> the checks:

* the engine-vs-actor log-prob gap of the sampled tokens (bf16 engine and actor): mean < 5e-2;
* the actor's device memory really drops when it offloads (the allocator's count, not the switches' report);
* all three steps complete (a wake / sleep cycle that broke would fail the second);
* one line of throughput per case;
* on 2 or more devices, two colocated engine replicas (one beside each DP rank) share every step's prompts, and
  one colocated TP2 engine spans both ranks' devices;
* the weight sync's route: an engine worker on the sender's device maps the sender's buffers (IPC), the others
  take the broadcast.

What needs no Ray or vLLM (transfers, RNG state, a bucket read through IPC, the sync group, the attention kernel, a
megatron rank in bf16, the MoE step, a timed update at real widths) is the device check, ``test_bare.py`` here and
``bench/device_check.sh`` on a bare image.

The models: the embedded tiny model, one with Qwen2.5-VL-3B widths (hidden 2048, 16 heads, 2 KV groups,
ViT 1280 wide) and 2 LLM / 2 ViT layers, and the tiny Qwen3-VL and Qwen3-VL-MoE (4 experts, top 2; on 2 devices
also at TP2, where the LLM runs sequence parallelism and every expert is split over both ranks), all random (no
warm-up: only numbers and memory are checked here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mm_rl.config.schema import JobConfig
from mm_rl.platform.device import device_count, device_kind

pytestmark = pytest.mark.skipif(device_kind() == "cpu", reason="needs a CUDA GPU or an Ascend NPU (torch sees none)")

GAP_MEAN_BF16 = 5e-2
STEPS = 3
QWEN2_5_VL_3B_WIDTHS = {
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "intermediate_size": 11008,
    "num_hidden_layers": 2,
    "mrope_section": [16, 24, 24],
    "vision_config": {
        "hidden_size": 1280,
        "num_heads": 16,
        "intermediate_size": 3420,
        "depth": 2,
        "fullatt_block_indexes": [1],
        "out_hidden_size": 2048,
    },
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mm_rl.demo.synthetic import DEMO_TEMPLATES, write_synthetic_geo3k

    return write_synthetic_geo3k(tmp_path_factory.mktemp("data"), seed=0, templates=DEMO_TEMPLATES)


def _job(out: Path, hf_dir: Path, data_dir: Path, devices: int = 1, extra: tuple[str, ...] = ()) -> JobConfig:
    """The tiny preset's job on ``devices`` devices of this machine, pointed at ``hf_dir`` with that checkpoint's
    model.json (the keys that follow the model, such as the converters' layer splits, follow it here too)."""
    import dataclasses

    from omegaconf import OmegaConf

    from mm_rl.config.loader import to_job
    from mm_rl.convert import model_config_from_hf
    from mm_rl.job.create import ClusterSpec, create_job

    actor = "backend_config.actor_config"
    node, _, _ = create_job(
        "tiny",
        "device_smoke",
        ClusterSpec(1, devices, device_kind()),
        overrides=[
            f"af_output_dir={out}",
            f"backend_config.megatron_training.tokenizer_name_or_path={hf_dir}",
            f"backend_config.data.dataset_param.basic_parameters.dataset_dir={data_dir}",
            f"backend_config.megatron_training.train_iters={STEPS}",
            f"backend_config.megatron_training.save_interval={STEPS}",
            "backend_config.rl_config.val_freq=0",
            "backend_config.rl_config.val_before_train=false",
            "backend_config.training.bf16=true",
            "backend_config.generate_config.colocate=true",
            "backend_config.generate_config.gpu_memory_utilization=0.3",
            f"{actor}.offload_train_param=true",
            f"{actor}.offload_train_grad=true",
            f"{actor}.offload_train_optimizer=true",
            *extra,
        ],
    )
    model = dataclasses.asdict(model_config_from_hf(hf_dir / "config.json"))
    OmegaConf.update(node, "backend_config.model", model, merge=False)
    return to_job(node)


def _run(job: JobConfig) -> tuple[list[dict[str, float]], list[tuple[int, int, int]], Any]:
    """hf2mg and the GRPO steps with probe ranks (in place of the job's TrainingWorker class); the metrics per
    step, rank 0's device memory per offload and the weight sync's device route."""
    import ray
    from probes import ProbeWorker  # here, not at the top: it needs Ray, which a bare device image lacks

    from mm_rl.job.run import convert_in
    from mm_rl.trainer.grpo import build_trainer
    from mm_rl.workers import training

    mm_dir = convert_in(job, print)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training, "TrainingWorker", ProbeWorker)  # the actor's rank class, looked up at start-up
        trainer = build_trainer(job, mm_dir, print)
    graceful = False
    try:
        history = trainer.fit()
        memory = trainer.roles.actor.run(ProbeWorker.device_memory_log)[0]
        route = trainer.roles.schedule.route
        graceful = True
    finally:
        trainer.close(graceful)
        ray.shutdown()
    return history, memory, route


CHECKPOINTS: dict[str, dict[str, Any]] = {  # name: the tiny builder's keywords
    "tiny": {},
    "qwen2_5_vl_3b": QWEN2_5_VL_3B_WIDTHS,
    "tiny_qwen3_vl": {"family": "qwen3_vl"},
    "tiny_qwen3_vl_moe": {"family": "qwen3_vl", "num_experts": 4},
}


@pytest.mark.parametrize("widths", sorted(CHECKPOINTS))
def test_colocated_bf16_grpo_steps(widths: str, data_dir: Path, tmp_path: Path) -> None:
    from mm_rl.demo.tiny import build_tiny_checkpoint

    hf_dir = build_tiny_checkpoint(tmp_path / "hf", seed=0, **CHECKPOINTS[widths])
    history, memory, route = _run(_job(tmp_path / "out", hf_dir, data_dir))

    assert len(history) == STEPS  # every step after the first went through sleep -> wake again
    assert route.stages[0].ranks == ((None,),)  # the engine mapped the sender's buffers (IPC), no group
    gaps = [step["rollout/logprob_gap_mean"] for step in history]
    assert max(gaps) < GAP_MEAN_BF16, gaps
    parameter_offloads = [(before, after, freed) for before, after, freed in memory if freed]
    assert parameter_offloads
    for before, after, freed in parameter_offloads:  # the allocator really gave the bytes up
        assert before - after >= 0.9 * freed, (before, after, freed)
    rate = sum(step["throughput/tok_per_s"] for step in history[1:]) / (STEPS - 1)
    print(
        f"device smoke {widths} on {device_kind()}: {rate:,.0f} tok/s per step (steps 2-{STEPS}), "
        f"gap mean {max(gaps):.2e}, offloaded {history[-1]['memory/offloaded_gb']:.2f} GB, "
        f"allocated {max(b for b, _, _ in memory) / 2**30:.2f} -> {min(a for _, a, _ in memory) / 2**30:.2f} GiB"
    )


@pytest.mark.skipif(device_count() < 2, reason="needs 2 or more devices of one kind")
def test_two_colocated_engine_replicas_share_the_rollout(data_dir: Path, tmp_path: Path) -> None:
    """Two devices, DP2, an engine replica beside each rank (the default): every step's prompts are split over
    both replicas and both generate from the synced weights."""
    from mm_rl.demo.tiny import build_tiny_checkpoint

    hf_dir = build_tiny_checkpoint(tmp_path / "hf", seed=0)
    history, _, route = _run(_job(tmp_path / "out", hf_dir, data_dir, devices=2))
    assert len(history) == STEPS
    # replica 0 maps rank 0's buffers in place, replica 1 (on the other device) takes the broadcast
    assert route.stages[0].ranks == ((None,), (1,))
    for step in history:
        assert step["rollout/replicas"] == 2 and step["rollout/replica_prompts_min"] >= 1
        assert step["rollout/logprob_gap_mean"] < GAP_MEAN_BF16
    print(
        f"device smoke 2 replicas on {device_kind()}: rollout {history[-1]['throughput/rollout_tok_per_s']:,.0f} "
        f"tok/s, slowest / fastest replica {history[-1]['rollout/replica_wall_spread']:.2f}x"
    )


@pytest.mark.skipif(device_count() < 2, reason="needs 2 or more devices of one kind")
def test_a_colocated_tp2_engine_spans_the_devices_of_two_ranks(data_dir: Path, tmp_path: Path) -> None:
    """Two devices, engine TP 2 colocated: one replica whose two vLLM workers sit beside ranks 0 and 1; the worker on
    the sender's device maps its buffers, the other takes the broadcast; the engine generates from synced weights."""
    from mm_rl.demo.tiny import build_tiny_checkpoint

    hf_dir = build_tiny_checkpoint(tmp_path / "hf", seed=0)
    extra = ("backend_config.generate_config.infer_tensor_parallel_size=2",)
    history, _, route = _run(_job(tmp_path / "out", hf_dir, data_dir, devices=2, extra=extra))
    assert len(history) == STEPS and route.stages[0].ranks == ((None, 1),)
    assert all(step["rollout/replicas"] == 1 and step["rollout/logprob_gap_mean"] < GAP_MEAN_BF16 for step in history)


@pytest.mark.skipif(device_count() < 2, reason="needs 2 or more devices of one kind")
def test_moe_trains_at_tp2_under_sequence_parallelism(data_dir: Path, tmp_path: Path) -> None:
    """Two devices, the tiny Qwen3-VL-MoE at TP2: each rank routes its half of the tokens (sequence parallelism,
    which megatron's MoE layer needs to train under TP) to experts split over both ranks; bf16 steps finish,
    every expert is used and the engine generates from the synced weights."""
    from mm_rl.demo.tiny import build_tiny_checkpoint

    hf_dir = build_tiny_checkpoint(tmp_path / "hf", seed=0, **CHECKPOINTS["tiny_qwen3_vl_moe"])
    extra = ("backend_config.actor_config.tensor_model_parallel_size=2",)
    history, _, _ = _run(_job(tmp_path / "out", hf_dir, data_dir, devices=2, extra=extra))
    assert len(history) == STEPS
    for step in history:
        assert step["rollout/logprob_gap_mean"] < GAP_MEAN_BF16 and step["actor/moe/load_min"] > 0
    print(
        f"device smoke MoE TP2 on {device_kind()}: gap mean {max(s['rollout/logprob_gap_mean'] for s in history):.2e}"
        f", expert load max {history[-1]['actor/moe/load_max']:.2f}"
    )
