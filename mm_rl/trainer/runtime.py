"""Where the job's processes run: the Ray connection, the placement group and the roles' resources.

One placement group holds a bundle per actor device (on CPU a bundle per training process), packed onto as few
nodes as possible. Actor rank ``i`` runs in bundle ``i``; the reference model, when colocated, takes a share of
the same bundle (same device), otherwise gets its own group. Rollout engine replica ``r``, colocated, runs on the
devices of actor ranks ``r*k .. r*k+k-1`` (``k`` = ``infer_tensor_parallel_size``; its process in rank ``r*k``'s
bundle, its TP workers one per device; it sleeps while the actor trains); separate (``generate_config.colocate:
false`` on accelerators), each replica gets one more bundle of ``infer_tensor_parallel_size`` whole devices, taken
from the cluster's ``NNODES x NPROC_PER_NODE``. Reward workers take small CPU shares outside the group.

Ray: ``env.RAY_ADDRESS`` (or the ``RAY_ADDRESS`` environment variable) joins a running cluster; otherwise a
local one is started with enough logical CPUs for the roles. Workers run at the driver's priority (Ray's
default ``nice 15`` made every worker lose to anything else on a shared machine). :class:`Connection` ends what
:func:`connect` began: a local instance this process started is stopped, whatever ended the run.

The console: the job's own lines (stages, steps, checkpoints, notices, errors) are printed by the driver; what the
workers print (vLLM's, megatron's and Ray's start-up warnings, tracebacks) goes to ``af_output_dir/logs/workers.log``
(:data:`WORKER_LOG`), and so do the Ray lines of this process. Each worker process moves its own stdout and
stderr there as it starts (Ray's ``worker_process_setup_hook``, :func:`setup_worker`), so C-level writes go there
too and the file holds every node's workers (af_output_dir is on a file system all nodes see), while Ray no longer
forwards them to the driver (``log_to_driver=False``). A worker's failure still reaches the console as the
``WorkerError`` naming the role. ``MM_RL_VERBOSE=1`` (``ascendfactory-cli train --verbose``) leaves everything on
the console, as Ray prints it.

A driver killed with SIGKILL cannot stop Ray itself. A local instance's GCS and raylet die with it (Ray starts them
with the kernel's parent-death signal), the actors about 3 s later (measured; they die with their owner and their
raylet), but Ray's dashboard and runtime-env agents, which hold no devices, stay about 60 s: seeing their raylet
die unexpectedly, they publish the fact to the dead GCS with a fixed 60 s timeout before exiting (Ray's
``process_watcher``); no Ray option shortens it.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mm_rl.config.loader import ConfigError, Violation
from mm_rl.config.schema import JobConfig

logger = logging.getLogger(__name__)

DEVICE_RESOURCE = {"cuda": "GPU", "npu": "NPU", "cpu": None}
ROLLOUT_CPUS = 1.0
# Warnings every worker would repeat at start-up about optional kernels (none of them changes a result).
QUIET_WARNINGS = ",".join(
    [
        "ignore::FutureWarning",
        "ignore:Transformer Engine and Apex:UserWarning",
        "ignore:Apex is not installed:UserWarning",
        "ignore:full scope is deprecated:UserWarning",
    ]
)
REWARD_CPUS = 0.25
WORKER_LOG = Path("logs") / "workers.log"  # under af_output_dir
LOG_ENV = "MM_RL_WORKER_LOG"  # in the workers' environment: the file setup_worker sends their output to
VERBOSE_ENV = "MM_RL_VERBOSE"  # "1": the workers' output on the console (train --verbose)
PLACEMENT_NOTICE_S = 10.0  # a placement not ready by then is reported while the wait goes on


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
    rollout_devices: int = 0  # separate engine replicas: their whole devices, in bundles after the actor's
    rollout_replicas: int = 1  # engine replicas (colocated: replica r beside actor rank r)

    def bundle(self) -> dict[str, float]:
        resource = DEVICE_RESOURCE[self.device]
        return {"CPU": self.bundle_cpus} | ({resource: 1.0} if resource else {})

    def rollout_bundle(self) -> dict[str, float]:
        """A separate engine replica's bundle: its devices and the CPU of its process."""
        return {"CPU": ROLLOUT_CPUS} | self.worker_resources(float(self.rollout_devices // self.rollout_replicas))

    def worker_resources(self, share: float) -> dict[str, float]:
        resource = DEVICE_RESOURCE[self.device]
        return {resource: share} if resource else {}


@dataclass(frozen=True)
class EngineSlot:
    """Where one engine replica's actor runs: its placement-group ``bundle`` (None on CPU: it runs beside the ranks,
    unplaced) and its ``share`` of that bundle's device; colocated, the actor ranks on whose devices its TP workers
    run (``ranks``; empty when the replica has devices of its own)."""

    bundle: int | None
    share: float
    ranks: range


@dataclass(frozen=True)
class PlacementPlan:
    """Where every role runs, decided once when the placement group is ready: each training rank's bundle (the actor's
    and a colocated reference's), each engine replica's slot, and the bundles whose devices hold a colocated
    replica (``shared_bundles``, the ranks that offload for it; None when every bundle does, or none)."""

    rank_bundles: tuple[int, ...]
    engines: tuple[EngineSlot, ...]
    shared_bundles: frozenset[int] | None


def plan_placement(resources: Resources, nodes: Sequence[str], inner: int, engine_tp: int) -> PlacementPlan:
    """The plan for a ready placement group whose bundle ``i`` sits on ``nodes[i]``: the ranks take the bundles in
    node order with every ``inner`` (TP x CP) consecutive ranks in one node (``rank_bundles``); a separate replica
    takes the bundle after the ranks' (its devices), a colocated replica ``r`` a share of the devices of actor ranks
    ``r * engine_tp ..`` (it sleeps while they train)."""
    from mm_rl.workers.group import rank_bundles

    res = resources
    bundles = tuple(rank_bundles(nodes[: res.world_size], inner))
    engines = []
    for replica in range(res.rollout_replicas):
        if res.device == "cpu":
            engines.append(EngineSlot(None, 0.0, range(0)))
        elif res.rollout_devices:
            engines.append(
                EngineSlot(res.world_size + replica, float(res.rollout_devices // res.rollout_replicas), range(0))
            )
        else:
            ranks = range(replica * engine_tp, (replica + 1) * engine_tp)
            engines.append(EngineSlot(bundles[ranks[0]], res.device_share_rollout, ranks))
    colocated = {bundles[rank] for slot in engines for rank in slot.ranks}
    shared = frozenset(colocated) if colocated and len(colocated) < res.world_size else None
    return PlacementPlan(bundles, tuple(engines), shared)


def engine_visible_devices(
    placements: Sequence[tuple[str, str]], slots: Sequence[EngineSlot], device: str
) -> list[dict[str, str]]:
    """What each engine replica's process must see first: for a colocated replica with TP > 1, the devices of its
    actor ranks (``placements``: each rank's node and device id as Ray gave it), as the device's visible-devices
    variable; nothing for the others (Ray makes the device of the bundle a process sits in visible). vLLM's TP
    workers then land one on each of those devices, beside the ranks that sleep while it generates. Raises when a
    replica's ranks are on two nodes."""
    from mm_rl.platform.device import VISIBLE_DEVICES_ENV

    variables: list[dict[str, str]] = []
    for replica, slot in enumerate(slots):
        if len(slot.ranks) <= 1:
            variables.append({})
            continue
        ranks = [placements[rank] for rank in slot.ranks]
        if len({node for node, _ in ranks}) > 1:
            raise RuntimeError(
                f"engine replica {replica} would span actor ranks {slot.ranks[0]}..{slot.ranks[-1]} "
                "on different nodes: an engine's TP group sits in one node"
            )
        variables.append({VISIBLE_DEVICES_ENV[device]: ",".join(ids for _, ids in ranks)})
    return variables


def plan_resources(job: JobConfig) -> Resources:
    """Bundle sizes for the job: one per device; the actor and a colocated reference split it."""
    from mm_rl.config.topology import topology

    topo = topology(job)
    colocated = job.backend_config.rl_config.colocate_ref
    return Resources(
        device=topo.device,
        world_size=topo.world_size,
        bundle_cpus=1.0,
        actor_share=0.5 if colocated else 1.0,
        ref_share=0.5 if colocated else 1.0,
        device_share_actor=0.4 if colocated else 0.6,
        device_share_ref=0.2 if colocated else 0.4,
        device_share_rollout=0.4,
        threads=topo.rank_threads(),
        rollout_devices=topo.rollout_devices,
        rollout_replicas=topo.rollout_replicas,
    )


def show_worker_output(verbose: bool) -> None:
    """``train --verbose``: the workers' output on this console, as Ray prints it, for the runs this process starts
    (as ``MM_RL_VERBOSE=1`` does; without the flag that variable decides)."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"


def logical_cpus(resources: Resources, reward_workers: int) -> int:
    """Logical CPUs a local Ray cluster needs to place every role (at least the machine's cores)."""
    needed = (
        resources.world_size * resources.bundle_cpus * 2
        + ROLLOUT_CPUS * resources.rollout_replicas
        + reward_workers * REWARD_CPUS
    )
    return max(os.cpu_count() or 1, int(needed + 0.999))


@dataclass
class Connection:
    """This process's Ray connection: where the job runs, whether this process called ``ray.init`` (then
    :meth:`close` shuts Ray down, stopping a local instance), and the worker log (None: output on the console)."""

    where: str
    owned: bool
    log_file: Path | None = None
    ray_handlers: list[logging.Handler] | None = field(default=None, repr=False)  # the "ray" logger's own, put back
    ray_printer: Callable[..., None] | None = field(default=None, repr=False)  # Ray's print_to_stdstream, put back

    def close(self) -> None:
        """Disconnect (a local instance's processes are stopped and waited for); the "ray" logger prints to the
        console again."""
        import ray

        try:
            if self.owned:
                ray.shutdown(wait_for_processes=True)
        finally:
            if self.ray_handlers is not None:
                for handler in _route_ray_logger(self.ray_handlers):
                    handler.close()
                self.ray_handlers = None
            if self.ray_printer is not None:
                _route_ray_prints(self.ray_printer)
                self.ray_printer = None


class Terminated(KeyboardInterrupt):
    """SIGTERM (what schedulers and ``kill`` send) in the driver: raised in its main thread as Ctrl-C raises
    ``KeyboardInterrupt``, so the same clean shutdown runs (roles closed, Ray stopped, a resume hint)."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated


def stop_cleanly_on_sigterm() -> None:
    """SIGTERM raises :class:`Terminated` from now on. ``ray.init`` installs a handler of its own that exits from
    whatever the main thread runs (``sys.exit``, ray/_private/worker.py), which ended a run with a C++ abort (exit
    134); :func:`connect` puts this one back after it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)


def connect(job: JobConfig, resources: Resources) -> Connection:
    """Join the configured Ray cluster or start a local one, its workers' output in the worker log (unless verbose).
    Interrupted or failed, what it started is stopped before the error goes on."""
    import ray

    if ray.is_initialized():
        return Connection("the Ray cluster this process already joined", owned=False)
    cluster = cluster_address(job)
    if cluster is not None:
        wait_for_cluster(*cluster, timeout_s=job.env.RAY_CONNECT_TIMEOUT_S)
    log_file = None if os.environ.get(VERBOSE_ENV) == "1" else open_worker_log(Path(job.af_output_dir))
    options, where = init_options(job, resources, log_file)
    connection = Connection(where, owned=True, log_file=log_file)
    if log_file is not None:  # Ray's own lines of this process (ray.init's notices among them)
        connection.ray_handlers = _route_ray_logger([logging.FileHandler(log_file)])
        connection.ray_printer = _route_ray_prints(functools.partial(_print_to_log, log_file))
    try:
        ray.init(**options)
        stop_cleanly_on_sigterm()
    except BaseException:
        connection.close()
        raise
    return connection


def cluster_address(job: JobConfig) -> tuple[str, str] | None:
    """The Ray cluster the job joins and the key that named it (the yaml's, else the environment variable's); None:
    a local Ray instance."""
    if job.env.RAY_ADDRESS:
        return job.env.RAY_ADDRESS, "env.RAY_ADDRESS"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS (environment variable)"
    return None


def wait_for_cluster(address: str, key: str, timeout_s: float) -> None:
    """Return once something answers at a ``host:port`` (or ``ray://host:port``) address, or fail after
    ``timeout_s`` in ``check``'s format: ``ray.init`` would retry its GCS connection for minutes, a warning every
    few seconds, without naming the address's source. Other forms (``auto``) are Ray's own lookup, which fails
    fast."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    [
                        Violation(
                            key,
                            address,
                            f"no Ray cluster answers there ({error.strerror or error}; waited "
                            f"{timeout_s:g} s, env.RAY_CONNECT_TIMEOUT_S)",
                            "start the cluster first (ray start --head on that node), correct the address, or leave it "
                            "unset (the yaml key and the environment variable) for a local run",
                        )
                    ]
                ) from None
            time.sleep(1.0)


def init_options(job: JobConfig, resources: Resources, log_file: Path | None) -> tuple[dict[str, Any], str]:
    """``ray.init``'s arguments, and where the job runs. With ``log_file`` every worker process sends its output
    there (:func:`setup_worker`) and Ray forwards none to this console."""
    env_vars = {
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # the per-step lines are the progress report; the engines' INFO lines would bury them
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", QUIET_WARNINGS),
    }
    runtime_env: dict[str, Any] = {"env_vars": env_vars}
    if log_file is not None:
        env_vars[LOG_ENV] = str(log_file)
        runtime_env["worker_process_setup_hook"] = f"{__name__}.{setup_worker.__name__}"
    options = {"runtime_env": runtime_env, "log_to_driver": log_file is None}
    cluster = cluster_address(job)
    if cluster is not None:
        return options | {"address": cluster[0]}, f"Ray cluster at {cluster[0]}"
    cpus = logical_cpus(resources, job.backend_config.rl_config.reward.num_workers)
    local = {
        "num_cpus": cpus,
        "include_dashboard": False,
        "_system_config": {"worker_niceness": os.getpriority(os.PRIO_PROCESS, 0)},
    }
    return options | local, f"a local Ray instance ({cpus} logical CPUs)"


def open_worker_log(out_dir: Path) -> Path:
    """The worker log of ``out_dir`` (absolute: the workers run elsewhere), a header line appended for this run (a
    resumed run adds to the log of the attempts before it)."""
    path = (out_dir / WORKER_LOG).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as log:
        log.write(
            f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {socket.gethostname()} pid {os.getpid()}: a run "
            "starts; its Ray workers' output follows\n"
        )
    return path


def worker_log(out_dir: Path) -> Path | None:
    """The worker log of a run of this process in ``out_dir``; None when it wrote none (verbose: the console)."""
    path = out_dir / WORKER_LOG
    return path if os.environ.get(VERBOSE_ENV) != "1" and path.is_file() else None


def setup_worker() -> None:
    """Ray runs this first in every worker process of the job (``worker_process_setup_hook``): the process's
    stdout and stderr, file descriptors 1 and 2 (Python's, C's and child processes' writes), appended to the
    worker log. A node that cannot open it keeps Ray's own per-worker files."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    print(
        f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} {socket.gethostname()} pid {os.getpid()}: Ray worker started",
        flush=True,
    )


def _route_ray_prints(printer: Callable[..., None]) -> Callable[..., None]:
    """Put ``printer`` in place of Ray's ``print_to_stdstream``, returning Ray's: the driver's thread that relays the
    raylet's messages (a worker killed, objects spilled) prints them, coloured "(raylet)" lines, to the console
    with ``log_to_driver`` off too (ray/_private/worker.py, ``listen_error_messages``)."""
    import ray._private.worker as ray_worker

    previous, ray_worker.print_to_stdstream = ray_worker.print_to_stdstream, printer
    return previous


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _print_to_log(log_file: Path, data: dict[str, Any], ignore_prefix: bool = False) -> None:
    """A relayed message of Ray's (``{"lines": [...], "pid": ...}``) as plain lines in the worker log."""
    with open(log_file, "a") as log:
        for line in data.get("lines", []):
            log.write(f"({data.get('pid', 'ray')}) {_ANSI.sub('', line)}\n")


def _route_ray_logger(handlers: list[logging.Handler]) -> list[logging.Handler]:
    """Give the "ray" logger of this process ``handlers`` in place of its own; returns the ones it had."""
    logger = logging.getLogger("ray")
    previous, logger.handlers = logger.handlers, list(handlers)
    return previous


def make_placement(
    resources: Resources, with_rollout: bool = False, report: Callable[[str], None] | None = None
) -> Any:
    """The placement group of the training ranks (one bundle each; then, with ``with_rollout``, a bundle per
    separate engine replica), ready. A wait of more than a few seconds is reported: Ray's own "cannot be scheduled"
    warnings no longer reach the console."""
    import ray
    from ray.util.placement_group import placement_group

    bundles = [resources.bundle()] * resources.world_size
    if with_rollout and resources.rollout_devices:
        bundles += [resources.rollout_bundle()] * resources.rollout_replicas
    group = placement_group(bundles, strategy="PACK")
    ready = group.ready()
    if report is not None and not ray.wait([ready], timeout=PLACEMENT_NOTICE_S)[0]:
        report(
            f"waiting for Ray to place {len(bundles)} bundles ({bundles[0]} each); `ray status` shows what the "
            "cluster has free"
        )
    try:
        ray.get(ready, timeout=600)
    except ray.exceptions.GetTimeoutError as error:
        raise RuntimeError(
            f"Ray could not place the bundles {bundles} within 10 "
            "minutes: does the cluster have that many devices (see `ray status`), and did each "
            "node start with its device resource (ray start --resources)?"
        ) from error
    return group
