"""Test probes on the Megatron ranks and the engine: classes with hooks that production ones do not carry.

Pass :class:`ProbeWorker` as ``worker_cls`` of a ``WorkerGroup`` (a whole job: patch it over
``mm_rl.workers.training.TrainingWorker``, which ``RayRoles`` looks up when it starts the actor): it is a
``TrainingWorker`` (so it can also serve as a reference rank) that can perturb and restore its weights, poison its
next update, report parameter sums and resident bytes, and logs its sync and memory-switch calls in order.
:class:`ProbeRollout` is an engine replica's worker that logs the calls a schedule makes on it, in order.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable
from typing import Any

import ray.cloudpickle

from mm_rl.rollout.engine_worker import RolloutWorker
from mm_rl.workers.training import TrainingWorker

# Ray workers import classes by module name; this module lives in tests/, which they may not see.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TIED_COPY = "text_decoder.output_layer.weight"
WORD_EMBEDDINGS = "text_decoder.embedding.word_embeddings.weight"


class ProbeWorker(TrainingWorker):
    """A trained (or reference) rank with test hooks; see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._saved: dict[str, Any] | None = None
        self._events: list[tuple[str, Any]] = []
        self._poison: Any = None
        self._allocated: list[tuple[int, int, int]] = []

    def build(self, *args: Any, **kwargs: Any) -> None:
        super().build(*args, **kwargs)
        self._saved = None

    # ------------------------------------------------------------------------------------------ weights
    def perturb_weights(self, scale: float, seed: int = 0, trained_only: bool = False) -> None:
        """Add noise (``scale`` x the tensor's mean |value|) to every parameter (``trained_only``: those that
        train), keeping the originals.

        The noise of a tensor depends only on its name, this rank's TP shard (replicated tensors get the same
        noise on every TP rank) and ``seed``, so the ranks stay consistent; the tied output-layer copy on the last
        stage gets the word embeddings' noise, so it stays equal to them."""
        import torch

        from mm_rl.convert.mapping import entry_for

        model, coords = self._require_model(), self._require_coords()
        tied_copy = model.share_embeddings_and_output_weights and not model.layout.has_embedding
        if self._saved is None:
            self._saved = {name: p.detach().clone() for name, p in model.named_parameters()}
        with torch.no_grad():
            for name, param in model.named_parameters():
                if trained_only and not param.requires_grad:
                    continue
                key = WORD_EMBEDDINGS if tied_copy and name == TIED_COPY else name
                shard = coords.tp_rank if entry_for(self.spec.model, name).split is not None else -1
                generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}|{key}|{shard}".encode()))
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                param.add_((scale * param.detach().float().abs().mean() * noise).to(param.dtype))

    def restore_weights(self) -> None:
        """Put back the parameters saved by the first :meth:`perturb_weights`."""
        import torch

        if self._saved is None:
            return
        with torch.no_grad():
            for name, param in self._require_model().named_parameters():
                param.copy_(self._saved[name])
        self._saved = None

    def parameter_sums(self) -> dict[str, float]:
        """Each parameter's sum in float64 (which weights did an update change?)."""
        import torch

        with torch.no_grad():
            return {name: float(p.detach().double().sum()) for name, p in self._require_model().named_parameters()}

    # ------------------------------------------------------------------------------------------- update
    def poison_next_step(self) -> None:
        """Make the next update's gradients NaN on this rank (the non-finite skip)."""
        import torch

        param = [p for p in self._require_model().parameters() if p.requires_grad][-1]  # the LLM's last (any batch)
        self._poison = param.register_hook(lambda grad: torch.full_like(grad, float("nan")))

    def train_mini_batch(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train_mini_batch(*args, **kwargs)
        finally:
            if self._poison is not None:
                self._poison.remove()
                self._poison = None

    # ------------------------------------------------------------------------------ sync and memory log
    def push_weights(
        self,
        sink_factory: Callable[[int], Any],
        bucket_bytes: int,
        stage: int | None = None,
        trained_only: bool = False,
    ) -> Any:
        stats = super().push_weights(sink_factory, bucket_bytes, stage, trained_only)
        self._events.append(("push_weights", stats.tensors if stats else 0))
        return stats

    def offload(self, params: bool, grads: bool, optimizer: bool) -> dict[str, int]:
        before = device_allocated()
        freed = super().offload(params, grads, optimizer)
        self._events.append(("offload", {"params": params, "grads": grads, "optimizer": optimizer}))
        self._allocated.append((before, device_allocated(), sum(freed.values())))
        return freed

    def device_memory_log(self) -> list[tuple[int, int, int]]:
        """Per offload: the device's allocated bytes before and after, and the bytes the switches reported freed
        (on CPU the allocator counts nothing: zeros)."""
        return list(self._allocated)

    def onload(self, params: bool, grads: bool, optimizer: bool) -> dict[str, int]:
        restored = super().onload(params, grads, optimizer)
        self._events.append(("onload", {"params": params, "grads": grads, "optimizer": optimizer}))
        return restored

    def events(self) -> list[tuple[str, Any]]:
        """(method, detail) of the sync and memory switches in call order."""
        return list(self._events)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes each kind holds on its device now (offload really empties the storages)."""
        from mm_rl.workers.offload import KINDS, resident_bytes

        return {kind: resident_bytes(self._memory_tensors(kind)) for kind in KINDS}


def device_allocated() -> int:
    """Bytes the device's caching allocator holds in tensors now (0 on CPU)."""
    import torch

    from mm_rl.platform.device import device_kind

    kind = device_kind()
    return 0 if kind == "cpu" else int(getattr(torch, kind).memory_allocated())


class ProbeRollout(RolloutWorker):
    """An engine replica's worker that logs generate, the weight update (and each device bucket's stage), sleep and
    wake calls (``calls``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._calls: list[str] = []

    def calls(self) -> list[str]:
        return list(self._calls)

    def receive_weights(self, bucket: Any) -> int:
        self._calls.append(f"receive_weights(stage {bucket.stage})")
        return super().receive_weights(bucket)


def _logged(name: str) -> Callable[..., Any]:
    def method(self: ProbeRollout, *args: Any, **kwargs: Any) -> Any:
        self._calls.append(name)
        return getattr(RolloutWorker, name)(self, *args, **kwargs)

    method.__name__ = name
    return method


for _name in ("generate", "begin_weight_update", "update_weights", "end_weight_update", "sleep", "wake_up"):
    setattr(ProbeRollout, _name, _logged(_name))


def record_schedule(schedule: Any, patch: Any) -> list[str]:
    """What a ``RolloutSchedule`` does, in one order across the roles it drives: the actor's and reference's memory
    switches (with the kinds switched on), the engines' sleep / wake calls and the sync; recorded by wrapping them
    with ``patch`` (a ``pytest.MonkeyPatch``, which undoes it)."""
    from mm_rl.trainer import schedule as schedule_module

    log: list[str] = []

    def wrap(owner: Any, name: str, label: Callable[..., str]) -> None:
        original = getattr(owner, name)

        def logged(*args: Any, **kwargs: Any) -> Any:
            log.append(label(*args, **kwargs))
            return original(*args, **kwargs)

        patch.setattr(owner, name, logged)

    def switched(role: str, name: str) -> Callable[..., str]:
        def label(params: bool, grads: bool, optimizer: bool, bundles: Any = None) -> str:
            kinds = [kind for kind, on in (("params", params), ("grads", grads), ("optimizer", optimizer)) if on]
            return f"{role}.{name}({', '.join(kinds)})"

        return label

    for role, group in (("actor", schedule.group), ("reference", schedule.reference)):
        for name in ("offload", "onload"):
            if group is not None:
                wrap(group, name, switched(role, name))
    wrap(
        schedule,
        "_engines",
        lambda method, *args: f"engine.{method}" + (f"({', '.join(args[0])})" if method == "wake_up" else ""),
    )
    wrap(schedule_module, "sync_weights", lambda *args, **kwargs: "sync")
    return log
