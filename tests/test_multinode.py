"""The tiny job across Ray nodes: ``env.NNODES=2 env.NPROC_PER_NODE=1`` on a multi-node cluster made on this
machine with ``ray.cluster_utils.Cluster``, joined through ``env.RAY_ADDRESS``. One GRPO step, hf2mg -> GRPO ->
mg2hf, must succeed with actor rank 0 and rank 1 (data-parallel replicas, gloo between them) on two different
nodes, and each colocated reference rank beside its actor rank.

Why four nodes of one CPU each: the job's placement group (one ``{"CPU": 1}`` bundle per rank) is PACKed onto
as few nodes as possible, so no node may hold two bundles (Ray wants whole CPUs per node), while the rollout
engine (``ROLLOUT_CPUS`` = 1) and the reward worker (``REWARD_CPUS`` = 0.25) still need room beside them: the
bundles fill two nodes, the engine a third, the reward worker takes a share of the fourth. The roles ask for
what they ask in a real run; nothing is patched but a probe of where the ranks run.
"""

import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from mp_utils import free_port
from trainer_utils import write_job

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
SHORT_RUN = [
    "env.NNODES=2",
    "env.NPROC_PER_NODE=1",
    "backend_config.megatron_training.train_iters=1",
    "backend_config.rl_config.rollout_batch_size=2",
    "backend_config.megatron_training.global_batch_size=16",
    "backend_config.generate_config.sampling_config.max_tokens=16",
]
NODE_CPUS = (1, 1, 1, 1)  # the head first
OBJECT_STORE = 200 * 1024 * 1024


@pytest.fixture(scope="module")
def cluster():
    """Four raylets on this machine. ``RAY_TMPDIR`` keeps the cluster's files, and the ``ray_current_cluster``
    file Cluster writes, out of /tmp/ray: a bare ``ray.init()`` of another Ray user on the machine must not
    find this cluster. No fixed port is taken (the dashboard agent's default one included)."""
    import ray
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="raymn_", dir="/tmp")  # short: Ray's socket paths live under it
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_TMPDIR", temp_dir)
        patch.delenv("RAY_ADDRESS", raising=False)
        nodes = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": NODE_CPUS[0],
                "include_dashboard": False,
                "dashboard_agent_listen_port": free_port(),
                "object_store_memory": OBJECT_STORE,
            },
        )
        try:
            for cpus in NODE_CPUS[1:]:
                nodes.add_node(num_cpus=cpus, object_store_memory=OBJECT_STORE)
            nodes.wait_for_nodes()
            yield nodes
        finally:
            ray.shutdown()
            nodes.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


def test_job_ranks_run_on_two_nodes(cluster, tiny_base, tmp_path, monkeypatch):
    import ray

    from mm_rl.config.loader import load_job
    from mm_rl.job.run import run_job
    from mm_rl.job.validate import validate
    from mm_rl.trainer import grpo
    from mm_rl.workers.megatron_worker import MegatronWorker

    where: dict[str, list[str]] = {}
    fit = grpo.GRPOTrainer.fit

    def fit_and_locate(self):  # where the job's own ranks run, asked before its step
        where["actor"] = self.roles.actor.run(MegatronWorker.node_id)
        where["reference"] = self.roles.ref.run(MegatronWorker.node_id)
        where["alive"] = [n["NodeID"] for n in ray.nodes() if n["Alive"]]  # the job disconnects when it ends
        return fit(self)

    monkeypatch.setattr(grpo.GRPOTrainer, "fit", fit_and_locate)
    job = load_job(write_job(tiny_base, tmp_path), [*SHORT_RUN, f"env.RAY_ADDRESS={cluster.address}"])
    assert validate(job) == []
    lines: list[str] = []
    result = run_job(job, report=lines.append)
    output = "\n".join(lines)

    node_ids = {cluster.head_node.node_id, *(node.node_id for node in cluster.worker_nodes)}
    assert set(where["alive"]) == node_ids
    assert f"ray: Ray cluster at {cluster.address}" in output
    assert "DP 2" in output, output
    assert len(where["actor"]) == 2 and len(set(where["actor"])) == 2, where
    assert set(where["actor"]) <= node_ids
    assert where["reference"] == where["actor"], where  # colocated: reference rank i shares actor bundle i
    assert re.search(r"^step 1/1 \| reward", output, re.MULTILINE), output
    assert (result.hf_dir / "config.json").is_file()
