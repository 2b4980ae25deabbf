"""One run per output directory: ``train`` holds a lock on its run directory (and on the checkpoint directory when
that lies elsewhere) for the whole job, so a second run on the same directory is refused at once instead of
cutting the first one's metrics and overwriting its checkpoints.

The lock is ``.mm_rl.lock`` in the directory: an exclusive ``flock`` held by the running process (the kernel drops it
when the process dies, however it dies) and, inside, who holds it (host, pid, start time, command) with a heartbeat
the holder refreshes every :data:`HEARTBEAT_S` seconds. ``flock`` does not reach across nodes on every shared file
system, so a lock file written by another node whose heartbeat is fresh refuses the run too; one whose heartbeat is
older than :data:`STALE_S` (a node that no longer answers) is taken over, with a notice, as is one left by a process
of this node that is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mm_rl.config.loader import ConfigError, Violation

LOCK_FILE = ".mm_rl.lock"
HEARTBEAT_S = 10.0
STALE_S = 60.0


def _holder_text(holder: dict[str, Any]) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')} since {started} ({holder.get('command', '?')})"


def _read(fd: int) -> dict[str, Any] | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 1 << 16).decode(errors="replace").strip()
    try:
        holder = json.loads(text) if text else None
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _write(fd: int, holder: dict[str, Any]) -> None:
    data = json.dumps(holder).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _refusal(directory: Path, key: str, holder: dict[str, Any] | None) -> ConfigError:
    who = _holder_text(holder) if holder else "another process"
    return ConfigError([Violation(
        key, str(directory), f"another run is using it: {who}",
        f"wait for that run to end (or stop it), or give this run another {key}")])  # fmt: skip


@contextlib.contextmanager
def run_lock(directory: Path, key: str, report: Callable[[str], None] = print) -> Iterator[None]:
    """Hold ``directory``'s lock while the block runs (``key``: the job key that names the directory, for the
    refusal); a :class:`ConfigError` when another live run holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _refusal(directory, key, _read(fd)) from None
        previous, host = _read(fd), socket.gethostname()
        if previous and previous.get("host") != host and time.time() - previous.get("beat", 0) < STALE_S:
            raise _refusal(directory, key, previous)  # a live run on another node
        if previous:
            report(f"notice: {path} was left by {_holder_text(previous)}, which is gone: taking it over")
        holder = {"host": host, "pid": os.getpid(), "started": time.time(), "beat": time.time(),
                  "command": " ".join(sys.argv)}  # fmt: skip
        _write(fd, holder)
        stop = threading.Event()
        beat = threading.Thread(target=_heartbeat, args=(fd, holder, stop), name="run-lock-heartbeat", daemon=True)
        beat.start()
        try:
            yield
        finally:
            stop.set()
            beat.join()
            os.ftruncate(fd, 0)  # released: nothing for the next run to take over
    finally:
        os.close(fd)  # drops the flock


def _heartbeat(fd: int, holder: dict[str, Any], stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        holder["beat"] = time.time()
        with contextlib.suppress(OSError):  # a full disk must not kill the run over its lock's heartbeat
            _write(fd, holder)
