"""The rollout contract shared by every engine: requests in, n samples per request out, plus batch metrics.

A request carries the prompt in both forms the two sides of GRPO need: ``prompt_ids`` are the token ids the actor
scores (image pads expanded, exactly ``PromptItem.input_ids``), and the images (plus, when the actor already made
them, ``pixel_values`` / ``image_grid_thw``) that an engine needs to condition on the same image tokens. Every engine
returns the actor's prompt ids unchanged (or the truncated ids when the overflow policy truncated the prompt), so the
trainer never re-tokenises and the old log-probs it computes line up token for token with the sampled ones.

Outputs are index-aligned with the requests: a request that the bounds policy skipped still has an output, with
``skipped`` set and no samples, so callers can zip requests and outputs without bookkeeping. The list returned by
``generate`` is a :class:`RolloutOutputs`, a plain list that also carries the batch's :class:`RolloutMetrics`.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from mm_rl.config.schema import GenerateConfig
    from mm_rl.data.dataset import PromptItem
    from mm_rl.data.video import VideoClip
    from mm_rl.rollout.bounds import BoundsPolicy
    from mm_rl.sync.transport import DeviceBucket

# "vision_token": the trainer cut the response before a vision special token it sampled as text; "turns": a
# multi-turn trajectory still called tools in its last allowed turn
FinishReason = Literal["stop", "length", "vision_token", "turns"]
GREEDY_BELOW = 1e-5  # below this temperature an engine samples greedily (vLLM uses the same threshold)
MEMORY_TAGS = ("weights", "kv_cache")  # what a sleeping engine releases (vLLM's wake_up tags)


def engine_dtype(config: GenerateConfig, override: str | None = None, model_path: str | Path | None = None) -> str:
    """The engine's precision: ``override``, else ``generate_config.dtype``, where ``auto`` is bfloat16 on
    accelerators and on CPU float32 (oneDNN bf16 falls back to slow paths on AVX2), or for vLLM (``model_path``
    given) the model family's ``cpu_engine_dtype`` (bf16 where vLLM's CPU kernels take nothing else)."""
    from mm_rl.platform.device import device_kind

    if override:
        return override
    if config.dtype != "auto":
        return config.dtype
    if device_kind() != "cpu":
        return "bfloat16"
    if model_path is None:
        return "float32"
    from mm_rl.models.registry import family_for_hf

    return family_for_hf(json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))).cpu_engine_dtype


# ------------------------------------------------------------------------------------------------ requests
@dataclass
class RolloutRequest:
    """One prompt for the engine.

    ``prompt_text`` is the chat-templated text with ONE ``<|image_pad|>`` per image; it is informational once the
    ids exist (engines work from ``prompt_ids``) and is None after the overflow policy truncated the ids.
    """

    prompt_ids: list[int]
    prompt_text: str | None = None
    images: list[Image.Image] = field(default_factory=list)
    pixel_values: torch.Tensor | None = None  # the actor's processed pixels; the HF engine reuses them
    image_grid_thw: torch.Tensor | None = None
    uid: int | str | None = None  # caller's id (row id), echoed in the output
    videos: list[VideoClip] = field(default_factory=list)  # sampled frames and their metadata (vLLM only)

    @classmethod
    def from_item(cls, item: PromptItem, pixels: bool = False) -> RolloutRequest:
        """The request for a data-set item: its ids, text and images, and with ``pixels`` its processed pixels.

        Pixels are left out by default: vLLM never reads them and the HF engine recomputes the same values from
        the images, while they are ~8x the size of the decoded images (5 MB for 16 tiny prompts), which every
        process boundary (Ray) would copy. Pass ``pixels=True`` for an engine in the same process.
        """
        return cls(
            prompt_ids=item.input_ids.tolist(),
            prompt_text=item.prompt_text,
            images=list(item.images),
            pixel_values=item.pixel_values if pixels else None,
            image_grid_thw=item.image_grid_thw if pixels else None,
            uid=item.row_id,
            videos=list(item.videos),
        )


# ------------------------------------------------------------------------------------------------- sampling
class SamplingLike(Protocol):
    """What ``generate`` reads from a sampling section: ``SamplingConfig`` or ``ValSamplingConfig``."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    n: int


@dataclass(frozen=True)
class SamplingSpec:
    """Checked sampling settings, normalised so both engines read the same values.

    ``top_k`` <= 0 means no top-k. ``logprobs`` is the number of alternatives returned besides the sampled token
    (``ValSamplingConfig`` has no such key: 0). ``seed`` is honoured where the backend allows it (see the engines).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    logprobs: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.max_tokens is None or self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.logprobs < 0:
            problems.append(f"logprobs must be >= 0, got {self.logprobs}")
        if problems:
            raise ValueError("invalid sampling settings: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @classmethod
    def of(cls, sampling: SamplingLike | SamplingSpec, n: int | None = None) -> SamplingSpec:
        """Read a config section (``n`` overrides its ``n``); a greedy section is normalised to one sample."""
        if isinstance(sampling, SamplingSpec) and n is None:
            return sampling
        n = n if n is not None else sampling.n
        if n is None or sampling.max_tokens is None:
            raise ValueError("sampling n / max_tokens unset (an unresolved ${...} reference?): resolve the config")
        return cls(
            max_tokens=sampling.max_tokens,
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            top_k=int(sampling.top_k) if sampling.top_k and sampling.top_k > 0 else -1,
            n=int(n),
            logprobs=int(getattr(sampling, "logprobs", 0) or 0),
            seed=getattr(sampling, "seed", None),
        )


def sampling_for(generate_config: Any, validation: bool = False) -> SamplingSpec:
    """The rollout settings of a ``GenerateConfig``, or its validation override (``val_sampling_config``:
    greedy and one sample by default; no seed and no alternatives, since it has no such keys)."""
    return SamplingSpec.of(generate_config.val_sampling_config if validation else generate_config.sampling_config)


# -------------------------------------------------------------------------------------------------- outputs
@dataclass
class Turns:
    """What a multi-turn trajectory (:mod:`mm_rl.rollout.multi_turn`) holds besides its tokens: which of them the
    model generated, the images its tools returned, and counts for the metrics."""

    loss_mask: list[int]  # per response token: 1 generated by the model, 0 a tool turn (answers and turn markers)
    images: list[Image.Image] = field(default_factory=list)  # the tools' images, in the order their pads appear
    turns: int = 1  # model turns
    tool_calls: int = 0
    tool_errors: int = 0  # calls that failed or could not run (malformed ones included)
    malformed: int = 0  # calls the model got wrong: format, tool name, arguments
    tool_s: float = 0.0  # time its tool calls took

    def answer(self, response_ids: Sequence[int]) -> list[int]:
        """The ids of the last model turn (the final answer a reward reads)."""
        start = len(self.loss_mask)
        while start > 0 and self.loss_mask[start - 1]:
            start -= 1
        return list(response_ids[start : len(self.loss_mask)])


@dataclass
class RolloutSample:
    """One sampled response: its ids (the stop token included when it stopped), and per-token log-probs.

    ``logprobs[i]`` is the log-probability of ``response_ids[i]`` under the distribution it was sampled from:
    logits divided by the temperature, then top-k / top-p masking (greedy: the untempered distribution).
    ``top_logprobs`` holds the ``logprobs`` best alternatives per position when asked for, else None.
    """

    response_ids: list[int]
    logprobs: torch.Tensor  # float32 [len(response_ids)]
    finish_reason: FinishReason
    top_logprobs: list[dict[int, float]] | None = None
    turns: Turns | None = None  # a multi-turn trajectory: ``response_ids`` holds its tool turns too

    @property
    def generated(self) -> int:
        """Tokens the model generated (a trajectory's tool turns left out)."""
        return sum(self.turns.loss_mask) if self.turns is not None else len(self.response_ids)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the log-probs as a numpy array: a torch tensor pickles ~15x slower, which made the Ray round
        trip of a batch's outputs cost more than the sampling overhead of the engine."""
        return self.__dict__ | {"logprobs": self.logprobs.detach().cpu().numpy()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        import torch

        # a copy: arrays Ray maps from its object store are read-only
        self.__dict__.update(state | {"logprobs": torch.tensor(state["logprobs"], dtype=torch.float32)})


@dataclass
class BatchTiming:
    """Wall time of one ``generate`` call and the tokens it produced."""

    wall_s: float
    generated_tokens: int

    @property
    def tok_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class RolloutOutput:
    """The n samples of one request, with the prompt ids they were conditioned on (the actor's ids)."""

    prompt_ids: list[int]
    samples: list[RolloutSample]
    timing: BatchTiming
    uid: int | str | None = None
    skipped: str | None = None  # why the bounds policy dropped the request (then ``samples`` is empty)
    truncated: bool = False  # the overflow policy shortened ``prompt_ids``
    replica: int = 0  # the engine replica that generated it (mm_rl.rollout.replicas)


@dataclass
class RolloutMetrics:
    """Counts of one batch; ``as_dict`` gives flat ``rollout/...`` metrics for the logger."""

    prompts: int = 0
    samples: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    stopped: int = 0  # samples that ended on a stop token
    truncated_by_length: int = 0  # samples cut at max_tokens
    prompts_skipped: int = 0
    prompt_overflow_skipped: int = 0
    prompt_overflow_truncated: int = 0
    prompt_tokens_truncated: int = 0
    images_out_of_bounds: int = 0  # images outside [min_pixels, max_pixels] (resized or skipped)
    images_resized: int = 0
    image_bounds_skipped: int = 0  # prompts skipped because an image was out of bounds (policy "skip")
    image_unusable_skipped: int = 0  # prompts skipped whatever the policy (aspect ratio, too many images, ...)
    replicas: int = 1  # engine replicas that shared the batch
    replica_prompts_min: int = 0  # the fewest prompts a replica generated (0: one stood idle)
    replica_wall_spread: float = 1.0  # the slowest replica's wall time over the fastest's (1: balanced)

    @property
    def tok_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self, prefix: str = "rollout/") -> dict[str, float]:
        return {prefix + key: float(value) for key, value in asdict(self).items()} | {
            prefix + "tok_per_s": self.tok_per_s
        }


class RolloutOutputs(list):  # list[RolloutOutput]; a list subclass so it pickles across Ray with its metrics
    """``generate``'s result: the outputs in request order, plus ``metrics`` of the batch."""

    def __init__(self, outputs: Iterable[RolloutOutput] = (), metrics: RolloutMetrics | None = None) -> None:
        super().__init__(outputs)
        self.metrics = metrics or RolloutMetrics()

    @property
    def timing(self) -> BatchTiming:
        return BatchTiming(self.metrics.wall_s, self.metrics.generated_tokens)


# --------------------------------------------------------------------------------------------------- engine
class RolloutEngine(abc.ABC):
    """A rollout engine: ``generate``, weight updates, sleep / wake.

    ``generate`` applies the bounds policy (``mm_rl.rollout.bounds``), hands the admitted requests to the
    backend's ``_generate`` and assembles index-aligned outputs with timing and counts.
    """

    def __init__(self, bounds: BoundsPolicy) -> None:
        self.bounds = bounds
        self.asleep: set[str] = set()  # memory kinds released by sleep() and not yet taken back

    # ---- backend hooks
    @abc.abstractmethod
    def _generate(self, requests: Sequence[RolloutRequest], spec: SamplingSpec) -> list[list[RolloutSample]]:
        """n samples for each (admitted) request, in order."""

    @abc.abstractmethod
    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Apply HF-named tensors; returns how many were applied."""

    def _sleep(self, level: int) -> None:  # noqa: B027 - optional hook
        """Release device memory (backend-specific); default: nothing to release."""

    def _wake_up(self, tags: Sequence[str] | None) -> None:  # noqa: B027 - optional hook
        """Re-acquire what ``_sleep`` released (all of it, or the memory of the given tags)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free the engine's resources."""

    def _begin_weight_update(self) -> None:  # noqa: B027 - optional hook
        """Set up what loading a sync's buckets needs, once per sync; default: nothing."""

    def _end_weight_update(self) -> None:  # noqa: B027 - optional hook
        """Finish what :meth:`_begin_weight_update` set up, after the sync's last bucket."""

    @abc.abstractmethod
    def _reseed(self, seed: int) -> None:
        """Restart the sampling RNG from ``seed``."""

    # ---- the contract
    def generate(
        self, requests: Sequence[RolloutRequest], sampling: SamplingLike | SamplingSpec, n: int | None = None
    ) -> RolloutOutputs:
        """n samples per request (``n`` defaults to the section's), index-aligned with ``requests``."""
        from mm_rl.rollout.bounds import apply_bounds

        self._require_awake()
        spec = SamplingSpec.of(sampling, n)
        start = time.perf_counter()
        admitted, metrics = apply_bounds(requests, self.bounds, spec.max_tokens)
        kept = [item.request for item in admitted if item.request is not None]
        results = iter(self._sample_all(kept, spec) if kept else [])
        outputs = RolloutOutputs(metrics=metrics)
        timing = BatchTiming(0.0, 0)  # one object shared by the batch, filled in below
        for original, item in zip(requests, admitted, strict=True):
            if item.request is None:
                outputs.append(RolloutOutput(list(original.prompt_ids), [], timing, original.uid, item.skipped))
                continue
            samples = next(results)
            outputs.append(RolloutOutput(item.request.prompt_ids, samples, timing, original.uid, None, item.truncated))
        metrics.replica_prompts_min = len(requests)  # one engine: every prompt
        count_samples(outputs, start)
        return outputs

    def _require_awake(self) -> None:
        """vLLM would wait forever for its paused scheduler: refuse to generate while any memory sleeps."""
        if self.asleep:
            raise RuntimeError(
                f"the rollout engine's {' and '.join(sorted(self.asleep))} memory is asleep: call "
                "wake_up() before generate()"
            )

    def continue_turns(self, requests: Sequence[RolloutRequest], spec: SamplingSpec) -> list[RolloutSample]:
        """One sample per request, without the bounds policy: the later turns of multi-turn trajectories, whose
        prompts are the admitted prompt plus the turns so far (the trajectory's budget bounds them)."""
        self._require_awake()
        return [group[0] for group in self._sample_all(requests, dataclasses.replace(spec, n=1))]

    def _sample_all(self, requests: Sequence[RolloutRequest], spec: SamplingSpec) -> list[list[RolloutSample]]:
        """Greedy with n > 1 decodes once and repeats the sample (vLLM refuses n > 1 without sampling, and n
        greedy decodes are the same decode); copies, so a caller editing one sample leaves the others alone."""
        if not spec.greedy or spec.n == 1:
            return self._generate(requests, spec)
        once = self._generate(requests, dataclasses.replace(spec, n=1))
        return [[copy_sample(s) for s in group for _ in range(spec.n)] for group in once]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named tensors (an iterator is consumed lazily); returns how many were applied."""
        count = self._load_weights(named_tensors)
        return count

    def device_identities(self) -> list[str | None]:
        """The devices of the processes that load this engine's weights, one per rank it puts in an actor stage's
        weight-sync group (:mod:`mm_rl.sync.transport`). Here one: this process receives and loads."""
        from mm_rl.platform.device import device_identity

        return [device_identity()]

    def join_sync_group(self, key: str, stage: int, host: str, port: int, ranks: list[int | None], world: int) -> None:
        """Join ``stage``'s weight-sync group: loading process i as ``ranks[i]`` of ``world`` (None: it sits on the
        sender's device and maps the sender's buffer instead)."""
        from mm_rl.sync.transport import join_group

        if ranks[0] is not None:
            join_group(key, stage, host, port, rank=ranks[0], world=world)

    def receive_weights(self, bucket: DeviceBucket) -> int:
        """Load one bucket of a device sync (:class:`mm_rl.sync.transport.DeviceSink`): broadcast over its stage's
        group as this runs, or read out of the sender's buffer (its ``handle``) by a process on its device. Returns
        how many tensors were applied; the loads are waited for (the sender reuses its buffer afterwards)."""
        from mm_rl.platform.device import current_device, synchronize
        from mm_rl.sync.transport import receive_bucket

        count = self._load_weights(receive_bucket(bucket))
        synchronize(current_device())
        return count

    def begin_weight_update(self) -> None:
        """A sync's buckets follow (:meth:`update_weights`), then :meth:`end_weight_update`: the engine's per-sync
        set-up happens once, not once per bucket. ``update_weights`` also works alone (its own set-up)."""
        self._begin_weight_update()

    def end_weight_update(self) -> None:
        self._end_weight_update()

    def reseed(self, seed: int) -> None:
        """Restart sampling from ``seed``: the same requests after the same seed give the same samples. The
        trainer reseeds before every rollout from (seed, step), so a resumed run samples what an uninterrupted
        one did."""
        self._reseed(seed)

    def sleep(self, level: int = 1) -> None:
        """Free device memory for training (level 1: keep weights in host memory; 2: drop them)."""
        if not self.asleep:
            self._sleep(level)
        self.asleep = set(MEMORY_TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-acquire device memory: all of it, or only that of ``"weights"`` / ``"kv_cache"`` (a colocated sync
        wakes the weights, lets the actor offload, then wakes the KV cache into the memory that freed). The backend
        is asked only for what is asleep (the schedule also wakes a fresh, awake engine before its first rollout),
        and :meth:`generate` refuses until everything is awake: vLLM would wait forever for its paused
        scheduler."""
        waking = sorted(self.asleep if tags is None else self.asleep & set(tags))
        if waking:
            self._wake_up(waking)
        self.asleep -= set(waking)


def copy_sample(sample: RolloutSample) -> RolloutSample:
    return dataclasses.replace(
        sample,
        response_ids=list(sample.response_ids),
        logprobs=sample.logprobs.clone(),
        top_logprobs=None if sample.top_logprobs is None else [dict(p) for p in sample.top_logprobs],
    )


def count_samples(outputs: RolloutOutputs, start: float) -> None:
    """The batch's sample counts, generated tokens (the model's) and wall time since ``start``, in its metrics and
    in the timing its outputs share: after the engine's ``generate``, and again once a multi-turn loop has put
    whole trajectories in place of the first turns."""
    metrics = outputs.metrics
    metrics.wall_s = time.perf_counter() - start
    samples = [sample for output in outputs for sample in output.samples]
    metrics.samples = len(samples)
    metrics.generated_tokens = sum(sample.generated for sample in samples)
    metrics.stopped = sum(sample.finish_reason == "stop" for sample in samples)
    metrics.truncated_by_length = sum(sample.finish_reason == "length" for sample in samples)
    for output in outputs:  # one timing object, shared by the batch's outputs
        output.timing.wall_s, output.timing.generated_tokens = metrics.wall_s, metrics.generated_tokens
