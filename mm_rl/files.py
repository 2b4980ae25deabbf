"""Files and directories that appear whole or not at all, even to a reader racing the writer or after a crash.

A file is written under a hidden temporary name beside its target and renamed over it (``atomic_path``,
``write_atomic``); a directory is built beside its target and swapped in by rename (``replace_dir``). With
``sync`` the data and the directory entry are flushed to disk first, so a crash soon after cannot leave a
complete-looking name over empty blocks. Temporary names start with ``.{target name}.`` so that the owners'
cleanup code can recognise its leftovers. This module imports nothing from mm_rl: every layer may use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush one file's or directory's data (a directory: its entries, e.g. a rename) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` to disk before it is renamed into place: otherwise a crash
    soon after could leave a complete-looking directory (and a latest file naming it) with empty files."""
    for path in sorted(root.rglob("*"), key=lambda p: -len(p.parts)) + [root]:
        fsync_path(path)


@contextlib.contextmanager
def atomic_path(path: Path, *, suffix: str = "", mode: int | None = None, sync: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for the caller to write (any writer that takes a path); on success
    it gets ``mode`` (mkstemp creates 0600) and is renamed over ``path``, on error it is removed, so readers see
    the old file or the new one, never half of one. ``sync`` flushes the file before the rename and the
    directory after it."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if mode is not None:
            tmp.chmod(mode)
        if sync:
            fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if sync:
        fsync_path(path.parent)


def write_atomic(
    path: Path, data: str | bytes, *, mode: int | None = 0o644, sync: bool = True, suffix: str = ""
) -> None:
    """Replace ``path`` by ``data`` (text as UTF-8) in one rename; see ``atomic_path`` for the arguments."""
    with atomic_path(path, suffix=suffix, mode=mode, sync=sync) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def save_torch_synced(obj: object, path: Path) -> None:
    """``torch.save`` then fsync, for files that a marker written afterwards vouches for: the marker must only
    ever reach the disk after the data. torch is imported here so this module stays light for its other users.
    A failed write is an OSError naming ``path`` (:func:`torch_write_error`)."""
    import torch

    with torch_write_error(path), open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


class NoSpace(OSError):
    """ENOSPC with what was needed and what is free (``detail``), for the message."""

    def __init__(self, path: Path, detail: str) -> None:
        super().__init__(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        self.detail = detail


_TORCH_WRITE_FAILED = ("inline_container", "PytorchStreamWriter failed", "file write failed", "unexpected pos")
_FULL_BELOW = 64 << 20  # free bytes under which a failed write is taken for a full disk


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or would: its nearest existing ancestor)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


@contextlib.contextmanager
def torch_write_error(path: Path) -> Iterator[None]:
    """torch's zip writer reports a failed write, a full disk above all, as a RuntimeError with no errno
    ("[enforce fail at inline_container.cc] ... unexpected pos ..."): inside, that becomes the OSError it stands
    for, naming ``path``: :class:`NoSpace` when the file system is (nearly) full, else EIO."""
    try:
        yield
    except RuntimeError as err:
        if not any(marker in str(err) for marker in _TORCH_WRITE_FAILED):
            raise
        free = free_bytes(path)
        if free < _FULL_BELOW:
            raise NoSpace(path, f"{_gib(free)} free") from err
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path)) from err


def os_error_in(error: BaseException | None) -> OSError | None:
    """The OSError with an errno that ``error`` is or was raised from: followed through ``__cause__`` and through
    Ray's task errors (``cause``: what the remote call raised; Ray's copy carries no errno of its own)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno is not None:
            return error
        error = getattr(error, "cause", None) or error.__cause__
    return None


def require_space(directory: Path, need: int, what: str) -> None:
    """:class:`NoSpace` unless ``directory``'s file system has ``need`` bytes free for ``what``: checked before a
    save or a conversion starts, rather than found full half-way."""
    free = free_bytes(directory)
    if free < need:
        raise NoSpace(directory, f"{what} needs about {_gib(need)}, {_gib(free)} free")


def unique_sibling(path: Path, prefix: str) -> Path:
    """A fresh name ``{prefix}{random hex}`` beside ``path``, to rename something to: hex so that cleanup code
    can match it with a pattern, random so that concurrent writers never pick the same one."""
    return path.parent / f"{prefix}{uuid.uuid4().hex}"


def remove_dir_atomically(path: Path, prefix: str | None = None) -> None:
    """Rename ``path`` to a unique sibling (``prefix`` default ``.{name}.old-``), then delete that: a crash
    mid-deletion leaves a hidden leftover, never a half-deleted directory under the real name."""
    aside = unique_sibling(path, prefix or f".{path.name}.old-")
    path.rename(aside)
    shutil.rmtree(aside, ignore_errors=True)


def replace_dir(staging: Path, target: Path, prefix: str | None = None) -> None:
    """Rename the finished directory ``staging`` (a sibling of ``target``) to ``target``.

    POSIX cannot rename a directory over a non-empty one, so an existing ``target`` is first renamed to a
    unique sibling (``prefix`` default ``.{name}.old-``) and deleted after the swap: ``target`` is always the
    old tree or the new one, absent only between the two renames. When the second rename fails (a concurrent
    writer put its own ``target`` there first) the old tree is still deleted if ``target`` exists, and kept
    otherwise; the error propagates."""
    if not target.exists():
        staging.rename(target)
        return
    aside = unique_sibling(target, prefix or f".{target.name}.old-")
    target.rename(aside)
    try:
        staging.rename(target)
    finally:
        if target.exists():
            shutil.rmtree(aside, ignore_errors=True)
