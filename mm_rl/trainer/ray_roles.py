"""The GRPO job's roles on a Ray cluster: actor and reference ranks, the rollout engine, reward workers, weight sync.

:class:`RayRoles` implements :class:`mm_rl.trainer.roles.Roles`: it starts Ray (or joins the cluster), places
every role (``mm_rl.trainer.runtime``), and keeps every Ray call behind one of its methods. A failure of any role
(a dead rank, engine or reward worker) reaches the trainer as a ``WorkerError`` naming that role, one line with
Ray's error chained. ``close`` ends the roles and the Ray connection however the run ends (an exception or Ctrl-C
in start-up included): the actors and placement groups it made are removed and a local Ray it started is stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mm_rl.config.schema import JobConfig
from mm_rl.trainer.roles import MicroBatches, Role, RolloutReady
from mm_rl.trainer.runtime import (
    ROLLOUT_CPUS,
    Connection,
    PlacementPlan,
    connect,
    make_placement,
    plan_placement,
    plan_resources,
)

if TYPE_CHECKING:
    import torch

    from mm_rl.platform.transfer import StepImages
    from mm_rl.rewards.worker import RewardResult
    from mm_rl.rollout.base import RolloutOutputs, RolloutRequest, SamplingSpec
    from mm_rl.workers.megatron_worker import WorkerSpec
    from mm_rl.workers.training import LossSpec, OptimizerSpec

logger = logging.getLogger(__name__)


class RayRoles:
    """Starts every role of the job; ``close`` ends them. ``report`` receives the start-up lines for the user;
    ``before_roles`` runs once Ray is up, before any role starts (the job's own preparation, which may fail)."""

    def __init__(
        self,
        job: JobConfig,
        mm_dir: Path,
        report: Callable[[str], None],
        before_roles: Callable[[], object] = lambda: None,
    ) -> None:
        self.job, self.report = job, report
        self.actor: Any = None
        self.ref: Any = None
        self.engines = RayEngines([])
        self.rewards: Any = None
        self.placement: Any = None
        self.schedule: Any = None
        self.connection: Connection | None = None
        self.vision_from: Role | None = None  # the role whose ranks encoded this step's images first
        self.vision_given: set[Role] = set()
        try:
            self._start(mm_dir, before_roles)
        except BaseException:
            self.close(graceful=False)
            raise

    @property
    def has_reference(self) -> bool:
        return self.ref is not None or self._reference_is_actor()

    def _reference_is_actor(self) -> bool:
        """LoRA: the reference is the actor with its adapters off (no second copy of the weights), unless the
        config asks for a separate one; only where a KL term needs a reference at all."""
        b = self.job.backend_config
        lora, rl = b.actor_config.lora, b.rl_config
        return lora.enabled and not lora.separate_reference and (rl.use_kl_loss or rl.use_kl_in_reward)

    def _start(self, mm_dir: Path, before_roles: Callable[[], object]) -> None:
        self.resources = plan_resources(self.job)
        self._notices()
        self.connection = connect(self.job, self.resources)
        self.report(f"ray: {self.connection.where}")
        before_roles()
        self.placement = make_placement(self.resources, with_rollout=True, report=self.report)
        self.plan = self._plan()
        # Every role's processes start side by side (a start is mostly imports), and the models are built last:
        # vLLM starts only with gpu_memory_utilization of its device free. On accelerators the engine replicas
        # also wait for the ranks (which fix each rank's device and hold its context): vLLM sizes its KV cache from
        # the device's free memory measured while it starts (vllm/utils/mem_utils.py, MemorySnapshot.measure:
        # device-wide), which another process's start must not move. Colocated replicas then sleep.
        self._start_actor()
        self._start_reference()
        self._start_rewards()
        if self.resources.device != "cpu":
            self._ranks_started()
        self._start_engine()
        self._ranks_started()
        self._build_models(mm_dir)
        self._join_sync()
        with named("reward workers"):
            self.rewards.started()

    def _plan(self) -> PlacementPlan:
        """Where every role runs (ranks' bundles, engine replicas' slots), decided once for the placement group."""
        from mm_rl.config.topology import topology
        from mm_rl.workers.group import bundle_nodes

        topo, tp = topology(self.job), self.job.backend_config.generate_config.infer_tensor_parallel_size
        return plan_placement(self.resources, bundle_nodes(self.placement), topo.tp * topo.cp, tp)

    def _ranks_started(self) -> None:
        for group in (self.actor, self.ref):
            if group is not None:
                group.started()

    def _notices(self) -> None:
        """Flags this device cannot honour are said once, not silently dropped."""
        t, device = self.job.backend_config.training, self.resources.device
        if t.bf16 and device == "cpu":
            self.report("notice: bf16 is for accelerators; on CPU the actor trains in fp32 (oneDNN bf16 is slower)")

    # ------------------------------------------------------------------------------------------- workers
    def worker_spec(self, trained: bool) -> WorkerSpec:
        from mm_rl.config.topology import topology
        from mm_rl.workers.megatron_worker import WorkerSpec

        b, topo = self.job.backend_config, topology(self.job)
        bf16 = b.training.bf16 and topo.device != "cpu"
        return WorkerSpec(
            model=b.model,
            tp=topo.tp,
            pp=topo.pp,
            cp=topo.cp,
            dp=topo.dp,
            ep=b.actor_config.expert_model_parallel_size,
            actor=b.actor_config if trained else None,
            flags=b.training,
            seed=int(b.training.seed),
            bf16=bf16,
            remove_padding=b.actor_config.remove_padding,
        )

    def _start_actor(self) -> None:
        from mm_rl.workers.group import WorkerGroup
        from mm_rl.workers.training import TrainingWorker

        res = self.resources
        spec = self.worker_spec(trained=True)
        self.report(
            f"actor: TP {spec.tp} x PP {spec.pp} x DP {spec.dp}"
            + (f" x CP {spec.cp}" if spec.cp > 1 else "")
            + (f" (EP {spec.ep})" if spec.ep > 1 else "")
            + f" megatron ranks on {res.device}"
        )
        self.actor = WorkerGroup(
            spec,
            cpus_per_worker=res.actor_share,
            placement=self.placement,
            bundles=self.plan.rank_bundles,
            resources_per_worker=res.worker_resources(res.device_share_actor),
            worker_cls=TrainingWorker,
            role="actor",
            num_threads=res.threads,
        )

    def _build_models(self, mm_dir: Path) -> None:
        """The actor's stages (with DDP and the optimizer) and the reference's, loaded from the converted shards."""
        self.actor.build(str(mm_dir))
        self.actor.setup_training(self.optimizer_spec(self.actor.spec.bf16))
        if self.ref is not None:
            self.ref.build(str(mm_dir))

    def optimizer_spec(self, bf16: bool) -> OptimizerSpec:
        from mm_rl.workers.training import OptimizerSpec

        b = self.job.backend_config
        t, rl = b.training, b.rl_config
        total = b.megatron_training.train_iters * rl.updates_per_step
        return OptimizerSpec(
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            clip_grad=t.clip_grad,
            lr_decay_style=t.lr_decay_style,
            warmup_steps=int(t.lr_warmup_fraction * total),
            total_steps=total,
            vision_encoder_lr=b.actor_config.vision_encoder_lr if b.actor_config.unfreeze_vision_encoder else None,
            bf16=bf16,
            use_distributed_optimizer=t.use_distributed_optimizer,
        )

    def _start_reference(self) -> None:
        from mm_rl.workers.group import WorkerGroup

        rl, res = self.job.backend_config.rl_config, self.resources
        if not (rl.use_kl_loss or rl.use_kl_in_reward) or self._reference_is_actor():
            return
        placement = self.placement if rl.colocate_ref else make_placement(res, report=self.report)
        self.ref = WorkerGroup(
            self.worker_spec(trained=False),
            cpus_per_worker=res.ref_share,
            placement=placement,
            bundles=self.plan.rank_bundles if rl.colocate_ref else None,
            resources_per_worker=res.worker_resources(res.device_share_ref),
            role="reference",
            num_threads=res.threads,
        )
        self.ref.owns_placement = not rl.colocate_ref

    def _start_engine(self) -> None:
        import ray

        from mm_rl.config.topology import topology
        from mm_rl.data.video import VideoSettings
        from mm_rl.rollout.engine_worker import rollout_worker_actor
        from mm_rl.rollout.replicas import replica_seed
        from mm_rl.trainer.schedule import RolloutSchedule

        b, res = self.job.backend_config, self.resources
        pre = b.data.dataset_param.preprocess_parameters
        threads = topology(self.job).engine_threads()
        model_path = self._engine_model()
        for replica, devices in enumerate(self._engine_devices()):  # they start side by side
            options = self._engine_placement(replica)
            self.engines.actors.append(
                rollout_worker_actor(num_cpus=ROLLOUT_CPUS if res.device == "cpu" else 0, **options).remote(
                    model_path,
                    b.generate_config,
                    min_pixels=pre.min_pixels,
                    max_pixels=pre.max_pixels,
                    num_threads=threads,
                    seed=replica_seed(int(b.training.seed), replica),
                    visible_devices=devices,
                    synced_first=True,  # before_rollout syncs before every generate, validation's too
                    multi_turn=b.rl_config.multi_turn if b.rl_config.multi_turn.enable else None,
                    video=VideoSettings.from_config(pre),
                )
            )
        for replica, engine in enumerate(self.engines.actors):
            with named(self.engines.name(replica)):  # a start-up failure surfaces here, named
                ray.get(engine.ready.remote())
                if b.rl_config.multi_turn.enable:  # the tool calls run on the reward / tool workers
                    ray.get(engine.connect_tools.remote(self.rewards.tool_executor()))
        # On CPU the engine and the actor share host memory: sleeping and offloading would free nothing.
        schedule = dataclasses.replace(b.generate_config, colocate=b.generate_config.colocate and res.device != "cpu")
        self.schedule = RolloutSchedule(
            self.actor,
            self.engines.actors,
            schedule,
            b.actor_config,
            reference=self.ref if b.rl_config.colocate_ref else None,
            shared_bundles=self.plan.shared_bundles,
            sleep_level=1 if b.actor_config.lora.enabled else 2,  # LoRA: the frozen base stays in the engine
        )
        with named("rollout engines going to sleep"):
            self.schedule.engine_started()
        count = f"{len(self.engines.actors)} x " if len(self.engines.actors) > 1 else ""
        self.report(
            f"rollout: {count}{b.generate_config.backend} engine ready"
            + (f" ({threads} threads each)" if count and threads else "")
        )

    def _engine_model(self) -> str:
        """The engine's model directory: the checkpoint, or, when model.json changes what the checkpoint holds
        (fewer layers, another rope), the same checkpoint as the job's model (``job_model_dir``): the engine must
        sample from the model the actor trains, and the sync only ever sends the job's model's tensors."""
        from mm_rl.convert.hf_writer import job_model_dir

        b = self.job.backend_config
        source = Path(b.data.dataset_param.preprocess_parameters.model_name_or_path)
        path = job_model_dir(source, b.model, Path(self.job.af_output_dir) / "engine_model")
        if path != source:
            self.report(f"rollout: the engine builds the job's model.json ({path}: its config, the kept layers)")
        return str(path)

    def _engine_devices(self) -> list[dict[str, str]]:
        """Per replica, the visible-devices variable its process sets first (:func:`engine_visible_devices`)."""
        from mm_rl.trainer.runtime import engine_visible_devices

        slots = self.plan.engines
        if all(len(slot.ranks) <= 1 for slot in slots):  # nothing to ask the ranks
            return [{}] * len(slots)
        return engine_visible_devices(self.actor.device_placements(), slots, self.resources.device)

    def _join_sync(self) -> None:
        """On accelerators weights go device to device (mm_rl.sync.driver.join_device_sync): a colocated replica
        maps its sender's buffer when they share a device, every other replica receives a broadcast. On CPU Ray's
        shared-memory object store is faster (bench/sync.py)."""
        from mm_rl.sync.driver import join_device_sync

        if self.resources.device != "cpu":
            with named("rollout engines joining the weight sync"):
                self.schedule.route = join_device_sync(self.actor, self.engines.actors)

    def _engine_placement(self, replica: int) -> dict[str, Any]:
        """Ray options of engine replica ``replica``'s actor, from its slot in the plan: separate, a bundle of whole
        devices of its own; colocated, a share of the device of its first actor rank (with engine TP > 1 its other
        workers use its other ranks' devices, :meth:`_engine_devices`); on CPU, none (it runs beside the ranks)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slot, res = self.plan.engines[replica], self.resources
        if slot.bundle is None:
            return {}
        return {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.placement, slot.bundle),
            **({"num_gpus": slot.share} if res.device == "cuda" else {"resources": res.worker_resources(slot.share)}),
        }

    def _start_rewards(self) -> None:
        from mm_rl.rewards.worker import RewardPool
        from mm_rl.trainer.runtime import REWARD_CPUS

        with named("reward workers"):
            rl = self.job.backend_config.rl_config
            tools = rl.multi_turn if rl.multi_turn.enable else None
            self.rewards = RewardPool(rl.reward, num_cpus=REWARD_CPUS, tools=tools)

    # -------------------------------------------------------------------------------- the Roles interface
    def data_parallel_size(self, role: Role) -> int:
        return self._group(role).spec.dp

    def before_rollout(self) -> RolloutReady:
        with named("weight sync into the rollout engine"):
            report = self.schedule.before_rollout()
        return RolloutReady(report, self.schedule.offloaded_bytes if self.schedule.generate.colocate else None)

    def before_training(self) -> None:
        with named("rollout engine going to sleep"):
            self.schedule.before_training()

    def start_generate(self, requests: Sequence[RolloutRequest], sampling: SamplingSpec, seed: int) -> RayRollout:
        return self.engines.generate(requests, sampling, seed)

    def score(self, responses: Sequence[str], truths: Sequence[str]) -> RewardResult:
        with named("reward workers"):
            return self.rewards.score(responses, truths)

    def send_images(self, images: StepImages) -> None:
        import ray

        from mm_rl.platform.transfer import Packed
        from mm_rl.workers.megatron_worker import MegatronWorker

        shared = ray.put(Packed(dict(images)))  # one object-store copy; every rank of both groups reads it
        for group in (self.actor, self.ref):
            if group is not None:  # not waited for: the ranks take them before the step's first pass
                group.start(MegatronWorker.set_images, shared)
        self.vision_from, self.vision_given = None, set()

    def log_probs(self, role: Role, shards: Sequence[MicroBatches], temperature: float) -> list[list[torch.Tensor]]:
        if role == "reference" and self._reference_is_actor():  # the same ranks: their ViT cache serves both
            return self.actor.compute_log_probs_sharded(shards, temperature, adapters=False)
        self._step_vision(role)
        return self._group(role).compute_log_probs_sharded(shards, temperature)

    def train_mini_batch(
        self, shards: Sequence[MicroBatches], loss: LossSpec, denominator: float
    ) -> tuple[dict[str, float], list[list[torch.Tensor] | None]]:
        self.schedule.weights_changed()
        self._step_vision("actor")
        return self.actor.train_mini_batch(shards, loss, denominator)

    def _step_vision(self, role: Role) -> None:
        """Before a pass of ``role``: the frozen-ViT outputs the other role's ranks computed this step go to this
        role's ranks, once per step, rank to rank. The reference's ViT is the checkpoint's, and so is the actor's
        while ``unfreeze_vision_encoder`` is off: the same outputs, which the second role would otherwise compute
        again (the first role to run a pass of the step encodes)."""
        if self.vision_from is None:
            self.vision_from = role
            return
        if role == self.vision_from or role in self.vision_given or self.ref is None:
            return
        if self.job.backend_config.actor_config.trains_vision:
            return
        self._group(role).take_vision_outputs(self._group(self.vision_from))
        self.vision_given.add(role)

    def schedule_lr_at(self, updates: int) -> None:
        self.actor.schedule_lr_at(updates)

    def save(self, staging: Path) -> None:
        self.actor.save_checkpoint(str(staging))

    def load(self, save_dir: Path, step: int, load_optim: bool, load_rng: bool) -> None:
        self.schedule.weights_changed()
        self.actor.load_checkpoint(str(save_dir), step, load_optim, load_rng)

    def _group(self, role: Role) -> Any:
        group = self.actor if role == "actor" or self._reference_is_actor() else self.ref
        if group is None:
            raise RuntimeError(f"the job has no {role} model")
        return group

    def close(self, graceful: bool = True) -> None:
        """End every role, then the Ray connection. A failed run skips the ranks' group teardown (a dead rank would
        block it) and names the worker log, which holds the workers' side of the failure."""
        try:
            self._end_roles(graceful)
        finally:
            connection, self.connection = self.connection, None
            if connection is not None:
                if not graceful and connection.log_file is not None:
                    self.report(f"the engine's and workers' output: {connection.log_file}")
                connection.close()

    def _end_roles(self, graceful: bool) -> None:
        import ray

        for group in (self.ref, self.actor):
            if group is not None:
                try:
                    group.shutdown(graceful)
                except Exception as error:  # noqa: BLE001 - teardown goes on; the run's own error matters more
                    logger.warning("shutting down the %s group: %s", group.role, error)
        if self.engines.actors:
            if self.schedule is not None:  # started (one still starting has nothing to shut down)
                with contextlib.suppress(Exception):  # best effort: an engine may be what failed
                    ray.get([engine.close.remote() for engine in self.engines.actors], timeout=60)
            for engine in self.engines.actors:
                ray.kill(engine)
        if self.rewards is not None:
            self.rewards.shutdown()
        if self.placement is not None and ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.placement)
        self.actor = self.ref = self.rewards = self.placement = None
        self.engines = RayEngines([])


@dataclasses.dataclass
class RayEngines:
    """The rollout engine replicas' actors: a batch split over them (:mod:`mm_rl.rollout.replicas`), and errors
    naming the replica."""

    actors: list[Any]

    def name(self, replica: int) -> str:
        return "rollout engine" + (f" {replica}" if len(self.actors) > 1 else "")

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingSpec, seed: int) -> RayRollout:
        """The prompts split over the replicas by whole groups, each replica reseeded from (seed, replica) first
        (an actor runs one caller's calls in order: the seed precedes the batch); returns at once."""
        from mm_rl.rollout.replicas import replica_seed, split_requests

        shares = split_requests(requests, sampling, len(self.actors))
        calls = [
            engine.generate.remote([requests[i] for i in share], sampling, seed=replica_seed(seed, replica))
            if share
            else None
            for replica, (engine, share) in enumerate(zip(self.actors, shares, strict=True))
        ]
        return RayRollout(shares, calls, [self.name(r) for r in range(len(self.actors))])


@dataclasses.dataclass
class RayRollout:
    """The replicas' generate calls under way (:class:`mm_rl.trainer.roles.PendingRollout`)."""

    shares: list[list[int]]  # the request indices of each replica
    calls: list[Any | None]  # per replica: its generate call (reseeded first), None for an empty share
    names: list[str]  # how errors name each replica

    def result(self) -> RolloutOutputs:
        import ray

        from mm_rl.rollout.replicas import merge_outputs

        results = []
        for name, call in zip(self.names, self.calls, strict=True):
            with named(name):
                results.append(None if call is None else ray.get(call))
        return merge_outputs(self.shares, results)


@contextlib.contextmanager
def named(role: str) -> Iterator[None]:
    """A Ray failure inside the block is raised as a WorkerError naming ``role`` (one line, the cause chained);
    a WorkerError raised deeper (a rank of a group) already names its role and passes unchanged."""
    import ray

    from mm_rl.workers.group import WorkerError, error_line

    try:
        yield
    except ray.exceptions.RayError as error:
        raise WorkerError(f"{role} failed: {error_line(error)}") from error
