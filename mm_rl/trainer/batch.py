"""The step's samples on the driver, and the micro-batches the Megatron ranks consume.

A :class:`Sample` is one response with everything the step learns about it: the prompt it answers (data-set
index and group), its ids, reward, and then the actor's old log-probs, the reference log-probs and the
advantages, all as 1-D tensors over the response tokens. Micro-batches are right-padded prompt + response
ids with ``labels`` shifted by one (``labels[s]`` is the token position ``s`` predicts), so the response
token ``i`` sits at position ``len(prompt) - 1 + i`` of the log-prob rows; :func:`micro_batches` scatters
the per-sample tensors there and :func:`response_values` reads them back. A group's samples sit side by side and
answer the same prompt: ``shared_prompt`` tells the model which rows repeat the row before's prompt, which it then
computes once (:class:`mm_rl.models.qwen_vl.llm_attention.PackedRows`).

Images travel apart from the micro-batches: the n samples of a prompt share its image, so the driver hands the
ranks the step's distinct prompt images once (:func:`step_images`) and a micro-batch names each row's prompt by
``image_index`` (data-set index), keeping only the small ``image_grid_thw`` of its rows (the mRoPE positions need
it per sample). The rank puts the pixel values together at its device boundary
(:func:`mm_rl.platform.transfer.image_inputs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mm_rl.partition import largest_first
from mm_rl.platform.transfer import NO_TOOL_IMAGES

if TYPE_CHECKING:
    from mm_rl.data.dataset import PromptItem
    from mm_rl.platform.transfer import StepImages
    from mm_rl.rollout.base import FinishReason, Turns


@dataclass
class Sample:
    """One rollout response; the fields below ``reward`` are filled as the step goes."""

    index: int  # data-set index of the prompt
    group: int  # the prompt's position among the step's prompts (the GRPO group)
    prompt_ids: list[int]
    response_ids: list[int]
    finish_reason: FinishReason
    text: str = ""
    ground_truth: str = ""
    engine_log_probs: torch.Tensor | None = None  # what the rollout engine reported for the sampled tokens
    staleness: int = 0  # weight versions between the policy that generated it and the one that trains on it
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    # a multi-turn trajectory: its tool turns sit in response_ids, left out of the loss by loss_mask
    turns: Turns | None = None
    loss_mask: torch.Tensor | None = None  # float [response_len]: 1 on the tokens the model generated
    tool_images: tuple[torch.Tensor, torch.Tensor] | None = None  # the tools' images: (pixel_values, grids)
    image_key: int | None = None  # the step's key of its tool images (the prompt's stay under its index)

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    @property
    def trained_tokens(self) -> int:
        """Response tokens the loss covers (a trajectory's model tokens)."""
        return self.response_len if self.loss_mask is None else int(self.loss_mask.sum())

    def mask(self) -> torch.Tensor:
        """Per response token, 1 where the loss applies."""
        return torch.ones(self.response_len) if self.loss_mask is None else self.loss_mask


def tokens(sample: Sample) -> int:
    """The positions a sample takes in a micro-batch row: prompt (image placeholders included) + response."""
    return len(sample.prompt_ids) + sample.response_len


def by_count(samples: Sequence[Sample], size: int) -> list[list[Sample]]:
    """Consecutive runs of ``size`` samples (``micro_batch_size``)."""
    return [list(samples[i : i + size]) for i in range(0, len(samples), size)]


def computed_tokens(run: Sequence[Sample], packed: bool) -> int:
    """Positions the model computes for a micro-batch: its tokens when packed, rows x longest row when padded."""
    return sum(map(tokens, run)) if packed else len(run) * max(map(tokens, run))


def by_tokens(samples: Sequence[Sample], budget: int, packed: bool = True) -> list[list[Sample]]:
    """Consecutive runs of samples, each computing (:func:`computed_tokens`) at most ``budget`` positions: short
    responses share a micro-batch, long ones get fewer rows. A group (a prompt's samples, consecutive) that does not
    fit the current run starts the next one when it fits a run of its own, so its image is encoded once; only a
    group larger than the budget is split. A sample longer than the budget is a config error caught by ``check``
    (the budget must hold the longest possible sequence)."""
    runs: list[list[Sample]] = []
    for group in _groups(samples):
        if runs and computed_tokens([*runs[-1], *group], packed) <= budget:
            runs[-1].extend(group)
            continue
        if computed_tokens(group, packed) <= budget:
            runs.append(list(group))
            continue
        for sample in group:
            if tokens(sample) > budget:
                raise ValueError(
                    f"a sample of {tokens(sample)} tokens does not fit the micro-batch budget of {budget} tokens"
                )
            if runs and computed_tokens([*runs[-1], sample], packed) <= budget:
                runs[-1].append(sample)
            else:
                runs.append([sample])
    return runs


def same_run_count(replicas: Sequence[Sequence[Sequence[Sample]]]) -> list[list[list[Sample]]]:
    """Every replica's runs, as many on each: expert parallelism exchanges tokens between DP replicas inside each
    MoE layer (megatron's all-to-all, once per micro-batch), so every replica must run the same number of
    micro-batches. A replica short of runs splits its largest run (by samples) in two, as long as some run has
    two samples; then any replica with more runs than the others can match merges its two smallest neighbours
    (the token budget is then exceeded by at most that merge). A replica without samples has no run to give:
    an error."""
    out = [[list(run) for run in runs] for runs in replicas]
    if any(not runs for runs in out) and any(out):
        raise ValueError(
            "a data-parallel replica got no samples while others did: with expert parallelism every "
            "replica must run micro-batches (use more samples than DP replicas)"
        )
    target = max(len(runs) for runs in out)
    for runs in out:
        while len(runs) < target and max(len(run) for run in runs) > 1:
            k = max(range(len(runs)), key=lambda i: len(runs[i]))
            runs[k : k + 1] = [runs[k][: len(runs[k]) // 2], runs[k][len(runs[k]) // 2 :]]
    target = min(len(runs) for runs in out)
    for runs in out:
        while len(runs) > target:
            k = min(range(len(runs) - 1), key=lambda i: len(runs[i]) + len(runs[i + 1]))
            runs[k : k + 2] = [runs[k] + runs[k + 1]]
    return out


def _groups(samples: Sequence[Sample]) -> list[list[Sample]]:
    """Runs of consecutive samples of the same group."""
    groups: list[list[Sample]] = []
    for sample in samples:
        if groups and groups[-1][0].group == sample.group:
            groups[-1].append(sample)
        else:
            groups.append([sample])
    return groups


def balanced_shards(samples: Sequence[Sample], parts: int) -> list[list[Sample]]:
    """``parts`` shards (one per DP replica) with token totals as even as a largest-first greedy assignment makes
    them, so no replica waits for another; whole groups move together unless there are fewer groups than parts.
    Each shard keeps the step's order."""
    if len(samples) < parts:
        raise ValueError(f"{len(samples)} samples cannot fill {parts} data-parallel replicas")
    units = _groups(samples)
    if len(units) < parts:
        units = [[sample] for sample in samples]
    members = largest_first([sum(map(tokens, unit)) for unit in units], parts)
    return [[sample for unit in chosen for sample in units[unit]] for chosen in members]


def padding_share(runs: Sequence[Sequence[Sample]], packed: bool = False) -> float:
    """The share of a pass's computed micro-batch positions that are padding (none when packed)."""
    computed = sum(computed_tokens(run, packed) for run in runs)
    return 1.0 - sum(tokens(s) for run in runs for s in run) / computed if computed else 0.0


def micro_batches(
    runs: Sequence[Sequence[Sample]], items: dict[int, PromptItem], pad_id: int, fields: Sequence[str] = ()
) -> list[dict[str, torch.Tensor]]:
    """Each run of samples (see :func:`by_count`, :func:`by_tokens`) as one micro-batch of model inputs, plus
    ``response_mask`` and the named per-token ``fields`` of the samples (see the module docstring for the
    alignment)."""
    return [_micro_batch(run, items, pad_id, fields) for run in runs]


def _micro_batch(
    samples: Sequence[Sample], items: dict[int, PromptItem], pad_id: int, fields: Sequence[str]
) -> dict[str, torch.Tensor]:
    width = max(len(s.prompt_ids) + s.response_len for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    shared = torch.zeros(len(samples), dtype=torch.long)
    response_mask = torch.zeros(len(samples), width, dtype=torch.float32)
    extra = {name: torch.zeros(len(samples), width, dtype=torch.float32) for name in fields}
    for row, sample in enumerate(samples):
        prompt, length = len(sample.prompt_ids), len(sample.prompt_ids) + sample.response_len
        ids[row, :length] = torch.tensor(sample.prompt_ids + sample.response_ids, dtype=torch.long)
        mask[row, :length] = 1
        if row and sample.index == samples[row - 1].index and sample.prompt_ids == samples[row - 1].prompt_ids:
            shared[row] = prompt - 1  # the last prompt token stays: it predicts this row's first response token
        span = slice(prompt - 1, length - 1)
        response_mask[row, span] = sample.mask()
        for name in fields:
            extra[name][row, span] = getattr(sample, name)
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": torch.roll(ids, -1, dims=1),
        "response_mask": response_mask,
        "shared_prompt": shared,
        **extra,
        "image_index": torch.tensor([s.index for s in samples], dtype=torch.long),
    }
    if any(s.image_key is not None for s in samples):  # multi-turn: the rows' tool images, apart from the prompt's
        batch["tool_image_index"] = torch.tensor(
            [NO_TOOL_IMAGES if s.image_key is None else s.image_key for s in samples]
        )
    grids = [_grids(s, items) for s in samples]
    if any(grid.numel() for grid in grids):
        batch["image_grid_thw"] = torch.cat(grids)
    if any(items[s.index].mrope_time_steps is not None for s in samples):  # videos: their positions' time steps
        steps = [_time_steps(sample, items, len(grid)) for sample, grid in zip(samples, grids, strict=True)]
        batch["mrope_time_steps"] = torch.cat(steps)
    return batch


def _time_steps(sample: Sample, items: dict[int, PromptItem], entries: int) -> torch.Tensor:
    """The mRoPE time step of every image and video entry in the sample's sequence (1 for an image)."""
    steps = items[sample.index].mrope_time_steps
    ones = torch.ones(entries, dtype=torch.float64)
    return ones if steps is None else torch.cat([steps, ones[len(steps) :]])


def _grids(sample: Sample, items: dict[int, PromptItem]) -> torch.Tensor:
    """The grids of every image in the sample's sequence: its prompt's, then its tools'."""
    grids = items[sample.index].image_grid_thw
    return grids if sample.tool_images is None else torch.cat([grids, sample.tool_images[1]])


def step_images(samples: Sequence[Sample], items: dict[int, PromptItem]) -> StepImages:
    """The images of the step's samples: each distinct prompt's by its data-set index, shared by its samples, and a
    multi-turn trajectory's tool images by its own key (:attr:`Sample.image_key`); handed to the ranks once per step,
    then named by the micro-batches' ``image_index`` / ``tool_image_index`` (text-only prompts hold empty tensors).
    Every distinct image is encoded once per micro-batch, a trajectory's prompt image included."""
    images: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for sample in samples:
        item = items[sample.index]
        images.setdefault(sample.index, (item.pixel_values, item.image_grid_thw))
        if sample.image_key is not None and sample.tool_images is not None:
            images[sample.image_key] = sample.tool_images
    return images


def payload_bytes(value: object) -> int:
    """Bytes of every tensor in ``value`` (nested lists, tuples, dicts): what handing it to a role ships."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(payload_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(payload_bytes(item) for item in value)
    return 0


def response_values(runs: Sequence[Sequence[Sample]], rows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each sample's response slice of the per-micro-batch [B, S] ``rows`` (one per run, as
    :func:`micro_batches` made them), in the runs' order."""
    out = []
    for run, values in zip(runs, rows, strict=True):
        for sample, row in zip(run, values, strict=True):
            start = len(sample.prompt_ids) - 1
            out.append(row[start : start + sample.response_len].float().clone())
    return out


def padded(samples: Sequence[Sample], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch, max_response_len]`` of a per-token field and the response mask."""
    mask = response_mask(samples)
    values = torch.zeros_like(mask)
    for row, sample in enumerate(samples):
        values[row, : sample.response_len] = getattr(sample, name)
    return values, mask


def response_mask(samples: Sequence[Sample]) -> torch.Tensor:
    """``[batch, max_response_len]``: 1 on each sample's response tokens that the loss covers (all of them, or a
    trajectory's model tokens), 0 on tool turns and padding."""
    mask = torch.zeros(len(samples), max(s.response_len for s in samples))
    for row, sample in enumerate(samples):
        mask[row, : sample.response_len] = sample.mask()
    return mask
