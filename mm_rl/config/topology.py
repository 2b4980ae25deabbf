"""The job's topology in one place: devices, the actor's rank grid, the rollout engine's devices, thread budgets.

Every other module asks here: validation (GBS multiple of MBS x DP, devices left for the actor), the planner
(per-rank memory, candidate layouts), the Ray placement (bundles, thread counts) and the workers (a CPU
reservation's thread count). The grid is megatron's: ``world = TP x CP x PP x DP`` actor ranks, on every device
of the cluster except those the separate rollout engine replicas hold.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mm_rl.config.schema import JobConfig


@dataclass(frozen=True)
class Topology:
    """Where a job's ranks and engine run (see the module docstring)."""

    device: str  # npu | cuda | cpu
    nodes: int
    devices_per_node: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    rollout_devices: int = 0  # the separate engine replicas' whole devices (0: colocated, or on CPU)
    rollout_overlaps: bool = False  # the engine generates while the actor trains (one-step-off-policy)
    rollout_replicas: int = 1  # engine replicas (colocated: replica r on the devices of actor ranks r*k .. r*k+k-1)

    @property
    def world_size(self) -> int:
        """The actor's ranks: every device of the cluster but those of a separate rollout engine."""
        return self.nodes * self.devices_per_node - self.rollout_devices

    @property
    def model_parallel(self) -> int:
        """Ranks holding one copy of the model: TP x PP x CP."""
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the actor (at least one, for layouts that validation then rejects)."""
        return max(1, self.world_size // self.model_parallel)

    def with_layout(self, tp: int, pp: int) -> Topology:
        """The same cluster with another model-parallel layout (the planner's candidates)."""
        return dataclasses.replace(self, tp=tp, pp=pp)

    def rank_threads(self, cores: int | None = None) -> int:
        """torch threads of one training rank on a node of ``cores`` cores: the ranks of a CPU job split the
        machine (what the engine does not take while it generates beside them); on accelerators each rank keeps
        half its share for the engine's and the loaders' threads."""
        cores = cores or os.cpu_count() or 1
        if self.device != "cpu":
            return max(1, cores // max(self.world_size, 1) // 2)
        beside = (self.engine_threads(cores) or 0) * self.rollout_replicas if self.rollout_overlaps else 0
        return max(1, (cores - beside) // max(self.world_size, 1))

    def engine_threads(self, cores: int | None = None) -> int | None:
        """torch threads of one rollout engine replica: on CPU the replicas split every core when the rollout phase
        runs alone, half of them when they generate beside the training ranks; on accelerators what Ray assigns
        (None)."""
        cores = cores or os.cpu_count() or 1
        if self.device != "cpu":
            return None
        return max(1, (max(1, cores // 2) if self.rollout_overlaps else cores) // self.rollout_replicas)


def topology(cfg: JobConfig) -> Topology:
    """The topology the job's yaml describes."""
    env, b = cfg.env, cfg.backend_config
    g, t = b.generate_config, b.training
    replicas = engine_replicas(cfg)
    rollout = 0 if g.colocate or env.DEVICE == "cpu" else replicas * g.infer_tensor_parallel_size
    return Topology(
        device=env.DEVICE,
        nodes=env.NNODES,
        devices_per_node=env.NPROC_PER_NODE,
        tp=t.tensor_model_parallel_size,
        pp=t.pipeline_model_parallel_size,
        cp=t.context_parallel_size,
        rollout_devices=rollout,
        rollout_overlaps=b.rl_config.one_step_off_policy,
        rollout_replicas=replicas,
    )


def engine_replicas(cfg: JobConfig) -> int:
    """``generate_config.replicas``, its default (0) resolved: colocated on accelerators one engine on every
    ``infer_tensor_parallel_size`` devices (every device generates, as verl's and MindSpeed-RL's rollout workers
    do), separate one, on CPU one (replicas there only split the same cores)."""
    g, env = cfg.backend_config.generate_config, cfg.env
    if g.replicas > 0:
        return g.replicas
    if env.DEVICE == "cpu" or not g.colocate:
        return 1
    return max(1, env.NNODES * env.NPROC_PER_NODE // max(1, g.infer_tensor_parallel_size))


def threads_for(cpus: float) -> int:
    """torch threads for a CPU reservation of ``cpus`` (fractions allowed; at least one)."""
    return max(1, math.floor(cpus))
