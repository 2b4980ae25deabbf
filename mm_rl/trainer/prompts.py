"""Where the trainer's prompts come from: the processor, the train / validation sets, the sampler, and the step's
prompt cache.

The cache keeps the processed rows (ids, pixel values, grid) of the step's train prompts between the rollout and
the actor passes, so each row is decoded and processed once per step; the trainer empties it at the start of a
step. While the actor trains, the rows of the sampler's next batch are processed ahead in one background thread
(:meth:`PromptSource.prefetch`), off the next rollout's critical path. Nothing here talks to Ray: it runs in the
trainer's process.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from mm_rl.models.family import QWEN_VISION_TOKENS
from mm_rl.models.registry import family_of
from mm_rl.rollout.bounds import vision_token_ids

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from mm_rl.config.schema import JobConfig
    from mm_rl.data.dataset import PromptItem
    from mm_rl.rollout.base import RolloutRequest


class PromptSource:
    """The job's prompts: ``next_indices`` draws a rollout batch, ``requests`` turns rows into engine requests."""

    def __init__(
        self,
        processor: Any,
        train_set: Any,
        val_set: Any | None,
        sampler: Any,
        num_workers: int = 0,
        vision_tokens: tuple[str, ...] = QWEN_VISION_TOKENS,
    ) -> None:
        self.processor, self.train_set, self.val_set, self.sampler = processor, train_set, val_set, sampler
        self.num_workers = num_workers
        self.pad_id = int(processor.tokenizer.pad_token_id or 0)
        self.vision_token_ids = vision_token_ids(processor.tokenizer, vision_tokens)
        self.image_token_id: int = processor.image_token_id
        self.cached: dict[int, PromptItem] = {}  # data-set index -> processed train row, for this step
        self._ahead: tuple[list[int], Future[list[PromptItem]]] | None = None  # a prefetch: its indices and rows
        self._thread: ThreadPoolExecutor | None = None

    @classmethod
    def from_job(cls, job: JobConfig) -> PromptSource:
        """The processor, data sets (validation only when asked for) and sampler the job's yaml names."""
        from mm_rl.data.dataset import PromptDataset, PromptProcessor
        from mm_rl.data.sampler import PromptSampler
        from mm_rl.data.tool_prompts import ToolPromptProcessor
        from mm_rl.data.video import VideoSettings

        b = job.backend_config
        pre = b.data.dataset_param.preprocess_parameters
        turns = b.rl_config.multi_turn
        if turns.enable:  # the prompts describe the tools
            processor = ToolPromptProcessor.for_job(pre.model_name_or_path, pre.min_pixels, pre.max_pixels, turns)
        else:
            processor = PromptProcessor(
                pre.model_name_or_path, pre.min_pixels, pre.max_pixels, VideoSettings.from_config(pre)
            )
        train_set = PromptDataset.from_config(b.data, "train", processor)
        val_set = PromptDataset.from_config(b.data, "val", processor) if b.rl_config.validates else None
        sampler = PromptSampler(
            len(train_set), b.rl_config.rollout_batch_size, int(b.training.seed), shuffle=b.data.shuffle
        )
        return cls(processor, train_set, val_set, sampler, b.training.num_workers, family_of(b.model).vision_tokens)

    def next_indices(self) -> list[int]:
        """The data-set indices of the next rollout batch (the sampler's order is a function of seed and epoch)."""
        return list(next(self.sampler))

    def val_indices(self) -> list[int]:
        return list(range(len(self.val_set))) if self.val_set is not None else []

    def requests(self, indices: Sequence[int], split: str = "train") -> list[RolloutRequest]:
        """Rollout requests of data-set rows; train rows stay cached for the step's micro-batches."""
        from mm_rl.rollout.base import RolloutRequest

        items = self._take_ahead(indices) if split == "train" else None
        if items is None:
            self.settle()
            items = self._load(self._dataset(split), indices)
        if split == "train":
            self.cached.update(zip(indices, items, strict=True))
        return [RolloutRequest.from_item(item) for item in items]

    def prefetch(self) -> None:
        """Process the rows of the batch the sampler draws next in a background thread, leaving it undrawn (the
        sampler's state, and so a checkpoint, does not move): called while the actor trains, the next draw's
        :meth:`requests` then finds its rows processed. Until the thread is done every other use of the processor
        waits for it (:meth:`settle`): a fast tokenizer refuses to be used by two threads at once."""
        self.settle()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="mm_rl-prompts")
        indices = self.sampler.peek()
        self._ahead = (indices, self._thread.submit(functools.partial(self._load, self.train_set, indices, True)))

    def settle(self) -> None:
        """Wait for a prefetch under way (its rows, or its error, stay for the draw they belong to)."""
        if self._ahead is not None:
            wait([self._ahead[1]])

    def close(self) -> None:
        """Stop the prefetch thread (a prefetch under way is waited for)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
            self._thread, self._ahead = None, None

    def _take_ahead(self, indices: Sequence[int]) -> list[PromptItem] | None:
        """The prefetched rows when they are these rows (a data problem raised here, as the draw's own); else
        None, the prefetch dropped."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if ahead[0] != list(indices):
            wait([ahead[1]])
            return None
        return ahead[1].result()

    def retain(self, indices: Sequence[int]) -> None:
        """Keep only these rows cached (the step's; a batch started ahead adds its own)."""
        keep = set(indices)
        self.cached = {index: item for index, item in self.cached.items() if index in keep}

    def ground_truth(self, index: int, split: str = "train") -> str:
        return self._dataset(split).ground_truth(index)

    def prompt_text(self, index: int, split: str = "train") -> str:
        return self._dataset(split).prompt_text(index)

    def video_frames(self, index: int, split: str = "train") -> list[int]:
        """The frames sampled from each of the row's videos (none without videos)."""
        return self._dataset(split).video_frames(index)

    def row_id(self, index: int, split: str = "train") -> int:
        """The row's position in its split's files (a data-set index counts usable rows only)."""
        return self._dataset(split).row_id(index)

    def decode(self, responses: Sequence[Sequence[int]]) -> list[str]:
        self.settle()
        return self.processor.tokenizer.batch_decode([list(r) for r in responses], skip_special_tokens=True)

    def images(self, images: Sequence[Image.Image]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The processor's ``images`` (a trajectory's tool images: their token counts, pixels and grids)."""
        self.settle()
        return self.processor.images(images)

    def trajectory_text(self, response: Sequence[int]) -> str:
        """A multi-turn trajectory as the log shows it: every turn with its markers, one pad per image."""
        self.settle()
        text = self.processor.tokenizer.decode(list(response), skip_special_tokens=False)
        pad = self.processor.image_pad
        return re.sub(f"(?:{re.escape(pad)})+", pad, text)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def _dataset(self, split: str) -> Any:
        if split == "train":
            return self.train_set
        if self.val_set is None:
            raise RuntimeError("the job has no validation set (rl_config.val_freq is 0 and val_before_train off)")
        return self.val_set

    def _load(self, dataset: Any, indices: Sequence[int], ahead: bool = False) -> list[PromptItem]:
        """Decode and process the rows (images, pixels), with ``num-workers`` threads when asked; in a helper
        thread (``ahead``: the prefetch's) or its workers, torch runs each op on one thread (see
        :func:`mm_rl.platform.device.helper_threads_without_intra_op`)."""
        from mm_rl.platform.device import helper_threads_without_intra_op

        helpers = ahead or self.num_workers > 0
        with helper_threads_without_intra_op() if helpers else contextlib.nullcontext():
            if self.num_workers <= 0:
                return [dataset[i] for i in indices]
            with ThreadPoolExecutor(self.num_workers) as pool:
                return list(pool.map(dataset.__getitem__, indices))
