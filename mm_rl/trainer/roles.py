"""Every role of a GRPO job, built from the job yaml: data, actor and reference ranks, rollout engine, rewards.

The trainer (``mm_rl.trainer.grpo``) holds one :class:`Roles` and talks to the roles only through it, so the
loop reads as the algorithm and this module as the deployment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from mm_rl.config.schema import JobConfig
from mm_rl.trainer.runtime import ROLLOUT_CPUS, connect, make_placement, plan_resources

logger = logging.getLogger(__name__)


class Roles:
    """Starts Ray (or joins the cluster) and every role; ``close`` ends them."""

    def __init__(self, job: JobConfig, mm_dir: Path, say: Callable[[str], None]) -> None:
        self.job, self.say = job, say
        self.actor: Any = None
        self.ref: Any = None
        self.rollout: Any = None
        self.rewards: Any = None
        self.placement: Any = None
        self.items: dict[int, Any] = {}
        try:
            self._start(mm_dir)
        except BaseException:
            self.close(graceful=False)
            raise

    def _start(self, mm_dir: Path) -> None:
        from mm_rl.algorithms.kl import make_kl_controller
        from mm_rl.data.dataset import PromptDataset, PromptProcessor
        from mm_rl.data.sampler import PromptSampler
        from mm_rl.trainer.checkpoint import CheckpointManager

        b = self.job.backend_config
        pre = b.data.dataset_param.preprocess_parameters
        self.processor = PromptProcessor(pre.model_name_or_path, pre.min_pixels, pre.max_pixels)
        self.pad_id = int(self.processor.tokenizer.pad_token_id or 0)
        self.vision_token_ids = vision_token_ids(self.processor.tokenizer)
        self.train_set = PromptDataset.from_config(b.data, "train", self.processor)
        wants_val = b.rl_config.val_freq > 0 or b.rl_config.val_before_train
        self.val_set = PromptDataset.from_config(b.data, "val", self.processor) if wants_val else None
        self.sampler = PromptSampler(len(self.train_set), b.rl_config.rollout_batch_size, int(b.training.seed),
                                     shuffle=b.data.shuffle)
        self.kl_ctrl = make_kl_controller(b.rl_config.kl_ctrl)
        self.checkpoints = CheckpointManager(b.megatron_training.save, b.megatron_training.max_keep_ckpts)
        self.resources = plan_resources(self.job)
        self._notices()
        self.say(f"ray: {connect(self.job, self.resources)}")
        self.placement = make_placement(self.resources, with_rollout=True)
        self._start_actor(mm_dir)
        self._start_reference(mm_dir)
        self._start_rollout()
        self._start_rewards()

    def _notices(self) -> None:
        """Flags this device cannot honour are said once, not silently dropped."""
        t, device = self.job.backend_config.training, self.resources.device
        if t.use_flash_attn and device == "cpu":
            self.say("notice: use-flash-attn has no CPU kernel; attention runs through torch's SDPA")
        if t.bf16 and device == "cpu":
            self.say("notice: bf16 is for accelerators; on CPU the actor trains in fp32 (oneDNN bf16 is slower)")

    def get(self, future: Any, role: str) -> Any:
        """``ray.get`` of a call to a single-actor role; its failure is raised naming the role."""
        import ray

        with _named(role):
            return ray.get(future)

    # ------------------------------------------------------------------------------------------- workers
    def worker_spec(self, trained: bool) -> Any:
        from mm_rl.workers.megatron_worker import WorkerSpec

        b, res = self.job.backend_config, self.resources
        tp, pp = b.actor_config.tensor_model_parallel_size, b.actor_config.pipeline_model_parallel_size
        cp = b.training.context_parallel_size
        bf16 = b.training.bf16 and res.device != "cpu"
        return WorkerSpec(model=b.model, tp=tp, pp=pp, cp=cp, dp=res.world_size // (tp * pp * cp),
                          actor=b.actor_config if trained else None, flags=b.training, seed=int(b.training.seed),
                          bf16=bf16)

    def _start_actor(self, mm_dir: Path) -> None:
        from mm_rl.workers.group import WorkerGroup
        from mm_rl.workers.training import TrainingWorker

        res = self.resources
        spec = self.worker_spec(trained=True)
        self.say(f"actor: TP {spec.tp} x PP {spec.pp} x DP {spec.dp}" + (f" x CP {spec.cp}" if spec.cp > 1 else "")
                 + f" megatron ranks on {res.device}")
        self.actor = WorkerGroup(spec, cpus_per_worker=res.actor_share, placement=self.placement,
                                 resources_per_worker=res.worker_resources(res.device_share_actor),
                                 worker_cls=TrainingWorker, role="actor", num_threads=res.threads)
        self.actor.build(str(mm_dir))
        self.actor.run("setup_training", self.optimizer_spec(spec.bf16))

    def optimizer_spec(self, bf16: bool) -> Any:
        from mm_rl.workers.training import OptimizerSpec

        b = self.job.backend_config
        t, rl = b.training, b.rl_config
        per_step = rl.ppo_epochs * max(1, rl.rollout_batch_size * rl.n_samples_per_prompt // rl.mini_batch_size)
        total = b.megatron_training.train_iters * per_step
        return OptimizerSpec(lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                             adam_beta2=t.adam_beta2, clip_grad=t.clip_grad, lr_decay_style=t.lr_decay_style,
                             warmup_steps=int(t.lr_warmup_fraction * total), total_steps=total,
                             vision_encoder_lr=b.actor_config.vision_encoder_lr
                             if b.actor_config.unfreeze_vision_encoder else None,
                             bf16=bf16, use_distributed_optimizer=t.use_distributed_optimizer)

    def _start_reference(self, mm_dir: Path) -> None:
        from mm_rl.workers.group import WorkerGroup

        rl, res = self.job.backend_config.rl_config, self.resources
        if not (rl.use_kl_loss or rl.use_kl_in_reward):
            return
        placement = self.placement if rl.colocate_ref else make_placement(res)
        self.ref = WorkerGroup(self.worker_spec(trained=False), cpus_per_worker=res.ref_share, placement=placement,
                               resources_per_worker=res.worker_resources(res.device_share_ref), role="reference",
                               num_threads=res.threads)
        self.ref.owns_placement = not rl.colocate_ref
        self.ref.build(str(mm_dir))

    def _start_rollout(self) -> None:
        import os

        from mm_rl.rollout.actor import rollout_worker_actor
        from mm_rl.rollout.weight_sync import RolloutSchedule, join_collective

        b, res = self.job.backend_config, self.resources
        pre = b.data.dataset_param.preprocess_parameters
        threads = (os.cpu_count() or 1) if res.device == "cpu" else None  # the rollout phase runs alone
        options = self._rollout_placement()
        self.rollout = rollout_worker_actor(num_cpus=ROLLOUT_CPUS if res.device == "cpu" else 0, **options).remote(
            pre.model_name_or_path, b.generate_config, min_pixels=pre.min_pixels, max_pixels=pre.max_pixels,
            num_threads=threads, seed=int(b.training.seed))
        self.get(self.rollout.ready.remote(), "rollout engine")
        # On CPU the engine and the actor share host memory: sleeping and offloading would free nothing.
        schedule = dataclasses.replace(b.generate_config, colocate=b.generate_config.colocate and res.device != "cpu")
        # Weights go device to device to an engine on devices of its own; a colocated engine shares actor rank 0's
        # device, where nccl / hccl cannot pair two ranks, and on CPU shared memory is faster (bench/sync.py).
        collective = None
        if res.rollout_devices:
            with _named("rollout engine joining the weight-sync groups"):
                collective = join_collective(self.actor, self.rollout)
        self.schedule = RolloutSchedule(self.actor, self.rollout, schedule, b.actor_config, collective=collective,
                                        reference=self.ref if b.rl_config.colocate_ref else None)
        self.say(f"rollout: {b.generate_config.backend} engine ready")

    def _rollout_placement(self) -> dict[str, Any]:
        """Ray options of the engine's actor: separate, its own bundle of whole devices; colocated, a share of actor
        rank 0's device (it sleeps while the actor trains); on CPU, none (it runs beside the ranks)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        res = self.resources
        if res.device == "cpu":
            return {}
        bundle, share = (res.world_size, res.rollout_devices) if res.rollout_devices else (0, res.device_share_rollout)
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.placement, bundle),
                **({"num_gpus": share} if res.device == "cuda" else {"resources": res.worker_resources(share)})}

    def _start_rewards(self) -> None:
        from mm_rl.rewards.worker import RewardPool
        from mm_rl.trainer.runtime import REWARD_CPUS

        self.rewards = RewardPool(self.job.backend_config.rl_config.reward, num_cpus=REWARD_CPUS)

    # ------------------------------------------------------------------------------------------- helpers
    def requests(self, indices: Sequence[int], split: str = "train") -> list[Any]:
        """Rollout requests of data-set rows (train items are kept for the step's micro-batches)."""
        from mm_rl.rollout.base import RolloutRequest

        dataset = self.train_set if split == "train" else self.val_set
        items = self._load(dataset, indices)
        if split == "train":
            self.items.update(zip(indices, items, strict=True))
        return [RolloutRequest.from_item(item) for item in items]

    def _load(self, dataset: Any, indices: Sequence[int]) -> list[Any]:
        """Decode and process the rows (images, pixels), with ``num-workers`` threads when asked."""
        workers = self.job.backend_config.training.num_workers
        if workers <= 0:
            return [dataset[i] for i in indices]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(dataset.__getitem__, indices))

    def decode(self, responses: Sequence[Sequence[int]]) -> list[str]:
        return self.processor.tokenizer.batch_decode([list(r) for r in responses], skip_special_tokens=True)

    def check_checkpoint_grid(self, step: int) -> None:
        """A checkpoint must have this job's TP x PP (a different layout needs mg2hf + hf2mg first)."""
        import json

        from mm_rl.convert.layout import iteration_name
        from mm_rl.trainer.checkpoint import COMPLETE, CheckpointError

        marker = json.loads((self.checkpoints.save_dir / iteration_name(step) / COMPLETE).read_text())
        spec = self.actor.spec
        if (marker["tp"], marker["pp"]) != (spec.tp, spec.pp):
            raise CheckpointError(
                f"checkpoint step {step} in {self.checkpoints.save_dir} has TP {marker['tp']} x PP {marker['pp']} "
                f"but the job runs TP {spec.tp} x PP {spec.pp}: resume with the same layout, or convert it "
                "(convert mg2hf, then train from that HF checkpoint), or set megatron_training.resume_mode: disable")

    def close(self, graceful: bool = True) -> None:
        """End every role (a failed run skips the ranks' group teardown: a dead rank would block it)."""
        import ray

        for group in (self.ref, self.actor):
            if group is not None:
                try:
                    group.shutdown(graceful)
                except Exception as error:  # noqa: BLE001 - teardown goes on; the run's own error matters more
                    logger.warning("shutting down the %s group: %s", group.role, error)
        if self.rollout is not None:
            with contextlib.suppress(Exception):  # best effort: the engine may be what failed
                ray.get(self.rollout.close.remote(), timeout=60)
            ray.kill(self.rollout)
        if self.rewards is not None:
            self.rewards.shutdown()
        if self.placement is not None and ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.placement)
        self.actor = self.ref = self.rollout = self.rewards = self.placement = None


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def vision_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the vision special tokens the tokenizer knows (a response must not carry them, see Sample)."""
    unknown = tokenizer.unk_token_id
    ids = (tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS)
    return frozenset(int(i) for i in ids if i is not None and i != unknown)


@contextlib.contextmanager
def _named(role: str) -> Iterator[None]:
    """A Ray failure inside the block is raised as a WorkerError naming ``role`` (one line, the cause chained)."""
    import ray

    from mm_rl.workers.group import WorkerError, error_line

    try:
        yield
    except ray.exceptions.RayError as error:
        raise WorkerError(f"{role} failed: {error_line(error)}") from error
