"""Ray test helpers."""

from __future__ import annotations

import time
from typing import Any


def kill_and_wait(ray: Any, actor: Any, method: str, timeout_s: float = 60.0) -> None:
    """Kill ``actor`` and wait until a call of its ``method`` (no arguments) fails: ``ray.kill`` only asks, and a
    call made right after it can still reach the live actor and succeed."""
    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(getattr(actor, method).remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the killed actor still answered after {timeout_s:.0f} s")
