"""Engine replicas: the split of a batch's prompts, the seeds, the merge back, the config and placement they get,
and a dead replica named in the error. (Weights reaching every replica: tests/test_weight_sync.py; a job with two
vLLM replicas: tests/test_trainer.py.)"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from ray_utils import kill_and_wait

from mm_rl.config.loader import load_job
from mm_rl.config.topology import topology
from mm_rl.job.validate import validate
from mm_rl.rollout.base import (
    BatchTiming,
    RolloutMetrics,
    RolloutOutput,
    RolloutOutputs,
    RolloutRequest,
    RolloutSample,
    SamplingSpec,
)
from mm_rl.rollout.replicas import merge_outputs, replica_seed, split_requests

GEN = "backend_config.generate_config"
SPEC = SamplingSpec(max_tokens=8, n=4)


def _requests(lengths: list[int]) -> list[RolloutRequest]:
    return [RolloutRequest(prompt_ids=list(range(length)), uid=index) for index, length in enumerate(lengths)]


def _outputs(requests: list[RolloutRequest], wall_s: float) -> RolloutOutputs:
    """What an engine answers: one sample per request echoing its uid, counted in the metrics."""
    timing = BatchTiming(wall_s, len(requests))
    outputs = [
        RolloutOutput(r.prompt_ids, [RolloutSample([int(r.uid)], torch.zeros(1), "stop")], timing, r.uid)
        for r in requests
    ]
    return RolloutOutputs(
        outputs,
        RolloutMetrics(prompts=len(requests), samples=len(requests), generated_tokens=len(requests), wall_s=wall_s),
    )


def test_prompts_are_split_whole_and_balanced_by_expected_tokens():
    lengths = [100, 10, 10, 10, 10, 10, 10, 60, 40]
    requests = _requests(lengths)
    shares = split_requests(requests, SPEC, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))  # each prompt once, whole
    assert all(share == sorted(share) for share in shares)  # request order inside a share
    load = [sum(lengths[i] + SPEC.n * SPEC.max_tokens for i in share) for share in shares]
    assert max(load) - min(load) <= max(lengths) + SPEC.n * SPEC.max_tokens  # greedy: within one request
    assert abs(load[0] - load[1]) < 40 + SPEC.n * SPEC.max_tokens  # not just a count split: 100 + 60 are apart
    assert not set(shares[0]) >= {0, 7}
    assert split_requests(requests, SPEC, 2) == shares  # deterministic: a resumed run splits alike
    assert split_requests(requests[:1], SPEC, 3) == [[0], [], []]  # fewer prompts than replicas
    assert split_requests(requests, SPEC, 1) == [list(range(len(lengths)))]
    with pytest.raises(ValueError, match="at least 1"):
        split_requests(requests, SPEC, 0)


def test_replica_seeds_differ_and_replica_zero_keeps_the_batch_seed():
    seeds = [replica_seed(1234, replica) for replica in range(8)]
    assert seeds[0] == 1234 and len(set(seeds)) == 8 and all(0 <= s < 2**31 - 1 for s in seeds)
    assert replica_seed(1235, 1) != seeds[1]


def test_outputs_come_back_in_request_order_with_their_replica_and_summed_counts():
    requests = _requests([5, 9, 7, 3, 8])
    shares = [[1, 3], [], [0, 2, 4]]
    merged = merge_outputs(
        shares, [_outputs([requests[i] for i in shares[0]], 2.0), None, _outputs([requests[i] for i in shares[2]], 1.0)]
    )
    assert [o.uid for o in merged] == list(range(5))
    assert [o.samples[0].response_ids for o in merged] == [[i] for i in range(5)]
    assert [o.replica for o in merged] == [2, 0, 2, 0, 2]
    m = merged.metrics
    assert (m.prompts, m.samples, m.generated_tokens, m.wall_s) == (5, 5, 5, 2.0)  # wall: the slowest replica
    assert (m.replicas, m.replica_prompts_min, m.replica_wall_spread) == (3, 0, 2.0)
    with pytest.raises(RuntimeError, match="rollout engine 0 answered 1 of its 2 prompts"):
        merge_outputs(shares, [_outputs([requests[1]], 1.0), None, _outputs([requests[0]] * 3, 1.0)])


@pytest.mark.parametrize(
    "overrides, replicas, rollout_devices, world",
    [
        (("env.DEVICE=npu", "env.NPROC_PER_NODE=8"), 8, 0, 8),  # colocated default: one beside every device
        (("env.DEVICE=npu", "env.NPROC_PER_NODE=8", f"{GEN}.replicas=2"), 2, 0, 8),
        (("env.DEVICE=cuda", "env.NPROC_PER_NODE=8", f"{GEN}.infer_tensor_parallel_size=2"), 4, 0, 8),  # TP2 pairs
        (
            (
                "env.DEVICE=cuda",
                "env.NPROC_PER_NODE=8",
                f"{GEN}.colocate=false",
                f"{GEN}.infer_tensor_parallel_size=2",
                f"{GEN}.replicas=2",
            ),
            2,
            4,
            4,
        ),  # separate: replicas x engine TP devices of their own
        (("env.DEVICE=cuda", "env.NPROC_PER_NODE=8", f"{GEN}.colocate=false"), 1, 1, 7),
        (("env.NPROC_PER_NODE=2",), 1, 0, 2),  # CPU default: one (more would only split the same cores)
        (("env.NPROC_PER_NODE=2", f"{GEN}.replicas=2"), 2, 0, 2),
    ],
)
def test_replicas_resolve_to_devices(overrides, replicas, rollout_devices, world):
    topo = topology(load_job(None, [f"--{o}" for o in overrides]))
    assert (topo.rollout_replicas, topo.rollout_devices, topo.world_size) == (replicas, rollout_devices, world)


def test_cpu_replicas_split_the_engine_cores():
    topo = topology(load_job(None, [f"--{GEN}.replicas=2"]))
    assert topo.engine_threads(cores=8) == 4 and topo.engine_threads(cores=2) == 1


@pytest.mark.parametrize(
    "overrides, key",
    [
        ((f"{GEN}.replicas=-1",), f"{GEN}.replicas"),
        (("env.DEVICE=npu", "env.NPROC_PER_NODE=4", f"{GEN}.replicas=5"), f"{GEN}.replicas"),
        (
            ("env.DEVICE=npu", "env.NPROC_PER_NODE=4", f"{GEN}.infer_tensor_parallel_size=2", f"{GEN}.replicas=3"),
            f"{GEN}.replicas",
        ),  # 3 replicas x 2 devices > 4
        (
            ("env.DEVICE=cuda", "env.NPROC_PER_NODE=8", f"{GEN}.infer_tensor_parallel_size=3"),
            f"{GEN}.infer_tensor_parallel_size",
        ),  # a node's 8 devices do not split into colocated TP3 engines
        (("env.DEVICE=npu", "env.NPROC_PER_NODE=4", f"{GEN}.colocate=false", f"{GEN}.replicas=4"), f"{GEN}.colocate"),
    ],
)
def test_replicas_that_do_not_fit_are_rejected(overrides, key):
    problems = validate(load_job(None, [f"--{o}" for o in overrides]), check_paths=False)
    assert key in {p.key for p in problems}, problems


def test_colocated_tp2_replicas_see_their_actor_ranks_devices():
    """Colocated engine TP 2 on 4 devices of one node (Ray gave the ranks GPUs 3, 1, 0, 2): replica 0 sees the
    devices of ranks 0 and 1, replica 1 those of ranks 2 and 3 (so vLLM's two TP workers land beside them); ranks
    of one replica on two nodes are refused; a replica of one worker, or of devices of its own, sets nothing."""
    from mm_rl.trainer.runtime import EngineSlot, engine_visible_devices

    placements = [("node-a", "3"), ("node-a", "1"), ("node-a", "0"), ("node-a", "2")]
    slots = [EngineSlot(0, 0.4, range(0, 2)), EngineSlot(2, 0.4, range(2, 4))]
    assert engine_visible_devices(placements, slots, "cuda") == [
        {"CUDA_VISIBLE_DEVICES": "3,1"},
        {"CUDA_VISIBLE_DEVICES": "0,2"},
    ]
    assert engine_visible_devices(placements[:2], slots[:1], "npu") == [{"ASCEND_RT_VISIBLE_DEVICES": "3,1"}]
    assert engine_visible_devices(
        placements, [EngineSlot(0, 0.4, range(0, 1)), EngineSlot(4, 2.0, range(0))], "cuda"
    ) == [{}, {}]
    with pytest.raises(RuntimeError, match="ranks 0..1 on different nodes"):
        engine_visible_devices([("node-a", "0"), ("node-b", "0")], slots[:1], "cuda")


def test_separate_replicas_get_a_bundle_each():
    from mm_rl.trainer.runtime import EngineSlot, plan_placement, plan_resources

    job = load_job(
        None,
        [
            "--env.DEVICE=cuda",
            "--env.NPROC_PER_NODE=8",
            f"--{GEN}.colocate=false",
            f"--{GEN}.infer_tensor_parallel_size=2",
            f"--{GEN}.replicas=3",
        ],
    )
    resources = plan_resources(job)
    assert (resources.world_size, resources.rollout_replicas) == (2, 3)
    assert resources.rollout_bundle() == {"CPU": 1.0, "GPU": 2.0}
    plan = plan_placement(resources, ["a"] * 5, inner=1, engine_tp=2)
    assert plan.engines == (EngineSlot(2, 2.0, range(0)), EngineSlot(3, 2.0, range(0)), EngineSlot(4, 2.0, range(0)))
    assert plan.shared_bundles is None  # the ranks offload nothing for an engine on other devices


def test_the_placement_plan_puts_colocated_replicas_beside_their_ranks():
    """4 ranks on two nodes (bundles 0, 2 on node a; 1, 3 on node b) with TP 2: ranks take bundles in node order,
    TP pairs inside a node; colocated engine replicas of TP 2 sit on the devices of ranks (0, 1) and (2, 3), so every
    bundle is shared (None); one replica of TP 2 shares only its two ranks' bundles, which alone offload."""
    from mm_rl.trainer.runtime import EngineSlot, Resources, plan_placement

    resources = Resources(
        device="cuda",
        world_size=4,
        bundle_cpus=1.0,
        actor_share=1.0,
        ref_share=1.0,
        device_share_actor=0.6,
        device_share_ref=0.4,
        device_share_rollout=0.4,
        threads=1,
        rollout_replicas=2,
    )
    nodes = ["a", "b", "a", "b"]
    plan = plan_placement(resources, nodes, inner=2, engine_tp=2)
    assert plan.rank_bundles == (0, 2, 1, 3)
    assert plan.engines == (EngineSlot(0, 0.4, range(0, 2)), EngineSlot(1, 0.4, range(2, 4)))
    assert plan.shared_bundles is None
    one = plan_placement(dataclasses.replace(resources, rollout_replicas=1), nodes, inner=2, engine_tp=2)
    assert one.engines == (EngineSlot(0, 0.4, range(0, 2)),) and one.shared_bundles == {0, 2}
    on_cpu = plan_placement(dataclasses.replace(resources, device="cpu"), nodes, inner=2, engine_tp=1)
    assert on_cpu.engines == (EngineSlot(None, 0.0, range(0)),) * 2 and on_cpu.shared_bundles is None


class _Engine:
    """Stands in for a rollout worker actor in the failure test: echoes its share."""

    def ready(self) -> bool:
        return True

    def generate(self, requests: list[RolloutRequest], sampling: SamplingSpec, seed: int) -> RolloutOutputs:
        return _outputs(requests, 0.1)


def test_a_dead_replica_is_named_in_the_error():
    import ray
    import ray.cloudpickle

    from mm_rl.trainer.ray_roles import RayEngines
    from mm_rl.workers.group import WorkerError

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        engines = RayEngines([ray.remote(num_cpus=0.1)(_Engine).remote() for _ in range(2)])
        requests = _requests([4, 4, 4, 4])
        merged = engines.generate(requests, SPEC, 7).result()
        assert [o.uid for o in merged] == [0, 1, 2, 3] and {o.replica for o in merged} == {0, 1}
        kill_and_wait(ray, engines.actors[1], "ready")
        with pytest.raises(WorkerError, match="^rollout engine 1 failed"):
            engines.generate(requests, SPEC, 7).result()
    finally:
        ray.shutdown()
