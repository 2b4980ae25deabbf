"""What the GRPO loop asks of its deployment: one typed interface, received by the trainer.

:class:`Roles` is the whole surface between the algorithm (``mm_rl.trainer.grpo``) and the processes that do the
heavy work: the rollout engine, the reward function, the actor's and the reference model's Megatron ranks and the
weight sync between them. The trainer never sees Ray; :class:`mm_rl.trainer.ray_roles.RayRoles` is the
deployment on a Ray cluster, and tests drive the loop with a fake of this interface.

Shapes: ``shards`` are one list of micro-batches per data-parallel replica of the role (see
``mm_rl.trainer.batch.micro_batches``); log-probs come back per replica as one ``[B, S]`` tensor per micro-batch,
on the CPU. Micro-batches carry no pixels: they name each row's prompt by ``image_index``, and the step's distinct
prompt images reach the ranks once, through :meth:`Roles.send_images`, before the step's passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from mm_rl.platform.transfer import StepImages
    from mm_rl.rewards.worker import RewardResult
    from mm_rl.rollout.base import RolloutOutputs, RolloutRequest, SamplingSpec
    from mm_rl.sync.driver import SyncReport
    from mm_rl.workers.training import LossSpec

Role = Literal["actor", "reference"]
MicroBatches = list[dict[str, "torch.Tensor"]]


@dataclass
class RolloutReady:
    """What preparing a rollout did: the weight sync's report and, colocated, the bytes the ranks freed."""

    sync: SyncReport
    offloaded_bytes: int | None = None  # None when the engine has devices (or the host) of its own


class PendingRollout(Protocol):
    """A generate call under way."""

    def result(self) -> RolloutOutputs:
        """Wait for the outputs (a failure names the engine)."""
        ...


class Roles(Protocol):
    """The deployment the trainer drives; every call names the failed role in its error (``WorkerError``)."""

    has_reference: bool

    def data_parallel_size(self, role: Role) -> int:
        """How many replicas share a pass of ``role`` (the number of shards it takes)."""
        ...

    def before_rollout(self) -> RolloutReady:
        """The actor's weights into the engine (colocated: engine weights woken, actor offloaded, KV cache woken)."""
        ...

    def before_training(self) -> None:
        """Colocated: the engine sleeps and the actor's state comes back; otherwise nothing."""
        ...

    def start_generate(self, requests: Sequence[RolloutRequest], sampling: SamplingSpec, seed: int) -> PendingRollout:
        """Start n samples per request, the engine's sampler seeded with ``seed`` first (a resumed run repeats);
        returns at once. Engine calls run in the order they were made (a sync after it waits for it)."""
        ...

    def score(self, responses: Sequence[str], truths: Sequence[str]) -> RewardResult: ...

    def send_images(self, images: StepImages) -> None:
        """The step's distinct prompt images (data-set index -> pixel values, grid) to every rank of the actor and
        the reference, once per step before their passes; they replace the previous step's."""
        ...

    def log_probs(self, role: Role, shards: Sequence[MicroBatches], temperature: float) -> list[list[torch.Tensor]]:
        """Log-probs of every micro-batch's labels, per replica (forward only)."""
        ...

    def train_mini_batch(
        self, shards: Sequence[MicroBatches], loss: LossSpec, denominator: float
    ) -> tuple[dict[str, float], list[list[torch.Tensor] | None]]:
        """One optimizer step of the actor over a mini-batch: its metrics reduced over the replicas, and per
        replica the update forward's log-probs of every micro-batch where the shard came without old log-probs
        (exactly on-policy), else None."""
        ...

    def schedule_lr_at(self, updates: int) -> None:
        """Put the actor's LR schedule at ``updates`` optimizer steps (the planned count of the steps done, see
        ``RLConfig.updates_per_step``); the next optimizer step takes its learning rate from there."""
        ...

    def save(self, staging: Path) -> None:
        """Every actor rank writes its checkpoint files into the staging iteration directory."""
        ...

    def load(self, save_dir: Path, step: int, load_optim: bool, load_rng: bool) -> None: ...

    def close(self, graceful: bool = True) -> None: ...
