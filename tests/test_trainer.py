"""The trainer end to end on the tiny model: a whole job, checkpoints and an exact resume after SIGKILL (with two
engine replicas), TP2 and PP2 actors, validation and dynamic sampling, and what the user sees.

The bar for resume: a run killed (SIGKILL to the driver) after a checkpoint and started again with the same
command produces exactly the per-step metrics of an uninterrupted run from that checkpoint on (wall times
and rates aside), and its metrics file holds each step once.
"""

from mm_rl.platform import cpu_wheels

cpu_wheels.install()  # vLLM's Qwen2.5-VL and the processors import torchvision

import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from trainer_utils import (  # noqa: E402
    ENGINE_LINE,
    OUR_LINE,
    assert_learns,
    deterministic,
    job_for,
    run_job_in_process,
    train_cli,
)

from mm_rl.trainer.metrics import read_metrics  # noqa: E402
from mm_rl.trainer.runtime import WORKER_LOG  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tiny_base):
    return tiny_base / "job.yaml", tiny_base


def _hf_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def _tensors_named(state, key: str) -> list[torch.Tensor]:
    """Every tensor stored under ``key`` anywhere in a nested state dict (an optimizer's, whatever its wrapping)."""
    if isinstance(state, dict):
        return [v for k, v in state.items() if k == key and isinstance(v, torch.Tensor)] + [
            t for k, v in state.items() if k != key for t in _tensors_named(v, key)
        ]
    if isinstance(state, list | tuple):
        return [t for v in state for t in _tensors_named(v, key)]
    return []


def _wait_for(predicate, proc, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"train exited early ({proc.returncode}):\n{proc.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.2)


def test_a_job_trains_converts_back_and_repeats_itself_after_sigkill(assets, tmp_path):
    """One job, three runs. The uninterrupted run: hf2mg -> 4 steps over two vLLM engine replicas (validation and
    a checkpoint every 2 steps, one checkpoint kept) -> mg2hf: the stages, a line per step, the metrics, plot,
    TensorBoard, checkpoints, and an HF output that the update reached and transformers loads; each step's prompts
    split over both replicas, whose sampled tokens score the same under the actor (both received the weights).
    Then the same job through ``ascendfactory-cli train``, SIGKILLed (the driver and everything it started) after
    its step-2 checkpoint, and started again with the same command: it skips hf2mg, resumes from step 2 and
    repeats the uninterrupted run's metrics exactly (the replicas' seeds and split included), and its console holds
    only the job's own lines (the engine's and Ray's go to the worker log)."""
    job_yaml, root = assets
    steps = (
        "backend_config.megatron_training.train_iters=4",
        "backend_config.megatron_training.save_interval=2",
        "backend_config.megatron_training.max_keep_ckpts=1",
        "backend_config.rl_config.val_freq=2",
        "backend_config.generate_config.replicas=2",
    )
    result, lines = run_job_in_process(job_for(job_yaml, root, tmp_path / "straight", *steps))
    straight = _check_uninterrupted(result, lines, tmp_path / "straight", root)

    out = tmp_path / "killed"
    proc = train_cli(job_yaml, root, out, *steps, start_new_session=True)
    try:
        _wait_for(
            lambda: (
                len(read_metrics(out / "metrics.jsonl")) >= 3 and (out / "ckpt" / "iter_0000002" / "complete").is_file()
            ),
            proc,
            600,
        )
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not (out / "ckpt_converted_mg2hf").exists()

    again = train_cli(job_yaml, root, out, *steps)
    log, _ = again.communicate(timeout=900)
    assert again.returncode == 0, log[-4000:]
    assert "already holds this conversion" in log and "resumed from step 2" in log
    assert "taking it over" in log  # the killed run's directory lock, left behind, is taken over with a notice
    resumed = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed, strict=True):
        assert deterministic(a) == deterministic(b), a["step"]
    assert json.loads((out / "ckpt" / "iter_0000004" / "complete").read_text())["step"] == 4
    _check_console(log, out)


def _check_uninterrupted(result, lines: list[str], out: Path, root: Path) -> list[dict]:
    text = "\n".join(lines)
    assert "[1/3] hf2mg" in text and "[2/3] GRPO" in text and "[3/3] mg2hf" in text
    assert any("rollout: 2 x vllm engine ready" in line for line in lines)
    assert sum(line.startswith("step ") for line in lines) == 4
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in (
        "reward/score",
        "reward/accuracy",
        "reward/format",
        "response_length/mean",
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "timing/rollout",
        "timing/update",
        "timing/sync",
        "timing/step",
        "throughput/tok_per_s",
    ):
        assert all(r.get(key) is not None and math.isfinite(r[key]) for r in records), key
    for record in records:
        assert record["rollout/replicas"] == 2 and record["rollout/replica_prompts_min"] >= 1  # split over both
        assert record["rollout/logprob_gap_max"] < 1e-3  # max over both replicas' samples: both got the weights
    assert [r["step"] for r in records if "val/reward/score" in r] == [2, 4]
    assert (out / "metrics.png").stat().st_size > 0 and any((out / "tensorboard").iterdir())
    ckpt = out / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == ["iter_0000004"]  # keep 1
    trained, start = _hf_weights(result.hf_dir), _hf_weights(root / "tiny_hf")
    assert trained.keys() == start.keys()
    assert any(not torch.equal(trained[k], start[k]) for k in trained)  # the update reached the HF output
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_pretrained(result.hf_dir)  # loads in transformers
    return records


def _check_console(console: str, out: Path) -> None:
    """Every console line of a ``train`` run is one of the job's; the engine's lines are in the worker log."""
    lines = [line for line in console.splitlines() if line.strip()]
    strangers = [line for line in lines if not OUR_LINE.match(line)]
    assert strangers == [], console
    assert sum(line.startswith("step ") for line in lines) == 2  # steps 3 and 4 after the resume
    log = out.resolve() / WORKER_LOG
    assert f"worker log:       {out / WORKER_LOG}" in console
    text = log.read_text()
    assert ENGINE_LINE in text and "Ray worker started" in text
    assert ENGINE_LINE not in console


# LoRA on the LLM's linears: its usual 10x the full-weight lr (the tiny's default 2e-4)
LORA = (
    "backend_config.actor_config.lora.rank=16",
    "backend_config.actor_config.lora.alpha=32",
    "backend_config.actor_config.lr=2e-3",
    "backend_config.actor_config.min_lr=2e-4",
)


# TP2's whole job is the other families' (tests/test_family_jobs.py: the Qwen3-VL-MoE's 2 steps, dense attention
# and split experts under sequence parallelism, engine gap < 1e-3; the Qwen3.5 learning run); Qwen2.5-VL's TP2 sync
# and model are tests/test_weight_sync.py's and tests/test_model_parity.py's
@pytest.mark.parametrize(
    "layout, rank_dirs",
    [
        (
            (
                "backend_config.actor_config.pipeline_model_parallel_size=2",
                "backend_config.model.text_decoder.pipeline_num_layers=[2,2]",
                "backend_config.model.image_encoder.vision_encoder.pipeline_num_layers=[2,0]",
                *LORA,
                "backend_config.actor_config.lora.vision=true",
            ),
            2,
        ),
        (
            (
                "backend_config.training.context-parallel-size=2",
                "backend_config.training.context-parallel-algo=ulysses_cp_algo",
            ),
            1,
        ),  # CP ranks hold the same weights
    ],
    ids=["pp2", "cp2"],
)
def test_model_parallel_actor_trains(assets, tmp_path, layout, rank_dirs):
    """Two ranks (PP2 or CP2) through full steps, with dynamic sampling drawing extra batches. PP2 trains LoRA
    adapters, the ViT's too: each stage's, synced merged (the second sync only the adapted linears), merged by mg2hf
    and written as a PEFT adapter directory."""
    job_yaml, root = assets
    out = tmp_path / "run"
    job = job_for(
        job_yaml,
        root,
        out,
        "env.NPROC_PER_NODE=2",
        "backend_config.megatron_training.train_iters=2",
        "backend_config.rl_config.dynamic_sampling.enable=true",
        "backend_config.rl_config.dynamic_sampling.max_num_gen_batches=2",
        *layout,
    )
    result, _ = run_job_in_process(job)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rollout/logprob_gap_max"] < 1e-3 and math.isfinite(r["actor/grad_norm"]) for r in records)
    assert all(1 <= r["dynamic_sampling/gen_batches"] <= 2 for r in records)
    ranks = sorted(p.name for p in (out / "ckpt" / "iter_0000002").iterdir() if p.name.startswith("mp_rank"))
    assert len(ranks) == rank_dirs
    assert (result.hf_dir / "config.json").is_file()
    assert (result.hf_dir / "lora_adapter" / "adapter_model.safetensors").is_file() == (LORA[0] in layout)


def test_a_data_problem_stops_the_job_before_any_role_starts(assets, tmp_path):
    """The prompts load while Ray starts (``build_trainer``); a data set no row of which fits still ends the job
    with check's error before any role's process starts, and the local Ray it started is stopped."""
    import ray

    from mm_rl.config.loader import ConfigError
    from mm_rl.job.run import run_job

    job_yaml, root = assets
    key = "backend_config.data.dataset_param.preprocess_parameters.max_prompt_length"
    lines: list[str] = []
    with pytest.raises(ConfigError) as err:
        run_job(job_for(job_yaml, root, tmp_path / "run", f"{key}=10"), report=lines.append)
    (problem,) = err.value.violations
    assert problem.key == key and "longer than max_prompt_length=10" in problem.rule
    assert any(line.startswith("ray: ") for line in lines)  # Ray started beside the prompts
    assert not any(line.startswith(("actor: ", "reference: ", "rollout: ")) for line in lines), lines
    assert not ray.is_initialized()


LEARNING = (
    "backend_config.rl_config.rollout_batch_size=8",
    "backend_config.megatron_training.global_batch_size=32",
    "backend_config.generate_config.sampling_config.max_tokens=64",
    "backend_config.rl_config.val_before_train=true",
)


def test_the_embedded_default_learns(assets, tmp_path):
    """The tiny default as ``config`` writes it (its warm-up, demo data, GRPO settings, validation before
    training): the warm-up leaves the greedy answer off by one and a quarter of the sampled answers right; over
    the 40 steps the sampled reward rises and greedy validation goes from few answers right to most."""
    job_yaml, root = assets
    out = tmp_path / "run"
    job = job_for(job_yaml, root, out, *LEARNING)
    assert job.backend_config.megatron_training.train_iters == 40
    run_job_in_process(job)
    assert_learns(read_metrics(out / "metrics.jsonl"), "tiny, on policy")


def test_one_step_off_policy_lora_learns_overlaps_the_rollout_and_resumes_exactly(assets, tmp_path):
    """The default with the one-step-off-policy pipeline (samples one version behind, importance-sampling
    correction on), training LoRA adapters (the reference: the actor without them), passes the same learning bar.
    Each step's batch generates while the previous step trains: from step 2 on the steps wait for their batches
    less than the batches took to generate (the rest ran beside the updates), and the samples are one version
    behind. The checkpoints hold the adapters and name their base; a run resumed from the step-38 checkpoint
    (which keeps step 39's batch, generated from step 37's weights) repeats steps 39 and 40 of the uninterrupted
    run exactly. mg2hf merges the adapters (the LLM changed, the ViT not) and writes their PEFT directory."""
    import shutil

    job_yaml, root = assets
    steps = (
        *LEARNING,
        *LORA,
        "backend_config.rl_config.one_step_off_policy=true",
        "backend_config.megatron_training.save_interval=38",
        "backend_config.megatron_training.max_keep_ckpts=2",
    )
    result, _ = run_job_in_process(job_for(job_yaml, root, tmp_path / "straight", *steps))
    records = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert_learns(records, "tiny, one step off policy, LoRA")
    assert records[-1]["actor/kl_loss"] > 0  # the reference pass: the base model, which the adapters moved from
    saved = torch.load(
        tmp_path / "straight" / "ckpt" / "iter_0000040" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False
    )
    assert saved["model"] and all(k.endswith((".lora_a", ".lora_b")) for k in saved["model"])
    moments = _tensors_named(saved["optimizer"], "exp_avg")
    assert sum(t.numel() for t in moments) == sum(t.numel() for t in saved["model"].values())  # Adam: adapters only
    assert (Path(saved["lora"]["base"]) / "mp_rank_00" / "model_optim_rng.pt").is_file()
    trained, initial = _hf_weights(result.hf_dir), _hf_weights(root / "tiny_hf")
    changed = {name for name, tensor in trained.items() if not torch.equal(tensor, initial[name])}
    assert any(".layers." in n for n in changed) and not any(
        n.startswith(("visual.", "model.visual.")) for n in changed
    )
    assert (result.hf_dir / "lora_adapter" / "adapter_config.json").is_file()
    straight = [r for r in records if r["step"] > 0]
    assert [r["rollout/staleness_max"] for r in straight] == [0.0] + [1.0] * 39
    later = straight[1:]
    waited, generating = sum(r["timing/rollout"] for r in later), sum(r["rollout/wall_s"] for r in later)
    print(f"one-step-off-policy: steps 2-40 waited {waited:.2f} s for batches that took {generating:.2f} s")
    assert waited < 0.5 * generating
    assert all(r["rollout/logprob_gap_max"] > 1e-3 for r in later[:3])  # one version behind (in sync: <1e-6)

    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight" / "ckpt" / "iter_0000038", out / "ckpt" / "iter_0000038")
    run_job_in_process(
        job_for(
            job_yaml, root, out, *steps, f"backend_config.megatron_training.resume_mode={out / 'ckpt' / 'iter_0000038'}"
        )
    )
    resumed = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in resumed] == [39, 40]
    for a, b in zip(straight[38:], resumed, strict=True):
        assert deterministic(a) == deterministic(b), a["step"]
