"""The job's topology in one place: devices, the actor's rank grid, the rollout engine's devices, thread budgets.

Every other module asks here: validation (GBS multiple of MBS x DP, devices left for the actor), the planner
(per-rank memory, candidate layouts), the Ray placement (bundles, thread counts) and the workers (a CPU
reservation's thread count). The grid is megatron's: ``world = TP x CP x PP x DP`` actor ranks, on every device
of the cluster except those a separate rollout engine holds.
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
    rollout_devices: int = 0  # a separate engine's whole devices (0: colocated, or on CPU)
    rollout_overlaps: bool = False  # the engine generates while the actor trains (one-step-off-policy)

    @property
    def world_size(self) -> int:
        """The actor's ranks: every device of the cluster but those of a separate rollout engine."""
        return self.nodes * self.devices_per_node - self.rollout_devices

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the actor (at least one, for layouts that validation then rejects)."""
        return max(1, self.world_size // (self.tp * self.pp * self.cp))

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
        beside = (self.engine_threads(cores) or 0) if self.rollout_overlaps else 0
        return max(1, (cores - beside) // max(self.world_size, 1))

    def engine_threads(self, cores: int | None = None) -> int | None:
        """torch threads of the rollout engine: on CPU every core when the rollout phase runs alone, half of them
        when it generates beside the training ranks; on accelerators what Ray assigns it (None)."""
        cores = cores or os.cpu_count() or 1
        if self.device != "cpu":
            return None
        return max(1, cores // 2) if self.rollout_overlaps else cores


def topology(cfg: JobConfig) -> Topology:
    """The topology the job's yaml describes."""
    env, b = cfg.env, cfg.backend_config
    g, t = b.generate_config, b.training
    rollout = 0 if g.colocate or env.DEVICE == "cpu" else g.infer_tensor_parallel_size
    return Topology(device=env.DEVICE, nodes=env.NNODES, devices_per_node=env.NPROC_PER_NODE,
                    tp=t.tensor_model_parallel_size, pp=t.pipeline_model_parallel_size, cp=t.context_parallel_size,
                    rollout_devices=rollout, rollout_overlaps=b.rl_config.one_step_off_policy)


def threads_for(cpus: float) -> int:
    """torch threads for a CPU reservation of ``cpus`` (fractions allowed; at least one)."""
    return max(1, math.floor(cpus))
