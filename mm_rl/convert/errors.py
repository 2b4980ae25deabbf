"""The error a conversion raises for a checkpoint that does not fit (missing, unexpected or misshapen tensors,
missing or half-written files): the message names the file and the tensors, so a user can act without a
traceback. Configuration mistakes (pipeline split, TP) are ``mm_rl.config.loader.ConfigError`` instead."""

from __future__ import annotations

from collections.abc import Sequence

MAX_LISTED = 12


class ConversionError(RuntimeError):
    """A checkpoint the converter cannot use; ``str(err)`` is the whole user-facing message."""


def listing(items: Sequence[str], limit: int = MAX_LISTED) -> str:
    """Items one per line, capped: a wrong model config can mismatch hundreds of tensors."""
    shown = [f"    {item}" for item in items[:limit]]
    if len(items) > limit:
        shown.append(f"    ... and {len(items) - limit} more")
    return "\n".join(shown)
