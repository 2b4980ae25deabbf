"""The weight sync from the Megatron actor into the rollout engines, split by the process each part runs in.

- ``sender``: runs on the actor's ranks (TP gather, vocab un-padding, HF names, buckets, push).
- ``driver``: runs in the trainer's process (join the transports, start a sync, its report).
- ``transport``: how buckets travel (Ray's object store, or a device collective), both ends.
- ``buckets``: how tensors are cut into buckets and how a receiver knows a layer is complete.

Nothing here imports a rollout engine or a worker: the workers and the engines import these modules.
"""
