"""Ray actors hosting the Megatron side of GRPO.

- ``megatron_worker``: :class:`~mm_rl.workers.megatron_worker.MegatronWorker`, ONE Megatron rank (TP x PP x DP
  grid position) as a plain class that Ray turns into an actor. It joins the torch.distributed group (gloo on
  CPU, nccl / hccl on accelerators), initialises megatron's parallel state, builds and loads its stage of
  the model, computes log-probs through the pipeline schedule, exports its weights for the sync into the rollout
  engine, and switches its memory for colocated rollouts (offload / onload). The trainer extends it with the
  optimizer and the update step.
- ``group``: :class:`~mm_rl.workers.group.WorkerGroup`, the grid of those actors on one placement group, with
  the rendezvous (address and free port from rank 0) and fan-out calls.

The sync itself (gather TP shards, merge, rename, bucket, transport) lives in :mod:`mm_rl.sync`.
Nothing heavy is imported here.
"""
