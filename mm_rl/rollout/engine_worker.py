"""The rollout engine as a Ray actor, with a thread budget taken from its CPU reservation.

On a CPU machine several processes (actor ranks, reference, rollout, reward) share a few cores. torch starts one
thread per core in each, and the oversubscription made a tiny GRPO step 3-6x slower in measurements (design
notes). So the worker sets ``torch.set_num_threads`` to the CPUs Ray assigned it (at least 1), and exports the same
number as ``OMP_NUM_THREADS``: vLLM keeps torch's thread count when that variable is set (else it drops to one).

Weights arrive in buckets (a Ray call carries a list, not a lazy iterator); the engine holds back a layer until all
of its tensors have arrived, so a sender may cut buckets anywhere (see ``mm_rl.sync.buckets.bucket_by_group``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mm_rl.config.schema import GenerateConfig
from mm_rl.config.topology import threads_for
from mm_rl.rollout.base import RolloutEngine, RolloutOutputs, RolloutRequest, SamplingLike, SamplingSpec

if TYPE_CHECKING:
    import torch

    from mm_rl.config.schema import MultiTurnConfig
    from mm_rl.data.video import VideoSettings
    from mm_rl.rollout.multi_turn import AgentLoop, ToolExecutor
    from mm_rl.sync.transport import DeviceBucket


def build_engine(
    backend: str, model_path: str | Path, config: GenerateConfig, *, synced_first: bool = False, **kwargs: Any
) -> RolloutEngine:
    """The engine named by ``generate_config.backend``: ``vllm`` or ``hf``. ``synced_first``: every weight arrives
    by a sync before the first generate (the trainer), so vLLM starts without reading the checkpoint's weights; the
    transformers engine (tests, small models) loads them anyway."""
    if backend == "vllm":
        from mm_rl.rollout.vllm_engine import VllmEngine

        return VllmEngine(model_path, config, dummy_weights=synced_first, **kwargs)
    if backend == "hf":
        from mm_rl.rollout.hf_engine import HfEngine

        return HfEngine(model_path, config, **kwargs)
    raise ValueError(f"unknown rollout backend {backend!r}: expected 'vllm' or 'hf'")


def agent_loop(settings: MultiTurnConfig, model_path: str | Path, min_pixels: int, max_pixels: int) -> AgentLoop:
    """The multi-turn loop of a job: its tool prompts' processor and its tools, run in this process."""
    from mm_rl.data.tool_prompts import ToolPromptProcessor
    from mm_rl.rollout.multi_turn import AgentLoop
    from mm_rl.tools.runner import ToolRunner

    processor = ToolPromptProcessor.for_job(model_path, min_pixels, max_pixels, settings)
    runner = ToolRunner(settings.tools, settings.tool_timeout, settings.max_tool_output_chars)
    return AgentLoop(settings, processor, runner)


def assigned_cpus() -> float | None:
    """CPUs Ray reserved for the current actor, or None outside a Ray worker."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        return ray.get_runtime_context().get_assigned_resources().get("CPU")
    except (ImportError, RuntimeError):
        return None


def set_thread_budget(num_threads: int | None = None) -> int:
    """Give torch (and vLLM) ``num_threads`` threads, by default the CPUs Ray assigned (at least one)."""
    import torch

    if num_threads is None:
        cpus = assigned_cpus()
        num_threads = threads_for(cpus) if cpus else torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(num_threads)
    return num_threads


class RolloutWorker:
    """Hosts one rollout engine; plain class, made an actor by :func:`rollout_worker_actor`."""

    def __init__(
        self,
        model_path: str | Path,
        config: GenerateConfig,
        *,
        min_pixels: int,
        max_pixels: int,
        backend: str | None = None,
        num_threads: int | None = None,
        visible_devices: dict[str, str] | None = None,
        multi_turn: MultiTurnConfig | None = None,
        video: VideoSettings | None = None,
        **engine_kwargs: Any,
    ) -> None:
        """``multi_turn``: the job's multi-turn settings when enabled (the tools run in this process until
        :meth:`connect_tools` hands over the job's tool workers); ``video``: the job's video settings (vLLM's video
        processor; the transformers engine takes no video)."""
        # first: the device runtime reads its visible devices once, when this process first touches it (a colocated
        # engine with TP > 1 sees its actor ranks' devices, not only the one of the bundle Ray placed it in)
        os.environ.update(visible_devices or {})
        self.num_threads = set_thread_budget(num_threads)
        backend = backend or config.backend
        if multi_turn is not None and backend == "vllm":  # room for the tools' images besides the prompt's
            engine_kwargs["extra_images"] = multi_turn.max_tool_images
        if video is not None and backend == "vllm":
            engine_kwargs["video"] = video
        self.engine = build_engine(
            backend,
            model_path,
            config,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            **engine_kwargs,
        )
        self.agent = agent_loop(multi_turn, model_path, min_pixels, max_pixels) if multi_turn is not None else None
        # names this process in the worker log, where the engine's own lines go
        print(
            f"rollout engine ({backend}) started in pid {os.getpid()}: {model_path}, {self.num_threads} threads",
            flush=True,
        )

    def ready(self) -> bool:
        return True

    def threads(self) -> int:
        """torch's intra-op threads in this process (the budget, unless something changed it)."""
        import torch

        return torch.get_num_threads()

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        sampling: SamplingLike | SamplingSpec,
        n: int | None = None,
        seed: int | None = None,
    ) -> RolloutOutputs:
        """The engine's ``generate``; with ``seed``, its sampler restarted from it first (one call, not two)."""
        if seed is not None:
            self.engine.reseed(seed)
        if self.agent is not None:
            return self.agent.generate(self.engine, requests, SamplingSpec.of(sampling, n))
        return self.engine.generate(requests, sampling, n)

    def connect_tools(self, tools: ToolExecutor) -> None:
        """Run the multi-turn tool calls on ``tools`` (the job's tool workers) instead of in this process."""
        if self.agent is not None:
            self.agent.tools = tools

    def begin_weight_update(self) -> None:
        self.engine.begin_weight_update()

    def update_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        return self.engine.update_weights(named_tensors)

    def end_weight_update(self) -> None:
        self.engine.end_weight_update()

    def device_identities(self) -> list[str | None]:
        return self.engine.device_identities()

    def join_sync_group(self, key: str, stage: int, host: str, port: int, ranks: list[int | None], world: int) -> None:
        """Join the weight-sync group of an actor stage's sender (see mm_rl.sync.transport): the engine's loading
        process i as ``ranks[i]`` of ``world``."""
        self.engine.join_sync_group(key, stage, host, port, ranks, world)

    def receive_weights(self, bucket: DeviceBucket) -> int:
        """Load one bucket of a device sync (broadcast as this call runs, or mapped from the sender's buffer)."""
        return self.engine.receive_weights(bucket)

    def reseed(self, seed: int) -> None:
        self.engine.reseed(seed)

    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take back the memory ``tags`` name (all when None). Before the KV cache, this process's allocator hands
        back its free blocks (the weight sync's received buckets): the cache is sized to what is free."""
        from mm_rl.platform.device import empty_cache

        if tags is None or "kv_cache" in tags:
            empty_cache()
        self.engine.wake_up(tags)

    def close(self) -> None:
        self.engine.close()


def rollout_worker_actor(num_cpus: float = 1, **options: Any) -> Any:
    """``RolloutWorker`` as a Ray actor class reserving ``num_cpus`` (its thread budget); call ``.remote(...)``."""
    import ray

    return ray.remote(num_cpus=num_cpus, **options)(RolloutWorker)
