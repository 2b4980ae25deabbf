"""The GRPO loop: a single controller (this process) driving Ray actors for every heavy part.

Per step::

    sync       actor weights -> rollout engine (wake it first when colocated)
    rollout    rollout_batch_size prompts x n samples (dynamic sampling: more batches until enough groups vary)
    reward     rule reward per response (reward worker actors)
    images     the step's distinct prompt images to the ranks, once (micro-batches name them by data-set index)
    old_logp   actor log-probs of the sampled tokens (before any update of this step); not for the first
               mini-batch, which is exactly on-policy: its update's forward gives them (all of them when the step
               has one mini-batch and one epoch)
    ref_logp   reference log-probs (when a KL term needs them)
    advantages group-normalised (GRPO / Dr.GRPO), RLOO or REINFORCE++; KL in reward when asked
    update     ppo_epochs x mini-batches; one optimizer step per mini-batch of micro-batches over DP ranks
    metrics    jsonl + TensorBoard + one console line; checkpoint every save_interval steps and at the end

Determinism (what makes a resumed run repeat an uninterrupted one): the prompt order is a pure function of
(seed, epoch) and its position is checkpointed; the engine's sampler is reseeded from (seed, step, batch)
before every generate; the actor trains in fp32 on CPU with fixed thread counts, and its model, optimizer,
LR schedule and RNG states are checkpointed; the engine gets the actor's weights at the start of every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mm_rl.config.schema import JobConfig
from mm_rl.platform.transfer import NO_TOOL_IMAGES
from mm_rl.rollout.base import FinishReason, RolloutOutputs, Turns
from mm_rl.trainer.batch import (
    Sample,
    balanced_shards,
    by_count,
    by_tokens,
    micro_batches,
    padded,
    padding_share,
    response_mask,
    response_values,
    same_run_count,
    step_images,
)
from mm_rl.trainer.generations import GENERATIONS_FILE, GenerationLog
from mm_rl.trainer.prompts import PromptSource
from mm_rl.trainer.roles import PendingRollout, Role, Roles, RolloutReady

logger = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The run cannot go on (too many non-finite steps, a failed worker); the message says why and what to do."""


@dataclass
class PhaseTimer:
    """Wall time per phase of one step."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{phase}": value for phase, value in self.seconds.items()}


@dataclass
class PendingBatch:
    """A rollout batch being generated: its prompts, the weight version (step) the engine generates it from, and
    the engine's answer once waited for."""

    indices: list[int]
    version: int
    rollout: PendingRollout | None = None
    outputs: RolloutOutputs | None = None

    def result(self) -> RolloutOutputs:
        if self.outputs is None:
            assert self.rollout is not None
            self.outputs, self.rollout = self.rollout.result(), None
        return self.outputs

    def state_dict(self) -> dict[str, Any]:
        """For a checkpoint: waits for the engine, keeps what it generated."""
        return {"indices": list(self.indices), "version": self.version, "outputs": self.result()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PendingBatch:
        return cls(list(state["indices"]), int(state["version"]), outputs=state["outputs"])


def sampling_seed(seed: int, step: int, batch: int) -> int:
    """The engine seed of generate call ``batch`` of ``step`` (validation uses batch -1)."""
    return (seed * 1_000_003 + step * 1_009 + batch + 1) % (2**31 - 1)


def build_trainer(job: JobConfig, mm_dir: str | Path, report: Callable[[str], None] = print) -> GRPOTrainer:
    """The trainer of a validated job on Ray: its prompts (processor, data sets, sampler) and every role.

    The prompts load in a thread while Ray starts (both take seconds, the prompts mostly transformers' imports on
    one core, Ray's start mostly its daemons starting on the others), and the roles wait for them: a data problem
    still stops the start before any role's process starts."""
    from concurrent.futures import ThreadPoolExecutor

    from mm_rl.trainer.ray_roles import RayRoles

    with ThreadPoolExecutor(1, thread_name_prefix="prompts") as pool:
        prompts = pool.submit(PromptSource.from_job, job)
        roles = RayRoles(job, Path(mm_dir), report, before_roles=prompts.result)
    return GRPOTrainer(job, roles, prompts.result(), report=report)


class GRPOTrainer:
    """The loop over a validated job's roles and prompts; :meth:`fit` runs it, :meth:`close` frees the roles.

    ``roles`` is the deployment (:class:`~mm_rl.trainer.roles.Roles`; :func:`build_trainer` starts the Ray one),
    ``prompts`` where the prompts come from; the trainer owns the KL controller and the checkpoints."""

    def __init__(
        self, job: JobConfig, roles: Roles, prompts: PromptSource, *, report: Callable[[str], None] = print
    ) -> None:
        from mm_rl.algorithms.kl import make_kl_controller
        from mm_rl.checkpoint import CheckpointManager

        self.job, self.roles, self.prompts, self.report = job, roles, prompts, report
        b = job.backend_config
        self.rl, self.generate_cfg, self.training = b.rl_config, b.generate_config, b.training
        self.response_tokens = b.response_tokens  # a trajectory's budget under multi-turn, else max_tokens
        self.out_dir = Path(job.af_output_dir)
        self.seed = int(b.training.seed)
        self.kl_ctrl = make_kl_controller(b.rl_config.kl_ctrl)
        self.checkpoints = CheckpointManager(b.megatron_training.save, b.megatron_training.max_keep_ckpts)
        self.step = 0
        self.nonfinite_in_a_row = 0
        self.pending: PendingBatch | None = None  # a rollout batch started ahead (one-step-off-policy)
        self.generations: GenerationLog | None = None  # open while fit() runs

    # ------------------------------------------------------------------------------------------------ loop
    def fit(self) -> list[dict[str, float]]:
        """Train from the current step to ``train_iters``; returns the metrics of the steps run here."""
        from mm_rl.trainer.metrics import MetricsLogger, step_line

        total = self.job.backend_config.megatron_training.train_iters
        save_every = self.job.backend_config.megatron_training.save_interval
        history: list[dict[str, float]] = []
        log = self.job.logger
        with (
            MetricsLogger(
                self.out_dir,
                tensorboard=log.tensorboard,
                wandb=log.wandb,
                swanlab=log.swanlab,
                run_name=self.job.exp_name,
                project=log.project,
            ) as sink,
            GenerationLog(self.out_dir, log.generations_per_step, self.prompts, sink) as self.generations,
        ):
            if self.rl.val_before_train and self.step == 0:
                metrics = self.validate(0)
                sink.log(0, metrics)
                self.report(f"validation before training: {_val_line(metrics)}")
            while self.step < total:
                step = self.step + 1
                metrics = self.train_step(step)
                validated = self.rl.val_freq > 0 and step % self.rl.val_freq == 0
                if validated:
                    metrics.update(self.validate(step))
                self.step = step
                sink.log(step, metrics)
                history.append(metrics)
                self.report(step_line(step, total, metrics))
                if validated:
                    self.report(f"validation at step {step}: {_val_line(metrics)}")
                if step % save_every == 0 or step == total:
                    self.save()
        return history

    def train_step(self, step: int) -> dict[str, float]:
        """One GRPO step (see the module docstring); returns its metrics.

        With ``one_step_off_policy`` the step's rollout batch was started during the previous step's update (the
        first step starts its own): the step waits for it, syncs its old policy into the engine, starts the next
        step's batch, and trains while that one generates (see :meth:`_rollout_ahead`)."""
        roles, timer = self.roles, PhaseTimer()
        start = time.perf_counter()
        if self.pending is None or not self.rl.one_step_off_policy:
            with timer("sync"):
                ready = roles.before_rollout()
        first = self.pending or self._start_batch(step, 0)
        self.pending = None
        self.prompts.retain(first.indices)
        samples, metrics = self.collect(step, timer, first)
        if self.rl.one_step_off_policy:
            ready = self._rollout_ahead(step, timer)
        with timer("onload"):
            roles.before_training()
        if ready.offloaded_bytes is not None:
            metrics["memory/offloaded_gb"] = ready.offloaded_bytes / 1e9
        with timer("images"):
            roles.send_images(step_images(samples, self.prompts.cached))
        if self.rl.rollout_correction.bypass_mode:  # the engine's log-probs serve as the old ones: no pass
            for sample in samples:
                sample.old_log_probs = sample.engine_log_probs.float().clone()
        elif before_update := samples[self._on_policy_count(len(samples)) :]:
            with timer("old_logp"):
                self._log_probs("actor", before_update, "old_log_probs")
        if roles.has_reference:
            with timer("ref_logp"):
                self._log_probs("reference", samples, "ref_log_probs")
        with timer("advantages"):
            metrics.update(self.compute_advantages(samples))
        self._log_generations(step, "train", samples)
        self.prompts.prefetch()  # the next draw's rows, processed while the actor trains
        with timer("update"):
            metrics.update(self.update(samples))
            roles.schedule_lr_at(step * self.rl.updates_per_step)  # on plan, whatever this step dropped
        metrics.update(_engine_gap(samples))
        timer.seconds["step"] = time.perf_counter() - start
        metrics.update(timer.metrics())
        # pipelined, the rollout phase is only the wait for a batch that generated during the previous update
        generating = metrics.get("rollout/wall_s", 0.0) if self.rl.one_step_off_policy else None
        metrics.update(_throughput(samples, timer.seconds, ready.sync.gb_per_s, generating))
        return metrics

    # ------------------------------------------------------------------------------------------- rollout
    def _rollout_ahead(self, step: int, timer: PhaseTimer) -> RolloutReady:
        """One-step-off-policy: this step's old policy (the weights after the previous update) into the engine, then
        the next step's rollout batch started, to generate while this step trains. Its samples are then one weight
        version behind the policy that trains on them (``rollout/staleness``); the last step starts none."""
        with timer("sync"):
            ready = self.roles.before_rollout()
        if step < self.job.backend_config.megatron_training.train_iters:
            self.pending = self._start_batch(step + 1, 0)
        return ready

    def collect(
        self, step: int, timer: PhaseTimer, first: PendingBatch | None = None
    ) -> tuple[list[Sample], dict[str, float]]:
        """Rollout + reward, with dynamic sampling (drop groups whose rewards are all equal, draw more batches,
        at most ``max_num_gen_batches``; short of groups, the dropped ones fill the batch back up). ``first``: the
        step's first batch when it was already started."""
        from mm_rl.algorithms.reward_shaping import filter_zero_variance_groups

        dynamic = self.rl.dynamic_sampling
        wanted = self.rl.rollout_batch_size
        kept: list[list[Sample]] = []
        dropped: list[list[Sample]] = []
        metrics: dict[str, float] = {}
        batches = 0
        while batches < (dynamic.max_num_gen_batches if dynamic.enable else 1):
            pending = first if batches == 0 and first is not None else self._start_batch(step, batches)
            groups, batch_metrics = self._finish_batch(pending, step, timer)
            batches += 1
            _accumulate(metrics, batch_metrics)
            if not dynamic.enable:
                kept = groups
                break
            scores = torch.tensor([s.reward for g in groups for s in g], dtype=torch.float64)
            ids = torch.tensor([i for i, g in enumerate(groups) for _ in g])
            keep, _ = (
                filter_zero_variance_groups(scores, ids) if len(scores) else (torch.zeros(0, dtype=torch.bool), {})
            )
            start = 0
            for group in groups:
                (kept if bool(keep[start]) else dropped).append(group)
                start += len(group)
            if len(kept) >= wanted:
                break
        if dynamic.enable:
            metrics["dynamic_sampling/gen_batches"] = float(batches)
            metrics["dynamic_sampling/groups_varying"] = float(min(len(kept), wanted))
            kept = (kept + dropped)[:wanted]
        samples = [s for group in kept for s in group]
        if not samples:
            raise TrainingStopped(
                "every prompt of the step was skipped by the rollout bounds (see rollout/* "
                "counts): check max_prompt_length, seq-length and the pixel bounds"
            )
        for position, group in enumerate(kept):
            for sample in group:
                sample.group = position
        metrics.update(_sample_metrics(samples, self.response_tokens))
        metrics.update(_turn_metrics(samples))
        for key, sample in enumerate((s for s in samples if s.tool_images is not None), start=1):
            sample.image_key = NO_TOOL_IMAGES - key  # its tool images' key in the step's images
        staleness = torch.tensor([s.staleness for s in samples], dtype=torch.float64)
        metrics |= {"rollout/staleness_mean": float(staleness.mean()), "rollout/staleness_max": float(staleness.max())}
        return samples, metrics

    def _start_batch(self, step: int, batch: int) -> PendingBatch:
        """Draw rollout batch ``batch`` of ``step`` and start generating it (the engine's sampler seeded from
        (seed, step, batch)); the engine holds the weights of version ``self.step`` now."""
        from mm_rl.rollout.base import sampling_for

        indices = self.prompts.next_indices()
        requests = self.prompts.requests(indices)
        rollout = self.roles.start_generate(
            requests, sampling_for(self.generate_cfg), sampling_seed(self.seed, step, batch)
        )
        return PendingBatch(indices, self.step, rollout)

    def _finish_batch(
        self, pending: PendingBatch, step: int, timer: PhaseTimer
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        """A started rollout batch, waited for and scored: the groups (one per admitted prompt) and the batch's
        metrics. Each sample records how many weight versions its policy is behind the one that trains on it."""
        with timer("rollout"):
            outputs = pending.result()
        groups = [
            [
                self.make_sample(index, out.prompt_ids, s.response_ids, s.finish_reason, s.logprobs, turns=s.turns)
                for s in out.samples
            ]
            for index, out in zip(pending.indices, outputs, strict=True)
            if out.samples
        ]
        for sample in (s for g in groups for s in g):
            sample.staleness = step - 1 - pending.version
        with timer("reward"):
            reward_metrics = self.score([s for g in groups for s in g])
        cut = sum(s.finish_reason == "vision_token" for g in groups for s in g)
        return groups, outputs.metrics.as_dict() | reward_metrics | {"rollout/vision_token_cut": float(cut)}

    def make_sample(
        self,
        index: int,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        finish_reason: FinishReason,
        engine_log_probs: torch.Tensor | None = None,
        split: str = "train",
        turns: Turns | None = None,
    ) -> Sample:
        """A Sample, its response cut before the first vision special token (image pad, vision start / end) the
        model generated (a multi-turn trajectory's tool turns hold images of their own).

        A response may sample those ids as text; the actor's model splices images wherever the image pad id
        appears and counts images from vision starts, so such a response cannot be scored as is. The cut
        treats the sample as if it had stopped there (counted as ``rollout/vision_token_cut``). A trajectory's tool
        images are processed here like prompt images (the ranks get them with the step's images)."""
        response = list(response_ids)
        generated = turns.loss_mask if turns is not None else [1] * len(response)
        vision = self.prompts.vision_token_ids
        cut = next((i for i, token in enumerate(response) if token in vision and generated[i]), None)
        if cut is not None:
            response, finish_reason = response[:cut], "vision_token"
        logprobs = engine_log_probs[: len(response)] if engine_log_probs is not None else None
        sample = Sample(
            index,
            0,
            list(prompt_ids),
            response,
            finish_reason,
            ground_truth=self.prompts.ground_truth(index, split),
            engine_log_probs=logprobs,
        )
        if turns is not None:
            self._add_turns(sample, turns)
        return sample

    def _add_turns(self, sample: Sample, turns: Turns) -> None:
        """A trajectory's loss mask and tool images (those whose pads the cut kept), checked against its ids."""
        from mm_rl.rollout.bounds import image_runs

        kept = len(image_runs(sample.response_ids, self.prompts.image_token_id))
        turns = dataclasses.replace(turns, loss_mask=turns.loss_mask[: sample.response_len], images=turns.images[:kept])
        sample.turns, sample.loss_mask = turns, torch.tensor(turns.loss_mask, dtype=torch.float32)
        if turns.images:
            counts, pixels, grids = self.prompts.images(turns.images)
            pads = sum(stop - start for start, stop in image_runs(sample.response_ids, self.prompts.image_token_id))
            if pads != sum(counts):
                raise RuntimeError(
                    f"a trajectory's tool turns hold {pads} image pads but its {len(counts)} tool images make "
                    f"{sum(counts)} tokens: the engine and the actor processed them differently"
                )
            sample.tool_images = (pixels, grids)

    def score(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Decode and score the samples (rewards written into them); the batch's reward metrics."""
        if not samples:
            return {}
        answers = [s.turns.answer(s.response_ids) if s.turns is not None else s.response_ids for s in samples]
        texts = self.prompts.decode(answers)
        result = self.roles.score(texts, [s.ground_truth for s in samples])
        for i, (sample, text, value) in enumerate(zip(samples, texts, result.scores, strict=True)):
            sample.text, sample.reward = text, float(value)
            sample.components = {name: float(values[i]) for name, values in result.components.items()}
            if sample.turns is not None:  # the log shows every turn; the reward read the last
                sample.text = self.prompts.trajectory_text(sample.response_ids)
        metrics = result.metrics
        weight = self.rl.multi_turn.tool_call_reward
        if weight and any(s.turns is not None for s in samples):
            for sample in samples:
                earned = sample.turns is not None and sample.turns.tool_calls > 0 and not sample.turns.malformed
                sample.components["tool_call"] = float(earned)
                sample.reward += weight * float(earned)
            metrics["reward/tool_call"] = sum(s.components["tool_call"] for s in samples) / len(samples)
            metrics["reward/score"] = sum(s.reward for s in samples) / len(samples)
        metrics["reward/std"] = float(torch.tensor(result.scores, dtype=torch.float64).std(unbiased=False))
        return metrics

    # --------------------------------------------------------------------------------------- log-probs
    def _log_probs(self, role: Role, samples: list[Sample], name: str) -> None:
        """``name`` of every sample from ``role`` (the actor or the reference), DP replicas sharing the work."""
        runs = self._cut(samples, self.roles.data_parallel_size(role), grad=False)
        batches = [micro_batches(shard, self.prompts.cached, self.prompts.pad_id) for shard in runs]
        temperature = self.generate_cfg.sampling_config.temperature or 1.0
        _store(runs, self.roles.log_probs(role, batches, temperature), name)

    def _cut(self, samples: Sequence[Sample], replicas: int, grad: bool) -> list[list[list[Sample]]]:
        """Per DP replica, the runs of samples that become its micro-batches (the plan's
        :func:`~mm_rl.config.plan.micro_batch_limits`): as few runs of at most its samples as hold an equal,
        contiguous shard, evenly sized, or with a token budget runs up to the budget of token-balanced shards."""
        from mm_rl.config.plan import micro_batch_limits

        actor = self.job.backend_config.actor_config
        budget, rows = micro_batch_limits(self.job, grad)
        if budget is None:
            runs = [by_count(shard, _even(len(shard), rows)) for shard in _split(samples, replicas)]
        else:
            runs = [by_tokens(shard, budget, actor.remove_padding) for shard in balanced_shards(samples, replicas)]
        return same_run_count(runs) if actor.expert_model_parallel_size > 1 else runs

    def _on_policy_count(self, n_samples: int) -> int:
        """How many leading samples take their old log-probs from the update's own forward rather than a pass
        before it: the first mini-batch of the first epoch sees the weights that generated it (no dropout), so a
        separate pass would give the same numbers. None when the KL-in-reward needs them before the update, when
        no mini-batch is full (no update runs), or under LoRA dropout (the update's forward drops inputs)."""
        mini, dropout = self.rl.mini_batch_size, self.job.backend_config.actor_config.lora.dropout
        return 0 if self.rl.use_kl_in_reward or n_samples < mini or dropout > 0 else mini

    # ------------------------------------------------------------------------------------------ advantages
    def compute_advantages(self, samples: list[Sample]) -> dict[str, float]:
        from mm_rl.algorithms.advantages import advantage_stats, compute_advantages
        from mm_rl.algorithms.kl import apply_kl_in_reward
        from mm_rl.algorithms.reward_shaping import overlong_penalty
        from mm_rl.algorithms.token_level import scores_to_token_level

        rl, metrics = self.rl, {}
        scores = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        lengths = torch.tensor([s.response_len for s in samples])
        if rl.overlong_buffer.enable:
            penalty = overlong_penalty(
                lengths,
                self.response_tokens,
                rl.overlong_buffer.len,
                rl.overlong_buffer.penalty_factor,
            )
            scores = scores + penalty
            metrics["reward/overlong_penalty"] = float(penalty.mean())
        mask = response_mask(samples)
        rewards: torch.Tensor = scores
        if rl.use_kl_in_reward:
            old, _ = padded(samples, "old_log_probs")
            ref, _ = padded(samples, "ref_log_probs")
            kl_ctrl = self.kl_ctrl
            rewards, kl_metrics = apply_kl_in_reward(
                scores_to_token_level(scores, mask), old, ref, mask, kl_ctrl.value, rl.kl_ctrl.kl_penalty
            )
            kl_ctrl.update(float(kl_metrics["kl"]), n_steps=len(samples))
            metrics.update({f"kl_in_reward/{k}": float(v) for k, v in kl_metrics.items()})
        group_ids = torch.tensor([s.group for s in samples])
        advantages = compute_advantages(
            rl.adv_estimator,
            rewards,
            mask,
            group_ids,
            epsilon=rl.adv_epsilon,
            norm_by_std=rl.norm_adv_by_std,
            gamma=rl.gamma,
            unbiased_std=rl.grpo_std == "unbiased",
        )
        for row, sample in enumerate(samples):
            sample.advantages = advantages[row, : sample.response_len].float().clone()
        metrics.update({k: float(v) for k, v in advantage_stats(advantages, mask).items()})
        return metrics

    # ---------------------------------------------------------------------------------------------- update
    def update(self, samples: list[Sample]) -> dict[str, float]:
        """ppo_epochs passes of one optimizer step per mini-batch; metrics averaged over the steps."""
        from mm_rl.algorithms.rollout_correction import resolve_rollout_is
        from mm_rl.workers.training import LossSpec

        roles = self.roles
        mini = self.rl.mini_batch_size
        usable = len(samples) - len(samples) % mini
        loss = LossSpec(self.rl, self.response_tokens, self.generate_cfg.sampling_config.temperature or 1.0)
        fields = ("advantages",) + (("ref_log_probs",) if roles.has_reference else ())
        fields += ("engine_log_probs",) if resolve_rollout_is(self.rl) != "off" else ()
        steps: list[dict[str, float]] = []
        micro: list[list[Sample]] = []
        for _ in range(self.rl.ppo_epochs):
            for start in range(0, usable, mini):
                batch = samples[start : start + mini]
                on_policy = batch[0].old_log_probs is None  # see _on_policy_count: the update's forward gives them
                runs = self._cut(batch, roles.data_parallel_size("actor"), grad=True)
                shards = [
                    micro_batches(
                        shard,
                        self.prompts.cached,
                        self.prompts.pad_id,
                        fields + (() if on_policy else ("old_log_probs",)),
                    )
                    for shard in runs
                ]
                step_metrics, own = roles.train_mini_batch(shards, loss, self._denominator(batch))
                steps.append(step_metrics)
                micro += [run for shard in runs for run in shard]
                if on_policy:
                    _store(runs, own, "old_log_probs")
        metrics = {f"actor/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0]} if steps else {}
        metrics["actor/micro_batches"] = len(micro) / max(1, len(steps))
        metrics["actor/padding_share"] = padding_share(micro, self.job.backend_config.actor_config.remove_padding)
        skipped = sum(s["skipped"] for s in steps)
        metrics["actor/skipped_updates"] = float(skipped)
        metrics["actor/samples_unused"] = float(len(samples) - usable)
        self._track_nonfinite(skipped > 0)
        return metrics

    def _denominator(self, batch: Sequence[Sample]) -> float:
        """The mini-batch's loss denominator: valid tokens (token-mean) or non-empty responses (seq-mean-*)."""
        if self.rl.loss_agg_mode == "token-mean":
            return float(sum(s.trained_tokens for s in batch))
        return float(sum(1 for s in batch if s.trained_tokens > 0))

    def _track_nonfinite(self, bad: bool) -> None:
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if bad else 0
        if bad:
            self.report(
                f"warning: non-finite loss or grad norm; the update was skipped (weights untouched), "
                f"{self.nonfinite_in_a_row} step(s) in a row"
            )
        limit = self.rl.max_consecutive_nonfinite
        if self.nonfinite_in_a_row >= limit:
            raise TrainingStopped(
                f"{self.nonfinite_in_a_row} steps in a row had a NaN/inf loss or grad norm "
                f"(rl_config.max_consecutive_nonfinite = {limit}); the run stops rather than train on garbage. "
                "Lower backend_config.actor_config.lr, set backend_config.training.clip-grad, or check the "
                "data; resume from the last checkpoint with the same command."
            )

    # ------------------------------------------------------------------------------------------ validation
    def validate(self, step: int) -> dict[str, float]:
        """Greedy (val_sampling_config) rollouts on the validation split: ``val/...`` metrics."""

        from mm_rl.rollout.base import sampling_for

        indices = self.prompts.val_indices()
        if not indices:
            return {}
        if self.pending is not None:  # the next step's batch, generating from the weights before this update
            self.pending.result()
        self.roles.before_rollout()  # the engine still holds the weights from before this step's update
        start = time.perf_counter()
        requests = self.prompts.requests(indices, split="val")
        outputs = self.roles.start_generate(
            requests, sampling_for(self.generate_cfg, validation=True), sampling_seed(self.seed, step, -1)
        ).result()
        self.roles.before_training()
        samples = [
            self.make_sample(index, out.prompt_ids, s.response_ids, s.finish_reason, None, split="val", turns=s.turns)
            for index, out in zip(indices, outputs, strict=True)
            for s in out.samples
        ]
        metrics = self.score(samples)
        self._log_generations(step, "val", samples)
        metrics.update(_sample_metrics(samples, self.generate_cfg.val_sampling_config.max_tokens))
        out = {f"val/{k}": v for k, v in metrics.items() if k.startswith(("reward/", "response_length/"))}
        out["timing/validation"] = time.perf_counter() - start
        return out

    def _log_generations(self, step: int, split: str, samples: Sequence[Sample]) -> None:
        """To generations.jsonl when :meth:`fit` runs (a step driven on its own logs nothing)."""
        if self.generations is not None:
            self.generations.log(step, split, samples)

    # -------------------------------------------------------------------------------------- checkpoints
    def save(self) -> Path:
        """Checkpoint the current step: every rank writes its file, then this process commits the iteration."""
        from mm_rl.trainer.metrics import METRICS_FILE, read_metrics

        checkpoints, step = self.checkpoints, self.step
        with checkpoints.saving(step) as staging:  # a failed save is removed at once; the previous stays latest
            self.roles.save(staging)
            state = {
                "step": step,
                "sampler": self.prompts.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict(),
                "nonfinite_in_a_row": self.nonfinite_in_a_row,
                "seed": self.seed,
                "metrics_history": read_metrics(self.out_dir / METRICS_FILE),
                # the next step's batch, generated from weights older than these: a resume trains on it as
                # the uninterrupted run does (the sampler is already past its prompts)
                "pending": self.pending.state_dict() if self.pending is not None else None,
            }
            checkpoints.write_trainer_state(staging, state)
            path = checkpoints.commit(staging, step, ep=self.job.backend_config.actor_config.expert_model_parallel_size)
        self.report(f"checkpoint: {path}")
        return path

    def resume(self) -> int | None:
        """Load the checkpoint that ``resume_mode`` names (auto: the latest complete one); returns its step."""
        from mm_rl.trainer.metrics import METRICS_FILE, rewind

        mt, checkpoints = self.job.backend_config.megatron_training, self.checkpoints
        checkpoints.cleanup_stale()
        step = checkpoints.resolve_resume(mt.resume_mode)
        if step is None:  # a fresh start: records of earlier attempts would repeat its steps
            rewind(self.out_dir, None, (METRICS_FILE, GENERATIONS_FILE))
            return None
        self.roles.load(checkpoints.save_dir, step, not self.training.no_load_optim, not self.training.no_load_rng)
        state = checkpoints.load_trainer_state(step)
        self.prompts.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        if state.get("pending") is not None:
            self.pending = PendingBatch.from_state(state["pending"])
            self.prompts.requests(self.pending.indices)  # the rows' processed inputs, for the step's micro-batches
        rewind(self.out_dir, step, (METRICS_FILE, GENERATIONS_FILE))
        self.step = step
        self.report(f"resumed from step {step} ({checkpoints.save_dir})")
        return step

    def close(self, graceful: bool = True) -> None:
        self.prompts.close()
        self.roles.close(graceful)


# ------------------------------------------------------------------------------------------------ helpers
def _split(samples: Sequence[Sample], parts: int) -> list[list[Sample]]:
    """``parts`` contiguous, equal shards (the caller keeps the count divisible where it matters). Contiguous keeps
    a group's samples side by side, so they share micro-batches and the ranks encode their image once per
    micro-batch rather than once per sample."""
    size = math.ceil(len(samples) / parts)
    return [list(samples[i * size : (i + 1) * size]) for i in range(parts)]


def _even(count: int, most: int) -> int:
    """The size of as few equal runs of ``count`` samples as keep each within ``most``: 32 within 24 -> 16 + 16, not
    24 + 8 (a micro-batch costs about its size, and the shorter run's fixed costs are paid either way)."""
    return -(-count // max(1, -(-count // most)))


def _store(
    shards: Sequence[Sequence[Sequence[Sample]]], results: Sequence[Sequence[torch.Tensor] | None], name: str
) -> None:
    """``name`` of every sample from its replica's per-micro-batch [B, S] log-probs (``shards``: each replica's
    runs of samples, one per micro-batch)."""
    for runs, rows in zip(shards, results, strict=True):
        if rows is None:
            raise RuntimeError(f"a replica returned no {name} for its {len(runs)} micro-batches")
        for sample, values in zip((s for run in runs for s in run), response_values(runs, rows), strict=True):
            setattr(sample, name, values)


# rollout metrics that are rates or shapes of one generate call, not counts: the last call's stands
_LAST_CALL = {"rollout/tok_per_s", "rollout/replicas", "rollout/replica_prompts_min", "rollout/replica_wall_spread"}


def _accumulate(total: dict[str, float], batch: dict[str, float]) -> None:
    """Counts add up over the generate calls of a step; reward means and rates are the last batch's."""
    for key, value in batch.items():
        counted = key.startswith("rollout/") and key not in _LAST_CALL
        total[key] = total.get(key, 0.0) + value if counted else value


def _sample_metrics(samples: Sequence[Sample], max_tokens: int) -> dict[str, float]:
    """Reward and response-length statistics over the samples actually trained on."""
    lengths = torch.tensor([s.response_len for s in samples], dtype=torch.float64)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    components = {
        f"reward/{name}": sum(s.components.get(name, 0.0) for s in samples) / len(samples)
        for name in samples[0].components
    }
    return components | {
        "reward/score": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_rate": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "batch/samples": float(len(samples)),
        "batch/groups": float(len({s.group for s in samples})),
    }


def _turn_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Multi-turn trajectories: turns and tool calls per trajectory, tool errors and time, limits hit."""
    turns = [s.turns for s in samples if s.turns is not None]
    if not turns:
        return {}
    count = len(turns)
    return {
        "multi_turn/turns_mean": sum(t.turns for t in turns) / count,
        "multi_turn/turns_max": float(max(t.turns for t in turns)),
        "multi_turn/tool_calls_mean": sum(t.tool_calls for t in turns) / count,
        "multi_turn/tool_errors": float(sum(t.tool_errors for t in turns)),
        "multi_turn/malformed_calls": float(sum(t.malformed for t in turns)),
        "multi_turn/tool_images": float(sum(len(t.images) for t in turns)),
        "multi_turn/turn_limit_share": sum(s.finish_reason == "turns" for s in samples) / count,
        "multi_turn/token_limit_share": sum(s.finish_reason == "length" for s in samples) / count,
        "multi_turn/tool_s": sum(t.tool_s for t in turns),
        "multi_turn/model_tokens_mean": sum(s.trained_tokens for s in samples) / count,
    }


def _throughput(
    samples: Sequence[Sample], seconds: dict[str, float], sync_gb_per_s: float, generating_s: float | None = None
) -> dict[str, float]:
    """Tokens per second of the step, the update and the rollout (over ``generating_s``, the engine's own time, when
    given; else the rollout phase's), and the sync's GB/s."""
    tokens = sum(len(s.prompt_ids) + s.response_len for s in samples)
    generated = sum(s.response_len for s in samples)

    def rate(count: float, phase: str) -> float:
        return count / seconds[phase] if seconds.get(phase) else 0.0

    rollout = rate(generated, "rollout") if generating_s is None else generated / generating_s if generating_s else 0.0
    return {
        "throughput/tok_per_s": rate(tokens, "step"),
        "throughput/update_tok_per_s": rate(tokens, "update"),
        "throughput/rollout_tok_per_s": rollout,
        **({"throughput/sync_gb_per_s": sync_gb_per_s} if sync_gb_per_s else {}),  # none when nothing was synced
    }


def _engine_gap(samples: Sequence[Sample]) -> dict[str, float]:
    """How far the engine's log-probs of the sampled tokens are from the actor's recomputation (a mismatch of
    weights, tokens or positions shows here first); mean and max absolute difference over response tokens."""
    pairs = [
        (s.engine_log_probs, s.old_log_probs, s.mask() > 0)
        for s in samples
        if s.engine_log_probs is not None and s.old_log_probs is not None and s.trained_tokens
    ]
    if not pairs:
        return {}
    gaps = torch.cat([(engine - old).abs()[generated] for engine, old, generated in pairs])
    return {"rollout/logprob_gap_mean": float(gaps.mean()), "rollout/logprob_gap_max": float(gaps.max())}


def _val_line(metrics: dict[str, float]) -> str:
    return " | ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("val/reward"))
