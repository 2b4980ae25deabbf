"""The TP x PP (x DP) grid of :class:`~mm_rl.workers.megatron_worker.MegatronWorker` actors, called together.

One placement group holds a bundle per rank (packed onto as few nodes as possible), so the ranks start together
and keep their CPUs / devices. Ranks take the bundles in node order (:func:`rank_bundles`): a PACK group does not
number its bundles by node, and megatron's TP (and Ulysses CP) groups, consecutive ranks, must each sit inside one
node, where their collectives run on the intra-node links. Rank 0 reports its node address and a free port; every rank
joins the process group there. ``run`` calls a method on every rank at once, which is what collective methods
need (the pipeline schedule, the TP gathers of the weight sync): calling ranks one by one would deadlock.

A call names the rank's method itself (``group.run(MegatronWorker.build, mm_dir)``), not a string: a type checker
follows it into the rank and checks its arguments, and a rename is a static error. Ray calls it by its name.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

from mm_rl.config.topology import threads_for
from mm_rl.platform.transfer import Packed
from mm_rl.workers.megatron_worker import MegatronWorker, RankCoords, WorkerSpec
from mm_rl.workers.training import TrainingWorker

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")
RankMethod = Callable[Concatenate[Any, P], R]  # a rank class's method, unbound: ``MegatronWorker.build``


class WorkerError(RuntimeError):
    """A rank's call failed (its exception, or its process died); the message names the role, rank and grid spot."""


class WorkerGroup:
    """Megatron ranks as Ray actors; ``cpus_per_worker`` (fractions allowed) is each rank's thread budget too.
    ``resources_per_worker`` adds bundle resources (e.g. ``{"GPU": 1}`` or an NPU resource) on accelerators.
    ``placement``: an existing placement group with one bundle per rank, shared with other groups (the reference
    model colocated with the actor takes a share of the same bundles), and ``bundles`` each rank's bundle in it
    (the job's placement plan); by default the group makes its own and orders its bundles itself
    (:func:`rank_bundles`). ``worker_cls`` is the rank class (:class:`MegatronWorker` or a subclass), ``role``
    names the group in errors; ``num_threads`` overrides the thread budget (ranks whose phases never overlap may
    share cores)."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        cpus_per_worker: float = 1.0,
        resources_per_worker: dict[str, float] | None = None,
        strategy: str = "PACK",
        placement: Any = None,
        bundles: Sequence[int] | None = None,
        worker_cls: type = MegatronWorker,
        role: str = "actor",
        num_threads: int | None = None,
    ) -> None:
        import dataclasses

        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.spec = dataclasses.replace(spec, num_threads=num_threads or threads_for(cpus_per_worker))
        self.role = role
        self.worker_cls = worker_cls
        self.unwaited: list[tuple[list[Any], str]] = []  # calls not waited for (see start)
        extra = dict(resources_per_worker or {})
        self.owns_placement = placement is None
        if placement is None:
            placement = placement_group([{"CPU": cpus_per_worker, **extra}] * spec.world_size, strategy=strategy)
        self.placement = placement
        ray.get(self.placement.ready())
        self.bundles = (
            list(bundles)
            if bundles is not None
            else rank_bundles(bundle_nodes(self.placement)[: spec.world_size], spec.tp * spec.cp)
        )
        actor = ray.remote(worker_cls)
        gpus = extra.pop("GPU", 0)
        self.workers = [
            actor.options(
                num_cpus=cpus_per_worker,
                num_gpus=gpus,
                resources=extra or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, bundle),
            ).remote(self.spec, rank)
            for rank, bundle in enumerate(self.bundles)
        ]
        # The ranks join their process group in the background (Ray hands rank 0's address and port to every
        # rank's call), so the caller can start other roles meanwhile; the group's first call waits for it.
        address, port = self.workers[0].rendezvous_address.options(num_returns=2).remote()
        self._joining = [worker.init_distributed.remote(address, port) for worker in self.workers]
        self.coords: list[RankCoords] = []

    def started(self) -> WorkerGroup:
        """Wait until every rank has joined the process group (a no-op once it has); the group's calls do."""
        if not self.coords:
            self.coords = self._get(self._joining, "init_distributed")
        return self

    def _name(self, method: RankMethod[..., Any]) -> str:
        """The name Ray calls ``method`` by, checked against this group's rank class."""
        name = method.__name__
        if not callable(getattr(self.worker_cls, name, None)):
            raise TypeError(f"{self.role} ranks ({self.worker_cls.__name__}) have no method {name}")
        return name

    def submit(self, method: RankMethod[P, R], *args: P.args, **kwargs: P.kwargs) -> list[Any]:
        """``method(*args, **kwargs)`` started on every rank; returns the object refs in rank order.

        Large arguments are put into the object store once (packed) and shared by all ranks."""
        name = self._name(method)
        self.started()
        shared = tuple(_shared(a) for a in args)
        return [getattr(worker, name).remote(*shared, **kwargs) for worker in self.workers]

    def start(self, method: RankMethod[P, R], *args: P.args, **kwargs: P.kwargs) -> None:
        """``method`` started on every rank and not waited for: a rank runs its calls in the order they were made,
        so the next one finds it done, and the group's next wait raises its failure, named as its own (a round trip
        less)."""
        self.unwaited.append((self.submit(method, *args, **kwargs), method.__name__))

    def wait(self, futures: Sequence[Any], method: RankMethod[P, R]) -> list[R]:
        """The results of ``submit(method, ...)``'s futures (errors named as by :meth:`run`)."""
        return self._get(futures, method.__name__)

    def run(self, method: RankMethod[P, R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """``method`` on every rank at once; the results in rank order."""
        return self._get(self.submit(method, *args, **kwargs), method.__name__)

    def run_sharded(
        self, method: Callable[Concatenate[Any, S, P], R], shards: Sequence[S], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        """``method(shards[dp], *args)`` on every rank, ``dp`` being the rank's data-parallel replica."""
        import ray

        name = self._name(method)
        self.started()
        if len(shards) != self.spec.dp:
            raise ValueError(f"{len(shards)} shards for {self.spec.dp} data-parallel replicas")
        refs = [ray.put(Packed(shard)) for shard in shards]
        shared = tuple(_shared(a) for a in args)
        futures = [
            getattr(worker, name).remote(refs[coords.dp_rank], *shared, **kwargs)
            for worker, coords in zip(self.workers, self.coords, strict=True)
        ]
        return self._get(futures, name)

    def _get(self, futures: Sequence[Any], method: str, ranks: Sequence[int] | None = None) -> list[Any]:
        """The results, or a :class:`WorkerError` naming the first rank that failed (Ray's error chained);
        ``ranks``: whose futures they are (default: every rank in order)."""
        import ray

        earlier, self.unwaited = self.unwaited, []
        for calls in earlier:  # an earlier call's failure surfaces first (the earliest first), named as its own
            self._get(*calls)
        try:
            return list(ray.get(list(futures)))
        except (ray.exceptions.RayError, KeyboardInterrupt):
            for rank, future in zip(ranks or range(len(futures)), futures, strict=True):
                try:
                    ray.get(future, timeout=0)
                except ray.exceptions.GetTimeoutError:
                    continue
                except ray.exceptions.RayError as error:
                    raise WorkerError(
                        f"{self.role} rank {rank}{self._where(rank)} failed in {method}: {error_line(error)}"
                    ) from error
            raise

    def _where(self, rank: int) -> str:
        if rank >= len(self.coords):
            return ""
        c = self.coords[rank]
        return f" (tp {c.tp_rank}, pp {c.pp_rank}, dp {c.dp_rank}" + (f", cp {c.cp_rank})" if self.spec.cp > 1 else ")")

    def compute_log_probs_sharded(
        self, shards: Sequence[Sequence[dict[str, Any]]], temperature: float = 1.0, adapters: bool = True
    ) -> list[Any]:
        """Each DP replica scores its own shard of micro-batches; the last stage's results per replica
        (``adapters`` false: a LoRA actor's base model, see ``MegatronWorker.compute_log_probs``)."""
        return self.per_replica(
            self.run_sharded(MegatronWorker.compute_log_probs, list(map(list, shards)), temperature, adapters)
        )

    def per_replica(self, results: Sequence[Any]) -> list[Any]:
        """The last stage's TP-rank-0 result of every DP replica, in DP order."""
        out: list[Any] = [None] * self.spec.dp
        for coords, result in zip(self.coords, results, strict=True):
            if coords.pp_rank == self.spec.pp - 1 and coords.leads_replica_stage():
                out[coords.dp_rank] = result
        return out

    def build(self, mm_dir: str | None, iteration: int | str | None = None) -> None:
        """Every rank builds its stage and loads its mp_rank file from ``mm_dir``."""
        self.run(MegatronWorker.build, mm_dir, iteration)

    def set_images(self, images: Any) -> None:
        """The step's prompt images on every rank (``images``: a ``StepImages``, or an object ref of one that several
        groups share)."""
        self.run(MegatronWorker.set_images, images)

    def take_vision_outputs(self, source: WorkerGroup) -> None:
        """Each rank gets the frozen-ViT outputs of this step that the rank at its place in ``source`` (another
        role, same layout) computed: rank to rank through the object store, the driver holds only references."""
        if len(source.workers) != len(self.workers):
            raise ValueError(f"{source.role} has {len(source.workers)} ranks, {self.role} {len(self.workers)}")
        outputs = source.submit(MegatronWorker.vision_outputs)
        name = self._name(MegatronWorker.add_vision_outputs)
        self._get([getattr(w, name).remote(ref) for w, ref in zip(self.workers, outputs, strict=True)], name)

    def device_placements(self) -> list[tuple[str, str]]:
        """Each rank's node and device, in rank order (``MegatronWorker.device_placement``)."""
        return self.run(MegatronWorker.device_placement)

    def compute_log_probs(self, micro_batches: Sequence[dict[str, Any]], temperature: float = 1.0) -> list[Any]:
        """Log-probs per micro-batch from the last stage (DP replica 0's; every rank runs the schedule)."""
        results = self.run(MegatronWorker.compute_log_probs, list(micro_batches), temperature)
        return self.from_last_stage(results)

    def from_last_stage(self, results: Sequence[Any]) -> Any:
        """The result of the last stage's TP-rank 0 in DP replica 0."""
        for coords, result in zip(self.coords, results, strict=True):
            if coords.pp_rank == self.spec.pp - 1 and coords.is_sender():
                return result
        raise RuntimeError("no last-stage rank in the group")

    # ------------------------------------------------------------------ the trained actor (TrainingWorker)
    def setup_training(self, spec: Any) -> None:
        """DDP, optimizer and LR schedule on every rank (``spec``: an ``OptimizerSpec``)."""
        self.run(TrainingWorker.setup_training, spec)

    def train_mini_batch(
        self, shards: Sequence[Sequence[dict[str, Any]]], loss: Any, denominator: float
    ) -> tuple[dict[str, float], list[Any]]:
        """One optimizer step, each DP replica on its shard of micro-batches: the mini-batch's metrics (the ranks
        reduce them over the replicas) and, per replica, the update forward's log-probs where its shard came
        without old ones (else None; see ``TrainingWorker.train_mini_batch``)."""
        results = self.run_sharded(TrainingWorker.train_mini_batch, list(map(list, shards)), loss, denominator)
        own = [result.log_probs if result is not None else None for result in self.per_replica(results)]
        return self.from_last_stage(results).metrics, own

    def schedule_lr_at(self, updates: int) -> None:
        """Every rank's LR schedule at ``updates`` optimizer steps (``TrainingWorker.schedule_lr_at``), not waited
        for (:meth:`start`)."""
        self.start(TrainingWorker.schedule_lr_at, updates)

    def save_checkpoint(self, staging: str) -> None:
        self.run(TrainingWorker.save_checkpoint, staging)

    def load_checkpoint(self, save_dir: str, step: int, load_optim: bool, load_rng: bool) -> None:
        self.run(TrainingWorker.load_checkpoint, save_dir, step, load_optim, load_rng)

    # ------------------------------------------------------------------------- colocated memory switches
    def offload(self, params: bool, grads: bool, optimizer: bool, bundles: Collection[int] | None = None) -> int:
        """The ranks in ``bundles`` (None: every rank) free what the switches name on their devices; the bytes
        freed in all."""
        freed = self._run_in(MegatronWorker.offload, bundles, params, grads, optimizer)
        return sum(sum(rank.values()) for rank in freed)

    def onload(self, params: bool, grads: bool, optimizer: bool, bundles: Collection[int] | None = None) -> None:
        self._run_in(MegatronWorker.onload, bundles, params, grads, optimizer)

    def _run_in(
        self, method: RankMethod[P, R], bundles: Collection[int] | None, *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        """``method`` on the ranks placed in ``bundles`` (every rank when None); rank-local calls only."""
        if bundles is None:
            return self.run(method, *args, **kwargs)
        name = self._name(method)
        self.started()
        ranks = [rank for rank, bundle in enumerate(self.bundles) if bundle in bundles]
        return self._get([getattr(self.workers[rank], name).remote(*args, **kwargs) for rank in ranks], name, ranks)

    def shutdown(self, graceful: bool = True) -> None:
        """Leave the process group on every rank (``graceful``; skip it after a failure, a dead rank would block
        the others' barrier), then end the actors and free the placement group when this group made it."""
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            if graceful:
                self.run(MegatronWorker.shutdown)
        finally:
            for worker in self.workers:
                ray.kill(worker)
            if self.owns_placement:
                remove_placement_group(self.placement)


def bundle_nodes(placement: Any) -> list[str]:
    """The node of each bundle of a ready placement group, in bundle order."""
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(placement)["bundles_to_node_id"]
    return [table[index] for index in sorted(table)]


def rank_bundles(nodes: Sequence[str], inner: int) -> list[int]:
    """The bundle of each rank: bundles grouped by node (nodes in order of their first bundle, bundles in index order
    within a node), so that every ``inner`` consecutive ranks (TP x CP, megatron's innermost groups) share a node.
    Raises when the placement cannot give that (a node holding a number of bundles that ``inner`` does not divide)."""
    first: dict[str, int] = {}
    for index, node in enumerate(nodes):
        first.setdefault(node, index)
    order = sorted(range(len(nodes)), key=lambda index: (first[nodes[index]], index))
    for start in range(0, len(order), inner):
        spread = {nodes[index] for index in order[start : start + inner]}
        if len(spread) > 1:
            per_node = {node: nodes.count(node) for node in first}
            raise RuntimeError(
                f"ranks {start}..{start + inner - 1} form one TP x CP group but their bundles lie "
                f"on {len(spread)} nodes (bundles per node: {per_node}): a TP x CP group must sit "
                "inside one node; give every node a multiple of TP x CP free devices"
            )
    return order


def error_line(error: BaseException) -> str:
    """The useful line of a Ray error: the remote exception's last line rather than Ray's banner."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__


def _shared(value: Any) -> Any:
    """An argument worth one shared object-store copy (micro-batches, tensors), packed, rather than one per call;
    others as they are."""
    import ray

    return ray.put(Packed(value)) if isinstance(value, list | tuple | dict) and len(value) > 0 else value
