"""Ray test helpers."""

from __future__ import annotations

import pickle
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


def through_object_store(value: Any) -> tuple[Any, int]:
    """``value`` as another process gets it from Ray's object store, and how many buffers travelled out of band:
    pickled with protocol 5, the buffers handed over apart and mapped read-only by the reader, as the store maps
    them."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=[memoryview(b).toreadonly() for b in buffers]), len(buffers)
