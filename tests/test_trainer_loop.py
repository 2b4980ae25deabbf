"""The GRPO loop's step logic against a fake of the Roles interface: no Ray, no model, no engine.

What is driven here: dynamic sampling (more batches until enough groups vary, seeds per batch), validation (the
sync / sleep around it, val metrics), the non-finite streak (skips counted, a good step resets, the limit stops
the run), and the resume bookkeeping (sampler, KL controller and streak restored, the metrics file cut back, a
checkpoint of another layout refused at the resume); the step's images handed to the ranks once, and the bytes the
driver ships per step.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mm_rl.config.loader import ConfigError, load_job
from mm_rl.job.run import resume
from mm_rl.rewards.worker import RewardResult
from mm_rl.rollout.base import BatchTiming, RolloutOutput, RolloutOutputs, RolloutRequest, RolloutSample
from mm_rl.sync.driver import SyncReport
from mm_rl.trainer.generations import GENERATIONS_FILE, pick
from mm_rl.trainer.grpo import GRPOTrainer, TrainingStopped, sampling_seed
from mm_rl.trainer.metrics import METRICS_FILE, read_metrics
from mm_rl.trainer.roles import RolloutReady

PROMPT = [5, 6, 7]
VISION = 99  # a "vision token" id the fake tokenizer knows


class FakePrompts:
    """Consecutive batches of ``batch`` indices; text-only rows."""

    def __init__(self, batch: int) -> None:
        self.batch, self.position = batch, 0
        self.pad_id, self.vision_token_ids = 0, frozenset({VISION})
        self.cached: dict[int, SimpleNamespace] = {}

    def next_indices(self) -> list[int]:
        start, self.position = self.position, self.position + self.batch
        return list(range(start, start + self.batch))

    def val_indices(self) -> list[int]:
        return [1000, 1001]

    def requests(self, indices, split="train"):
        if split == "train":
            self.cached.update(
                {
                    i: SimpleNamespace(
                        pixel_values=torch.zeros(0, 8),
                        image_grid_thw=torch.zeros(0, 3, dtype=torch.long),
                        mrope_time_steps=None,
                    )
                    for i in indices
                }
            )
        return [RolloutRequest(list(PROMPT), uid=i) for i in indices]

    def retain(self, indices):
        self.cached = {i: item for i, item in self.cached.items() if i in set(indices)}

    def prefetch(self):
        """Rows are made on the spot: nothing to process ahead."""

    def close(self):
        pass

    def ground_truth(self, index, split="train"):
        return "1"

    def prompt_text(self, index, split="train"):
        return f"{split} question {index}"

    def row_id(self, index, split="train"):
        return index + 10

    def video_frames(self, index, split="train"):
        return []

    def decode(self, responses):
        return [" ".join(map(str, r)) for r in responses]

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class FakeRoles:
    """Scripted rollouts and updates; records every call.

    ``rewards(seed, prompt_uid, sample)`` gives each response's reward (the response encodes it, the scorer reads
    it back); ``skip`` lists the update calls (0-based) that report a non-finite step."""

    def __init__(self, n: int, rewards, skip=()) -> None:
        self.n, self.rewards, self.skip = n, rewards, set(skip)
        self.has_reference = True
        self.calls: list[tuple] = []
        self.scored: dict[str, int] = {}  # samples scored per role by the log-prob passes
        self.passes: list[list[int]] = []  # rows of each micro-batch of each log-prob pass
        self.updates = 0
        self.lr_schedule: list[int] = []  # where each step left the actor's LR schedule

    def data_parallel_size(self, role):
        return 1

    def before_rollout(self):
        self.calls.append(("before_rollout",))
        return RolloutReady(SyncReport())

    def before_training(self):
        self.calls.append(("before_training",))

    def start_generate(self, requests, sampling, seed):
        self.calls.append(("generate", seed, len(requests)))
        outputs = []
        for request in requests:
            samples = [
                RolloutSample([int(100 * self.rewards(seed, request.uid, k)), 2], torch.zeros(2), "stop")
                for k in range(sampling.n)
            ]
            outputs.append(RolloutOutput(request.prompt_ids, samples, BatchTiming(0.1, 2 * sampling.n), request.uid))
        return SimpleNamespace(result=lambda: RolloutOutputs(outputs))

    def score(self, responses, truths):
        scores = [int(text.split()[0]) / 100 for text in responses]
        return RewardResult(scores, {"accuracy": scores}, 0)

    def send_images(self, images):
        self.calls.append(("send_images", sorted(images)))

    def log_probs(self, role, shards, temperature):
        self.calls.append(("log_probs", role))
        self.passes.append([len(b["input_ids"]) for shard in shards for b in shard])
        self.scored[role] = self.scored.get(role, 0) + sum(len(b["input_ids"]) for shard in shards for b in shard)
        return [[torch.full(b["input_ids"].shape, -0.5) for b in shard] for shard in shards]

    def train_mini_batch(self, shards, loss, denominator):
        """The metrics, and -0.25 as the update forward's log-probs where the shard came without old ones (the
        old log-prob pass gives -0.5)."""
        skipped = float(self.updates in self.skip)
        self.updates += 1
        own = [
            None if "old_log_probs" in shard[0] else [torch.full(b["input_ids"].shape, -0.25) for b in shard]
            for shard in shards
        ]
        return {"loss": 0.1, "pg_loss": 0.1, "kl_loss": 0.01, "grad_norm": 1.0, "lr": 1e-3, "skipped": skipped}, own

    def schedule_lr_at(self, updates):
        self.lr_schedule.append(updates)

    def save(self, staging: Path):
        (staging / "mp_rank_00").mkdir()
        torch.save({"model": {}}, staging / "mp_rank_00" / "model_optim_rng.pt")

    def load(self, save_dir, step, load_optim, load_rng):
        self.calls.append(("load", Path(save_dir), step))

    def close(self, graceful=True):
        self.calls.append(("close", graceful))


def _job(tmp_path, *overrides):
    return load_job(
        None,
        [
            f"--af_output_dir={tmp_path}",
            "--backend_config.rl_config.rollout_batch_size=2",
            "--backend_config.rl_config.n_samples_per_prompt=2",
            "--backend_config.megatron_training.global_batch_size=4",
            "--backend_config.actor_config.micro_batch_size=2",
            *overrides,
        ],
    )


def _trainer(job, roles, lines=None):
    return GRPOTrainer(
        job,
        roles,
        FakePrompts(job.backend_config.rl_config.rollout_batch_size),
        report=(lines.append if lines is not None else lambda line: None),
    )


def test_dynamic_sampling_draws_batches_until_enough_groups_vary(tmp_path):
    """Batch 0: one of two groups varies; batch 1: the other prompt pair both vary -> two batches, seeded per
    batch, and only varying groups are trained on."""
    job = _job(
        tmp_path,
        "--backend_config.rl_config.dynamic_sampling.enable=true",
        "--backend_config.rl_config.dynamic_sampling.max_num_gen_batches=4",
    )
    seed = int(job.backend_config.training.seed)
    first = sampling_seed(seed, 1, 0)
    roles = FakeRoles(2, lambda s, uid, k: 0.5 if (s == first and uid == 0) else float(k))
    metrics = _trainer(job, roles).train_step(1)
    seeds = [call[1] for call in roles.calls if call[0] == "generate"]
    assert seeds == [sampling_seed(seed, 1, 0), sampling_seed(seed, 1, 1)]
    assert metrics["dynamic_sampling/gen_batches"] == 2.0
    assert metrics["dynamic_sampling/groups_varying"] == 2.0
    assert metrics["reward/std"] > 0 and metrics["batch/groups"] == 2.0
    phases = [c[0] for c in roles.calls if c[0] != "generate"]
    assert phases == ["before_rollout", "before_training", "send_images", "log_probs"]  # reference only: on-policy
    assert ("send_images", [1, 2]) in roles.calls  # the images of the trained groups' prompts, each once
    assert [c[1] for c in roles.calls if c[0] == "log_probs"] == ["reference"]


class BoundedRoles(FakeRoles):
    """The rollout bounds drop the second prompt of every other step (odd steps keep both)."""

    def start_generate(self, requests, sampling, seed):
        outputs = super().start_generate(requests, sampling, seed).result()
        if sum(call[0] == "generate" for call in self.calls) % 2 == 0:
            outputs[1] = RolloutOutput(
                outputs[1].prompt_ids, [], outputs[1].timing, outputs[1].uid, skipped="prompt too long"
            )
        return SimpleNamespace(result=lambda: outputs)


def test_the_lr_schedule_stays_on_plan_when_groups_are_dropped(tmp_path):
    """Every second step trains on one of its two groups (the bounds dropped the other): one optimizer step
    runs there instead of two, yet each step leaves the LR schedule at its planned count and the last step at the
    schedule's end (the total the optimizer was given), where the LR is min_lr (test_trainer_worker.py)."""
    job = _job(
        tmp_path,
        "--backend_config.megatron_training.global_batch_size=2",
        "--backend_config.megatron_training.train_iters=4",
    )
    rl = job.backend_config.rl_config
    roles = BoundedRoles(2, lambda s, uid, k: float(k))
    trainer = _trainer(job, roles)
    for step in range(1, 5):
        trainer.train_step(step)
    assert rl.updates_per_step == 2 and roles.updates == 2 + 1 + 2 + 1
    assert roles.lr_schedule == [2, 4, 6, 8]
    assert roles.lr_schedule[-1] == job.backend_config.megatron_training.train_iters * rl.updates_per_step


def test_validation_syncs_generates_greedy_and_reports_val_metrics(tmp_path):
    job = _job(tmp_path, "--backend_config.rl_config.val_freq=1")
    roles = FakeRoles(2, lambda s, uid, k: 1.0 if uid == 1000 else 0.0)
    trainer = _trainer(job, roles)
    metrics = trainer.validate(3)
    assert roles.calls[0] == ("before_rollout",) and roles.calls[-1] == ("before_training",)
    assert roles.calls[1] == ("generate", sampling_seed(trainer.seed, 3, -1), 2)
    assert metrics["val/reward/score"] == pytest.approx(0.5)
    assert "timing/validation" in metrics
    lines: list[str] = []
    job = _job(tmp_path, "--backend_config.rl_config.val_freq=2", "--backend_config.megatron_training.train_iters=4")
    _trainer(job, FakeRoles(2, lambda s, uid, k: float(k)), lines).fit()
    shown = [line.split(":")[0] for line in lines if line.startswith("validation")]
    assert shown == ["validation at step 2", "validation at step 4"]  # a console line per validation, as per step
    assert lines.index(next(line for line in lines if line.startswith("validation at step 2"))) == 2  # after step 2


def test_non_finite_steps_are_counted_reset_and_stop_the_run(tmp_path):
    """max_consecutive_nonfinite 2: skip, good (resets), skip, skip -> stop with advice."""
    job = _job(
        tmp_path,
        "--backend_config.rl_config.max_consecutive_nonfinite=2",
        "--backend_config.megatron_training.train_iters=10",
        "--backend_config.megatron_training.save_interval=100",
    )
    lines: list[str] = []
    trainer = _trainer(job, FakeRoles(2, lambda s, uid, k: float(k), skip={0, 2, 3}), lines)
    with pytest.raises(TrainingStopped, match="max_consecutive_nonfinite = 2.*resume"):
        trainer.fit()
    assert trainer.step == 3  # steps 1-3 completed, step 4 stopped the run
    assert sum("skipped" in line for line in lines) == 3
    assert [r["actor/skipped_updates"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1.0, 0.0, 1.0]


def test_resume_restores_the_bookkeeping_and_cuts_the_metrics(tmp_path):
    job = _job(
        tmp_path,
        "--backend_config.megatron_training.train_iters=3",
        "--backend_config.megatron_training.save_interval=2",
    )
    rewards = lambda s, uid, k: float(k)  # noqa: E731
    first = _trainer(job, FakeRoles(2, rewards, skip={2}))
    first.fit()  # checkpoints at steps 2 and 3; step 3 had a skipped update
    state = first.prompts.state_dict(), first.kl_ctrl.state_dict(), first.nonfinite_in_a_row
    assert state[2] == 1
    for name in (METRICS_FILE, GENERATIONS_FILE):
        with open(tmp_path / name, "a") as f:
            f.write('{"step": 4, "reward/score": 0.0}\n')  # a step past the checkpoint (a killed run)
    roles = FakeRoles(2, rewards)
    again = _trainer(job, roles)
    assert again.resume() == 3
    assert roles.calls == [
        (
            "load",
            Path(job.backend_config.megatron_training.save),
            3,
        )
    ]
    assert (again.prompts.state_dict(), again.kl_ctrl.state_dict(), again.nonfinite_in_a_row) == state
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2, 3]
    assert [r["step"] for r in read_metrics(tmp_path / GENERATIONS_FILE)] == [1, 1, 2, 2, 3, 3]  # 2 prompts a step
    assert again.fit() == []  # already at train_iters

    # the checkpoint's layout is check's rule, asked again when the run resumes (the directory may have changed)
    other = _job(
        tmp_path,
        "--backend_config.megatron_training.train_iters=3",
        "--backend_config.actor_config.tensor_model_parallel_size=2",
    )
    with pytest.raises(ConfigError, match="saved with TP 1 x PP 1 x EP 1") as refused:
        resume(_trainer(other, FakeRoles(2, rewards)), other)
    assert refused.value.violations[0].key == "backend_config.actor_config.tensor_model_parallel_size"


def _generations(roles):
    return [call[1] for call in roles.calls if call[0] == "generate"]


def test_one_step_off_policy_generates_the_next_batch_before_the_update(tmp_path):
    """Step k waits for its batch, syncs its old policy into the engine, starts step k + 1's batch, then trains:
    every batch after the first is one weight version behind; the last step starts none."""
    job = _job(
        tmp_path,
        "--backend_config.rl_config.one_step_off_policy=true",
        "--backend_config.megatron_training.train_iters=3",
        "--backend_config.megatron_training.save_interval=100",
    )
    roles = FakeRoles(2, lambda s, uid, k: float(k))
    trainer = _trainer(job, roles)
    history = trainer.fit()
    seed = trainer.seed
    assert _generations(roles) == [sampling_seed(seed, step, 0) for step in (1, 2, 3)]
    phases = [c[0] for c in roles.calls if c[0] in ("before_rollout", "generate", "log_probs")]
    assert phases == [
        "before_rollout",
        "generate",
        "before_rollout",
        "generate",
        "log_probs",
        "before_rollout",
        "generate",
        "log_probs",
        "before_rollout",
        "log_probs",
    ]  # reference only
    assert [m["rollout/staleness_max"] for m in history] == [0.0, 1.0, 1.0]
    assert trainer.pending is None


def test_one_step_off_policy_resumes_with_the_batch_generated_ahead(tmp_path):
    """A checkpoint keeps the batch generated ahead (from weights older than the checkpoint's): the resumed run
    trains on it without generating it again, and repeats the uninterrupted run's metrics."""
    args = (
        "--backend_config.rl_config.one_step_off_policy=true",
        "--backend_config.megatron_training.train_iters=3",
        "--backend_config.megatron_training.save_interval=2",
    )
    rewards = lambda s, uid, k: float(k + s % 3)  # noqa: E731
    straight = _trainer(_job(tmp_path / "a", *args), FakeRoles(2, rewards))
    expected = straight.fit()
    killed = _trainer(_job(tmp_path / "b", *args), FakeRoles(2, rewards))
    step = killed.train_step
    killed.train_step = lambda k: step(k) if k < 3 else (_ for _ in ()).throw(KeyboardInterrupt)  # killed in step 3
    with pytest.raises(KeyboardInterrupt):
        killed.fit()
    roles = FakeRoles(2, rewards)
    again = _trainer(_job(tmp_path / "b", *args), roles)
    assert again.resume() == 2 and again.pending is not None and again.pending.version == 1
    resumed = again.fit()
    assert _generations(roles) == []  # step 3's batch came from the checkpoint
    keys = ("reward/score", "rollout/staleness_max", "batch/samples")
    assert [{k: m[k] for k in keys} for m in resumed] == [{k: expected[-1][k] for k in keys}]


class RecordingRoles(FakeRoles):
    """FakeRoles that keeps the micro-batches of every update (the engine reports log-prob 0, the actor -0.5)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trained: list = []

    def train_mini_batch(self, shards, loss, denominator):
        self.trained.extend(batch for shard in shards for batch in shard)
        return super().train_mini_batch(shards, loss, denominator)


def _response_values(roles, name):
    return torch.cat([batch[name][batch["response_mask"] == 1] for batch in roles.trained])


def test_rollout_correction_sends_the_engine_log_probs_to_the_update_only_when_on(tmp_path):
    off = RecordingRoles(2, lambda s, uid, k: float(k))
    _trainer(_job(tmp_path / "off"), off).train_step(1)
    assert "engine_log_probs" not in off.trained[0]  # the default (auto, on-policy): off, micro-batches unchanged
    on = RecordingRoles(2, lambda s, uid, k: float(k))
    job = _job(tmp_path / "on", "--backend_config.rl_config.rollout_correction.rollout_is=sequence")
    _trainer(job, on).train_step(1)
    assert (_response_values(on, "engine_log_probs") == 0.0).all()
    assert "old_log_probs" not in on.trained[0]  # one mini-batch, one epoch: on-policy, no old log-prob pass
    assert [c[1] for c in on.calls if c[0] == "log_probs"] == ["reference"]
    ahead = RecordingRoles(2, lambda s, uid, k: float(k))  # auto: token-level truncation one step off policy
    _trainer(_job(tmp_path / "ahead", "--backend_config.rl_config.one_step_off_policy=true"), ahead).train_step(1)
    assert (_response_values(ahead, "engine_log_probs") == 0.0).all()


def test_only_mini_batches_after_an_update_take_old_log_probs_from_a_pass(tmp_path):
    """4 samples, mini-batches of 2, 2 epochs: the old log-prob pass scores only the second mini-batch (-0.5); the
    first trains without old log-probs and its update's forward gives them (-0.25), which the second epoch
    sends back as old. With the KL in the reward (needed before any update) every sample goes through the pass."""
    roles = RecordingRoles(2, lambda s, uid, k: float(k))
    job = _job(
        tmp_path / "two",
        "--backend_config.megatron_training.global_batch_size=2",
        "--backend_config.rl_config.ppo_epochs=2",
    )
    metrics = _trainer(job, roles).train_step(1)
    passes = [c for c in roles.calls if c[0] == "log_probs"]
    assert [c[1] for c in passes] == ["actor", "reference"] and roles.scored["actor"] == 2
    assert "old_log_probs" not in roles.trained[0] and "timing/old_logp" in metrics
    olds = [float(batch["old_log_probs"][batch["response_mask"] == 1].unique()) for batch in roles.trained[1:]]
    assert olds == [-0.5, -0.25, -0.5]
    assert metrics["rollout/logprob_gap_max"] == 0.5  # the engine's 0 against the actor's -0.5 and -0.25
    kl = RecordingRoles(2, lambda s, uid, k: float(k))
    _trainer(_job(tmp_path / "kl", "--backend_config.rl_config.use_kl_in_reward=true"), kl).train_step(1)
    assert kl.scored["actor"] == 4 and all("old_log_probs" in batch for batch in kl.trained)


def test_a_token_budget_cuts_the_micro_batches_of_every_pass(tmp_path):
    """With budgets the update's micro-batches (and the log-prob passes', by their own budget) hold up to that many
    padded tokens, whatever micro_batch_size (2) says; the step reports their count and padding share."""
    roles = RecordingRoles(2, lambda s, uid, k: float(k))
    longest = len(PROMPT) + 2  # the scripted responses are 2 tokens long
    job = _job(
        tmp_path,
        f"--backend_config.actor_config.max_tokens_per_micro_batch={longest}",
        f"--backend_config.actor_config.log_prob_max_tokens_per_micro_batch={4 * longest}",
        f"--backend_config.data.dataset_param.preprocess_parameters.max_prompt_length={len(PROMPT)}",
        "--backend_config.generate_config.sampling_config.max_tokens=2",
    )
    metrics = _trainer(job, roles).train_step(1)
    assert [tuple(b["input_ids"].shape) for b in roles.trained] == [(1, longest)] * 4  # one sample each
    assert roles.scored == {"reference": 4} and roles.passes == [[4]]  # all four in one log-prob micro-batch
    assert metrics["actor/micro_batches"] == 4.0 and metrics["actor/padding_share"] == 0.0


def test_without_budgets_a_log_prob_pass_takes_the_plans_larger_micro_batches(tmp_path):
    """No token budget: the update runs micro_batch_size (2) samples at a time, the reference pass the memory
    plan's ``log_prob_scale`` times as many (no backward keeps its activations): all four samples at once."""
    from mm_rl.config.plan import log_prob_scale

    roles = RecordingRoles(2, lambda s, uid, k: float(k))
    job = _job(tmp_path)
    assert log_prob_scale(job) >= 2
    metrics = _trainer(job, roles).train_step(1)
    assert roles.passes == [[4]] and [len(batch["input_ids"]) for batch in roles.trained] == [2, 2]
    assert metrics["actor/micro_batches"] == 2.0


def test_bypass_mode_takes_the_engine_log_probs_as_the_old_ones_without_the_actor_pass(tmp_path):
    roles = RecordingRoles(2, lambda s, uid, k: float(k))
    job = _job(tmp_path, "--backend_config.rl_config.rollout_correction.bypass_mode=true")
    metrics = _trainer(job, roles).train_step(1)
    assert [c[1] for c in roles.calls if c[0] == "log_probs"] == ["reference"]  # no old log-prob pass
    assert (_response_values(roles, "old_log_probs") == 0.0).all()  # the engine's, not the actor's -0.5
    assert "engine_log_probs" not in roles.trained[0]  # auto resolves to off: nothing left to correct
    assert "timing/old_logp" not in metrics and metrics["rollout/logprob_gap_max"] == 0.0


def test_generations_log_samples_prompts_per_step_and_every_validation_prompt(tmp_path):
    """generations_per_step 1 of 2 prompts: one record per train step with both responses (reward, accuracy,
    length, finish, advantage); every validation prompt at the validation step; the same to TensorBoard text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = _job(
        tmp_path,
        "--backend_config.megatron_training.train_iters=2",
        "--backend_config.rl_config.val_freq=2",
        "--logger.generations_per_step=1",
    )
    _trainer(job, FakeRoles(2, lambda s, uid, k: 0.25 * (k + 1))).fit()
    records = read_metrics(tmp_path / GENERATIONS_FILE)
    assert [(r["step"], r["split"], r["row"]) for r in records] == [
        (1, "train", 10),
        (2, "train", 12),
        (2, "val", 1010),
        (2, "val", 1011),
    ]
    first = records[0]
    assert first["prompt"] == "train question 0" and first["ground_truth"] == "1"
    assert [(g["reward"], g["accuracy"], g["length"], g["finish"]) for g in first["responses"]] == [
        (0.25, 0.25, 2, "stop"),
        (0.5, 0.5, 2, "stop"),
    ]
    assert first["responses"][0]["advantage"] < 0 < first["responses"][1]["advantage"]
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert {"generations/train/text_summary", "generations/val/text_summary"} <= set(events.Tags()["tensors"])
    text = events.Tensors("generations/train/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "train question 0" in text and "reward 0.500" in text


def test_generations_log_is_off_at_zero(tmp_path):
    job = _job(tmp_path, "--backend_config.megatron_training.train_iters=1", "--logger.generations_per_step=0")
    _trainer(job, FakeRoles(2, lambda s, uid, k: float(k))).fit()
    assert not (tmp_path / GENERATIONS_FILE).exists()


def test_generation_groups_are_picked_evenly_and_reproducibly():
    groups = [[i] for i in range(10)]
    assert pick(groups, 3) == [[0], [4], [9]] and pick(groups, 1) == [[0]]
    assert pick(groups, 0) == [] and pick(groups, 20) == groups


# the tiny job's shapes: 112 px images (8 x 8 patches of 3 x 2 x 14 x 14 values, 16 image tokens after the 2 x 2
# merger), prompts of about a hundred tokens, answers of up to 64 tokens, n 8, micro-batches of 8
TINY_GRID, PATCH_DIM, PROMPT_LEN, RESPONSE_LEN = (1, 8, 8), 3 * 2 * 14 * 14, 96, 64


class ImagePrompts(FakePrompts):
    """FakePrompts whose train rows each hold one image of the tiny job's size."""

    def requests(self, indices, split="train"):
        if split == "train":
            g = torch.Generator().manual_seed(len(self.cached))
            grid = torch.tensor([TINY_GRID])
            self.cached.update(
                {
                    i: SimpleNamespace(
                        pixel_values=torch.randn(int(grid.prod()), PATCH_DIM, generator=g),
                        image_grid_thw=grid,
                        mrope_time_steps=None,
                    )
                    for i in indices
                }
            )
        return [RolloutRequest(list(range(1, PROMPT_LEN + 1)), uid=i) for i in indices]


class MeteredRoles(FakeRoles):
    """FakeRoles with answers of RESPONSE_LEN tokens that count the tensor bytes the driver hands them (log-prob
    passes, updates, the image hand-off) and keep what the micro-batches of those passes were."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shipped, self.batches, self.images = 0, [], {}

    def start_generate(self, requests, sampling, seed):
        pending = super().start_generate(requests, sampling, seed)
        outputs = pending.result()
        for out in outputs:
            for sample in out.samples:
                sample.response_ids += [2] * (RESPONSE_LEN - len(sample.response_ids))
                sample.logprobs = torch.zeros(RESPONSE_LEN)
        return SimpleNamespace(result=lambda: outputs)

    def send_images(self, images):
        from mm_rl.trainer.batch import payload_bytes

        self.shipped += payload_bytes(images)
        self.images = dict(images)
        super().send_images(images)

    def log_probs(self, role, shards, temperature):
        self._count(shards)
        return super().log_probs(role, shards, temperature)

    def train_mini_batch(self, shards, loss, denominator):
        self._count(shards)
        return super().train_mini_batch(shards, loss, denominator)

    def _count(self, shards):
        from mm_rl.trainer.batch import payload_bytes

        self.shipped += payload_bytes(shards)
        self.batches += [batch for shard in shards for batch in shard]


def test_the_driver_ships_each_image_once_per_step(tmp_path):
    """At n 8 on the tiny job's shapes the bytes the driver hands the roles per step (the reference log-prob pass,
    the update, the image hand-off) are at least 8x fewer than with a copy of the prompt's pixel values per
    sample in every pass (the way before: computed from the same micro-batches); the images go once per step."""
    job = _job(
        tmp_path,
        "--backend_config.rl_config.n_samples_per_prompt=8",
        "--backend_config.megatron_training.global_batch_size=16",
        "--backend_config.actor_config.micro_batch_size=8",
        f"--backend_config.generate_config.sampling_config.max_tokens={RESPONSE_LEN}",
    )
    roles = MeteredRoles(8, lambda s, uid, k: float(k % 2))
    trainer = GRPOTrainer(job, roles, ImagePrompts(2), report=lambda line: None)
    trainer.train_step(1)
    assert [c[1] for c in roles.calls if c[0] == "send_images"] == [[0, 1]]
    # the reference pass: both groups in one micro-batch (the plan's log-prob scale); the update (on-policy: no old
    # pass): one micro-batch per group
    assert [len(b["input_ids"]) for b in roles.batches] == [16, 8, 8]
    assert [len(set(b["image_index"].tolist())) for b in roles.batches] == [2, 1, 1]
    pixels = {index: pixel_values.nbytes for index, (pixel_values, _) in roles.images.items()}
    before = sum(
        sum(t.nbytes for key, t in b.items() if key != "image_index")
        + sum(pixels[i] for i in b["image_index"].tolist())
        for b in roles.batches
    )
    print(
        f"\ndriver bytes per step: {before / 1e6:.2f} MB -> {roles.shipped / 1e6:.2f} MB "
        f"({before / roles.shipped:.1f}x fewer)"
    )
    assert before >= 8 * roles.shipped


class TurnPrompts(FakePrompts):
    image_token_id = 98

    def trajectory_text(self, response):
        return "|".join(map(str, response))


class TurnRoles(FakeRoles):
    """Multi-turn trajectories: [call, stop] (model) + [7, 7, 7] (tool turn) + [answer, stop] (model); the second
    sample of a group makes a malformed call. Records each update's denominator and response masks."""

    def __init__(self) -> None:
        super().__init__(2, lambda *a: 0.0)
        self.denominators, self.masks = [], []

    def start_generate(self, requests, sampling, seed):
        from mm_rl.rollout.base import Turns

        outputs = []
        for request in requests:
            samples = []
            for k in range(sampling.n):
                answer = 100 if k == 0 else 0
                turns = Turns([1, 1, 0, 0, 0, 1, 1], turns=2, tool_calls=1, malformed=k, tool_errors=k, tool_s=0.5)
                logprobs = torch.tensor([-0.1, -0.2, 0, 0, 0, -0.3, -0.4])
                samples.append(RolloutSample([50, 2, 7, 7, 7, answer, 2], logprobs, "stop", turns=turns))
            outputs.append(RolloutOutput(request.prompt_ids, samples, BatchTiming(0.1, 8), request.uid))
        return SimpleNamespace(result=lambda: RolloutOutputs(outputs))

    def train_mini_batch(self, shards, loss, denominator):
        self.denominators.append(denominator)
        self.masks += [row.tolist() for shard in shards for b in shard for row in b["response_mask"]]
        return super().train_mini_batch(shards, loss, denominator)


def test_a_multi_turn_step_scores_the_answer_and_trains_on_the_models_tokens(tmp_path):
    """The reward reads the last model turn (not the tool call before it) plus the tool-call format reward where
    no call was malformed; the update's response masks cover the model's tokens only and token-mean divides by
    their count; the multi_turn/* metrics count the trajectories; the log shows every turn."""
    job = _job(
        tmp_path,
        "--backend_config.rl_config.multi_turn.enable=true",
        "--backend_config.rl_config.multi_turn.tool_call_reward=0.25",
        "--backend_config.rl_config.multi_turn.max_tokens=64",
    )
    roles = TurnRoles()
    trainer = GRPOTrainer(job, roles, TurnPrompts(2), report=lambda line: None)
    metrics = trainer.train_step(1)
    assert metrics["reward/accuracy"] == 0.5 and metrics["reward/tool_call"] == 0.5
    assert metrics["reward/score"] == pytest.approx((1.0 + 0.25 + 0.0 + 0.0) / 2)
    assert roles.denominators == [4 * 4.0]  # 4 trajectories x 4 model tokens
    prompt = len(PROMPT) - 1  # labels are shifted: the response starts one position before it
    assert all(mask[prompt : prompt + 7] == [1, 1, 0, 0, 0, 1, 1] for mask in roles.masks)
    assert metrics["multi_turn/turns_mean"] == 2 and metrics["multi_turn/tool_calls_mean"] == 1
    assert metrics["multi_turn/malformed_calls"] == 2 and metrics["multi_turn/tool_s"] == 2.0
    assert metrics["multi_turn/model_tokens_mean"] == 4 and metrics["response_length/mean"] == 7
