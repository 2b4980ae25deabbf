"""The per-machine cache of built tiny checkpoints: keyed by the builder's code, arguments and library versions,
built once (also when two processes ask at once), verified on every use, rebuilt when corrupt or partial."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mm_rl import cache

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(cache.ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _writer(calls: list[str], text: str = "bytes"):
    def build(staging: Path) -> None:
        calls.append(staging.name)
        (staging / "sub").mkdir()
        (staging / "sub" / "a.txt").write_text(text)
        (staging / "b.bin").write_bytes(b"\0\1\2")

    return build


def test_an_entry_is_built_once_and_then_used_as_it_is(cache_dir):
    calls: list[str] = []
    first = cache.entry("thing-1", _writer(calls))
    again = cache.entry("thing-1", _writer(calls))
    assert first == again == cache_dir / "thing-1" and len(calls) == 1
    assert (first / "sub" / "a.txt").read_text() == "bytes"
    assert set(json.loads((first / cache.DIGEST).read_text())) == {"sub/a.txt", "b.bin"}
    assert not [p for p in cache_dir.iterdir() if ".building-" in p.name]  # no staging left behind


@pytest.mark.parametrize("damage", ["flip_a_byte", "drop_a_file", "add_a_file", "no_digest"])
def test_a_corrupt_or_partial_entry_is_rebuilt_never_used(cache_dir, damage):
    calls: list[str] = []
    path = cache.entry("thing-1", _writer(calls))
    if damage == "flip_a_byte":
        (path / "b.bin").write_bytes(b"\0\1\3")
    elif damage == "drop_a_file":
        (path / "sub" / "a.txt").unlink()
    elif damage == "add_a_file":
        (path / "stray").write_text("?")
    else:  # a build that died before the digest, left under the entry's name
        (path / cache.DIGEST).unlink()
    assert not cache.is_valid(path)
    lines: list[str] = []
    again = cache.entry("thing-1", _writer(calls), report=lines.append)
    assert len(calls) == 2 and cache.is_valid(again) and (again / "b.bin").read_bytes() == b"\0\1\2"
    assert "rebuilding" in lines[0]


def test_a_failed_build_leaves_no_entry(cache_dir):
    def broken(staging: Path) -> None:
        (staging / "half").write_text("x")
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError, match="build failed"):
        cache.entry("thing-1", broken)
    assert not (cache_dir / "thing-1").exists()
    assert cache.entry("thing-1", _writer([])).is_dir()


def _slow_build_in_child(cache_root: str, log: str) -> None:
    os.environ[cache.ENV] = cache_root

    def build(staging: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)  # long enough for the other process to arrive while this one builds
        (staging / "w").write_text("built")

    print(cache.entry("shared-1", build))


def test_two_processes_asking_at_once_build_once(cache_dir, tmp_path):
    log = tmp_path / "builds.log"
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_slow_build_in_child, args=(str(cache_dir), str(log))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(log.read_text().split()) == 1  # the second waited on the lock, then used the first's entry
    assert (cache_dir / "shared-1" / "w").read_text() == "built"


def test_the_key_follows_arguments_sources_and_versions(monkeypatch):
    modules = ["mm_rl.files"]
    base = cache.key("k", {"seed": 0}, modules)
    assert base == cache.key("k", {"seed": 0}, modules) and base.startswith("k-")
    assert cache.key("k", {"seed": 1}, modules) != base
    assert cache.key("k", {"seed": 0}, [*modules, "mm_rl.cache"]) != base
    monkeypatch.setattr(cache, "versions", lambda: {"torch": "0.0"})
    assert cache.key("k", {"seed": 0}, modules) != base


_KEY_SCRIPT = (
    "from mm_rl import cache; from mm_rl.demo.tiny import _build_args, build_sources; "
    "print(cache.key('tiny', _build_args('qwen2_5vl', 0, False, {}), build_sources('qwen2_5vl')))"
)


def test_a_changed_byte_of_the_builder_gives_a_new_key(tmp_path):
    """The real builder's key, from a copy of the package: one byte of ``demo/tiny.py`` changed (a comment's
    letter, so the code still runs) -> another key."""
    shutil.copytree(REPO / "mm_rl", tmp_path / "mm_rl", ignore=shutil.ignore_patterns("__pycache__"))

    def key() -> str:
        env = dict(os.environ, PYTHONPATH=str(tmp_path))
        done = subprocess.run(
            [sys.executable, "-c", _KEY_SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    before = key()
    source = tmp_path / "mm_rl" / "demo" / "tiny.py"
    text = source.read_text()
    assert "# Fixed token ids" in text
    source.write_text(text.replace("# Fixed token ids", "# Fixed token IDs", 1))
    assert key() != before
    source.write_text(text)
    assert key() == before


def test_tiny_checkpoints_come_from_the_cache(cache_dir, tmp_path, monkeypatch):
    """The second build of the same arguments copies the entry: the same bytes, and the writer is not called."""
    from mm_rl.demo import tiny

    first = tiny.build_tiny_checkpoint(tmp_path / "a", seed=0, num_hidden_layers=2)
    monkeypatch.setattr(tiny, "_write_checkpoint", lambda *a, **k: pytest.fail("built again"))
    second = tiny.build_tiny_checkpoint(tmp_path / "b", seed=0, num_hidden_layers=2)
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in second.iterdir()) and cache.DIGEST not in files
    assert all((first / f).read_bytes() == (second / f).read_bytes() for f in files)
    assert len([p for p in cache_dir.iterdir() if p.name.startswith("tiny-")]) == 1
