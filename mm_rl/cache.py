"""A per-machine cache of derived directories (the embedded tiny checkpoints and their warm-ups), keyed by what
determines their bytes, so each is built once per machine rather than once per demo, test session or test.

What a key holds: the caller's arguments, the digests of the source files of the modules that compute the
directory (a changed byte of the builder's code gives a new key, so a stale entry is never used), and the versions
of the libraries whose kernels and writers produce it (torch, transformers, tokenizers, safetensors).

An entry is built into a temporary directory inside the cache and renamed into place, with ``digest.json`` (the
sha256 of every file) written last; its use re-reads every file against that digest, so a corrupt or partial
entry is rebuilt, never used. Two processes that ask for the same entry take a lock (``fcntl.flock`` on a file
beside it): the second waits for the first and then uses what it built.

Where: ``$MM_RL_CACHE`` if set, else ``$XDG_CACHE_HOME/mm_rl``, else ``~/.cache/mm_rl``. Deleting the directory is
always safe. This module imports nothing from mm_rl but ``files``: every layer may use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from mm_rl.files import remove_dir_atomically, replace_dir

ENV = "MM_RL_CACHE"
DIGEST = "digest.json"
LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors")


def root() -> Path:
    """The cache directory (created on first use)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser().absolute() / "mm_rl"


def source_digest(modules: Iterable[str]) -> dict[str, str]:
    """sha256 of each module's source file, by module name: the code that computes an entry is part of its key."""
    out = {}
    for name in sorted(set(modules)):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            raise ModuleNotFoundError(f"no source for {name}")
        out[name] = hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()
    return out


def versions() -> dict[str, str]:
    """The installed versions of the libraries whose kernels and writers produce an entry's bytes."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def key(kind: str, args: dict[str, Any], modules: Iterable[str]) -> str:
    """The entry name: ``kind`` and a hash of the arguments, the modules' sources and the library versions."""
    record = {"args": args, "sources": source_digest(modules), "versions": versions()}
    text = json.dumps(record, sort_keys=True, default=str)
    return f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:20]}"


def _file_digests(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != DIGEST
    }


def is_valid(entry: Path) -> bool:
    """Every file the digest names, with those bytes, and no other: an entry to use as it is."""
    try:
        stored = json.loads((entry / DIGEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return stored == _file_digests(entry)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released on close, also when the holder dies
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def entry(name: str, build: Callable[[Path], None], report: Callable[[str], None] = print) -> Path:
    """The cache entry ``name`` (from ``key``), built by ``build(empty_dir)`` when absent or corrupt."""
    base = root()
    base.mkdir(parents=True, exist_ok=True)
    path = base / name
    if is_valid(path):
        return path
    with _locked(base / f".{name}.lock"):
        if is_valid(path):  # built by the process that held the lock before us
            return path
        if path.exists():
            report(f"cache: {path} is incomplete or corrupt; rebuilding it")
            remove_dir_atomically(path)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.building-", dir=base))
        try:
            build(staging)
            (staging / DIGEST).write_text(
                json.dumps(_file_digests(staging), indent=1, sort_keys=True) + "\n", encoding="utf-8"
            )
            staging.chmod(0o755)
            replace_dir(staging, path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return path


def copy_out(source: Path, target: Path) -> Path:
    """A copy of entry ``source`` (without its digest) at ``target``, swapped in whole: readers of ``target`` see
    the old directory or the new one."""
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.copying-", dir=target.parent))
    try:
        for item in source.iterdir():
            if item.name != DIGEST:
                (shutil.copytree if item.is_dir() else shutil.copy2)(item, staging / item.name)
        staging.chmod(0o755)
        replace_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
