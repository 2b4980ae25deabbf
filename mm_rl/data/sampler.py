"""Resumable prompt sampler: batches of dataset indices, shuffled deterministically per epoch.

The order of epoch ``e`` is ``torch.randperm(n)`` from a generator seeded with ``seed + e``, so it depends only
on (seed, epoch, n), never on how many batches were drawn before. The state is therefore just (epoch, position):
a run resumed from ``state_dict()`` draws exactly the prompts the original run would have drawn next.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class PromptSampler(Iterator[list[int]]):
    """Endless iterator of batches of ``batch_size`` indices into a data set of ``num_items`` prompts.

    Batches never span two epochs. With ``drop_last`` (training) the remainder of an epoch (``num_items %
    batch_size`` prompts, different ones each epoch) is skipped so every batch is full; without it the last
    batch of an epoch is short.
    """

    def __init__(
        self, num_items: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_items < (batch_size if drop_last else 1):
            raise ValueError(f"{num_items} prompts cannot fill a batch of {batch_size}")
        self.num_items, self.batch_size, self.seed = num_items, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.position = 0, 0
        self._order: list[int] | None = None

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_items, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def epoch_order(self, epoch: int) -> list[int]:
        """The index order of ``epoch``: a pure function of (seed, epoch, num_items)."""
        import torch

        if not self.shuffle:
            return list(range(self.num_items))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_items, generator=generator).tolist()

    def _epoch_end(self) -> int:
        return self.num_items - self.num_items % self.batch_size if self.drop_last else self.num_items

    def __next__(self) -> list[int]:
        if self.position >= self._epoch_end():
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self.epoch_order(self.epoch)
        batch = self._order[self.position : self.position + self.batch_size]
        self.position += len(batch)
        return batch

    def peek(self) -> list[int]:
        """The batch ``next`` would draw, left undrawn: the state (and a checkpoint taken now) does not move."""
        epoch, position = self.epoch, self.position
        if position >= self._epoch_end():
            epoch, position = epoch + 1, 0
        order = self._order if epoch == self.epoch and self._order is not None else self.epoch_order(epoch)
        return order[position : position + self.batch_size]

    def __iter__(self) -> PromptSampler:
        return self

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch starts, plus what the order depends on (checked when loading)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_items": self.num_items,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the last prompt drawn; a changed seed or data set size would silently change the
        order, so it is refused. A changed batch size is fine: the position counts prompts, not batches."""
        for key in ("seed", "num_items", "shuffle"):
            if state.get(key, getattr(self, key)) != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this run has {getattr(self, key)!r}; "
                    "the prompt order would differ, so the run cannot resume where it stopped"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_items:
            raise ValueError(f"invalid sampler state epoch={epoch} position={position}")
        self.epoch, self.position, self._order = epoch, position, None
