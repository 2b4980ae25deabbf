"""Where the job's processes run: the Ray connection, the placement group and the roles' resources.

One placement group holds a bundle per actor device (on CPU a bundle per training process), packed onto as few
nodes as possible. Actor rank ``i`` runs in bundle ``i``; the reference model, when colocated, takes a share of
the same bundle (same device), otherwise gets its own group. The rollout engine, colocated, sits in bundle 0
beside actor rank 0 (it sleeps while the actor trains); separate (``generate_config.colocate: false`` on
accelerators), it gets one more bundle of ``infer_tensor_parallel_size`` whole devices, taken from the cluster's
``NNODES x NPROC_PER_NODE``. Reward workers take small CPU shares outside the group.

Ray: ``env.RAY_ADDRESS`` (or the ``RAY_ADDRESS`` environment variable) joins a running cluster; otherwise a
local one is started with enough logical CPUs for the roles. Workers run at the driver's priority (Ray's
default ``nice 15`` made every worker lose to anything else on a shared machine).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from mm_rl.config.schema import JobConfig

logger = logging.getLogger(__name__)

DEVICE_RESOURCE = {"cuda": "GPU", "npu": "NPU", "cpu": None}
ROLLOUT_CPUS = 1.0
# Warnings every worker would repeat at start-up about optional kernels (none of them changes a result).
QUIET_WARNINGS = ",".join(["ignore::FutureWarning", "ignore:Transformer Engine and Apex:UserWarning",
                           "ignore:Apex is not installed:UserWarning", "ignore:full scope is deprecated:UserWarning"])
REWARD_CPUS = 0.25


@dataclass(frozen=True)
class Resources:
    """What each role asks of its bundle (device shares are fractions of one device)."""

    device: str  # npu | cuda | cpu
    world_size: int
    bundle_cpus: float
    actor_share: float  # CPUs (CPU) of the bundle taken by the actor rank
    ref_share: float
    device_share_actor: float  # fraction of the bundle's device (accelerators)
    device_share_ref: float
    device_share_rollout: float  # colocated engine: its fraction of actor rank 0's device
    threads: int  # torch threads of a training rank (phases run one after the other)
    rollout_devices: int = 0  # separate engine: whole devices in a bundle of its own (index world_size)

    def bundle(self) -> dict[str, float]:
        resource = DEVICE_RESOURCE[self.device]
        return {"CPU": self.bundle_cpus} | ({resource: 1.0} if resource else {})

    def rollout_bundle(self) -> dict[str, float]:
        """A separate engine's bundle: its devices and the CPU of its process."""
        return {"CPU": ROLLOUT_CPUS} | self.worker_resources(float(self.rollout_devices))

    def worker_resources(self, share: float) -> dict[str, float]:
        resource = DEVICE_RESOURCE[self.device]
        return {resource: share} if resource else {}


def plan_resources(job: JobConfig) -> Resources:
    """Bundle sizes for the job: one per device; the actor and a colocated reference split it."""
    from mm_rl.config.topology import topology

    topo = topology(job)
    colocated = job.backend_config.rl_config.colocate_ref
    return Resources(device=topo.device, world_size=topo.world_size, bundle_cpus=1.0,
                     actor_share=0.5 if colocated else 1.0, ref_share=0.5 if colocated else 1.0,
                     device_share_actor=0.4 if colocated else 0.6, device_share_ref=0.2 if colocated else 0.4,
                     device_share_rollout=0.4, threads=topo.rank_threads(), rollout_devices=topo.rollout_devices)


def logical_cpus(resources: Resources, reward_workers: int) -> int:
    """Logical CPUs a local Ray cluster needs to place every role (at least the machine's cores)."""
    needed = resources.world_size * resources.bundle_cpus * 2 + ROLLOUT_CPUS + reward_workers * REWARD_CPUS
    return max(os.cpu_count() or 1, int(needed + 0.999))


def connect(job: JobConfig, resources: Resources) -> str:
    """Join the configured Ray cluster or start a local one; returns where it runs."""
    import ray

    if ray.is_initialized():
        return "the Ray cluster this process already joined"
    address = job.env.RAY_ADDRESS or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                                # the per-step lines are the progress report; the engines' INFO lines would bury them
                                "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                                "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", QUIET_WARNINGS)}}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return f"Ray cluster at {address}"
    cpus = logical_cpus(resources, job.backend_config.rl_config.reward.num_workers)
    ray.init(num_cpus=cpus, include_dashboard=False, runtime_env=runtime_env, log_to_driver=True,
             _system_config={"worker_niceness": os.getpriority(os.PRIO_PROCESS, 0)})
    return f"a local Ray instance ({cpus} logical CPUs)"


def make_placement(resources: Resources, with_rollout: bool = False) -> Any:
    """The placement group of the training ranks (one bundle each; then a separate engine's bundle when
    ``with_rollout``), ready."""
    import ray
    from ray.util.placement_group import placement_group

    bundles = [resources.bundle()] * resources.world_size
    if with_rollout and resources.rollout_devices:
        bundles.append(resources.rollout_bundle())
    group = placement_group(bundles, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=600)
    except ray.exceptions.GetTimeoutError as error:
        raise RuntimeError(f"Ray could not place the bundles {bundles} within 10 "
                           "minutes: does the cluster have that many devices (see `ray status`), and did each "
                           "node start with its device resource (ray start --resources)?") from error
    return group
