"""CheckpointManager: round trip, atomic publication (exceptions and SIGKILL), pruning, fallback, resume modes."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from mm_rl.checkpoint import CheckpointError, CheckpointManager

REPO = Path(__file__).resolve().parents[1]


def rank_state(seed: int, numel: int = 16) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(numel, generator=g), "b": torch.randn(3, dtype=torch.bfloat16, generator=g)},
        "optimizer": {"exp_avg": torch.randn(numel, generator=g), "step": seed},
        "rng_state": {"torch": torch.get_rng_state(), "python": ("x", seed)},
        "args": {"lr": 1e-6},
    }


def states(step: int, tp: int = 2, pp: int = 1) -> dict:
    return {(t, p): rank_state(step * 100 + t * 10 + p) for t in range(tp) for p in range(pp)}


def trainer_state(step: int) -> dict:
    return {
        "step": step,
        "sampler": {"epoch": 0, "index": step * 8},
        "metrics": [{"reward": 0.5}] * step,
        "kl_ctl": {"value": 0.01},
    }


def assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def test_round_trip_bit_exact(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    saved = states(5)
    target = mgr.save(5, saved, trainer_state(5))
    assert target == tmp_path / "iter_0000005"
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert (target / "mp_rank_00" / "model_optim_rng.pt").is_file()
    assert (target / "mp_rank_01" / "model_optim_rng.pt").is_file()
    assert mgr.latest() == 5
    for (tp, pp), want in saved.items():
        got = mgr.load(5, tp, pp)
        assert got.pop("checkpoint_version") == 3.0 and got.pop("iteration") == 5
        assert_same(want, got)
    assert_same(trainer_state(5), mgr.load_trainer_state(5))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_no_load_optim_and_rng(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    mgr.save(1, states(1), trainer_state(1))
    assert {"optimizer", "rng_state", "model"} <= mgr.load(1, 0, 0).keys()
    no_optim = mgr.load(1, 0, 0, load_optim=False)
    assert "optimizer" not in no_optim and "rng_state" in no_optim
    no_rng = mgr.load(1, 1, 0, load_rng=False)
    assert "rng_state" not in no_rng and "optimizer" in no_rng
    assert_same(states(1)[(1, 0)]["model"], no_rng["model"])


def test_pp_file_names(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    mgr.save(2, states(2, tp=1, pp=2), trainer_state(2))
    names = sorted(p.name for p in (tmp_path / "iter_0000002").iterdir() if p.is_dir())
    assert names == ["mp_rank_00_000", "mp_rank_00_001"]
    assert_same(states(2, tp=1, pp=2)[(0, 1)]["model"], mgr.load(2, 0, 1)["model"])
    with pytest.raises(CheckpointError, match="outside"):
        mgr.load(2, 1, 0)


def test_crash_in_commit_keeps_previous_latest(tmp_path, monkeypatch):
    """A save that fails in the trainer's process removes its temporary directory at once (a killed one leaves it
    for cleanup_stale: see the SIGKILL test); either way the previous checkpoint stays the latest."""
    mgr = CheckpointManager(tmp_path, keep_last=0)
    mgr.save(1, states(1), trainer_state(1))

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(mgr, "_write_marker", crash)
    with pytest.raises(RuntimeError, match="simulated"):
        mgr.save(2, states(2), trainer_state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert mgr.latest() == 1 and mgr.complete_steps() == [1]
    assert_same(states(1)[(0, 0)]["model"], mgr.load(1, 0, 0)["model"])


def test_keep_last_prunes_oldest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, states(step, tp=1), trainer_state(step))
    assert mgr.complete_steps() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000003",
        "iter_0000004",
        "latest_checkpointed_iteration.txt",
    ]
    # re-saving an older step than the kept ones never deletes the one just written
    mgr.save(1, states(1, tp=1), trainer_state(1))
    assert 1 in mgr.complete_steps() and mgr.latest() == 1
    keep_all = CheckpointManager(tmp_path / "all", keep_last=0)
    for step in (1, 2, 3):
        keep_all.save(step, states(step, tp=1), trainer_state(step))
    assert keep_all.complete_steps() == [1, 2, 3]


def test_latest_falls_back_with_warning(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    for step in (1, 2, 3):
        mgr.save(step, states(step, tp=1), trainer_state(step))
    # a partial iteration (no marker) is newer than every complete one: never chosen
    partial = tmp_path / "iter_0000009" / "mp_rank_00"
    partial.mkdir(parents=True)
    (partial / "model_optim_rng.pt").write_bytes(b"half")
    import shutil

    shutil.rmtree(tmp_path / "iter_0000003")
    with caplog.at_level(logging.WARNING, logger="mm_rl.checkpoint"):
        assert mgr.latest() == 2
    assert "iter_0000003" in caplog.text and "falling back to iter_0000002" in caplog.text
    # a truncated rank file makes its iteration incomplete too
    rank = tmp_path / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    rank.write_bytes(rank.read_bytes()[:-10])
    assert mgr.latest() == 1
    with pytest.raises(CheckpointError, match="truncated"):
        mgr.load(2, 0, 0)


def test_latest_empty(tmp_path):
    assert CheckpointManager(tmp_path / "none", keep_last=1).latest() is None
    assert CheckpointManager(tmp_path, keep_last=1).latest() is None


def test_resolve_resume(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    assert mgr.resolve_resume("auto") is None
    mgr.save(7, states(7, tp=1), trainer_state(7))
    mgr.save(8, states(8, tp=1), trainer_state(8))
    assert mgr.resolve_resume("auto") == 8
    assert mgr.resolve_resume("disable") is None
    assert mgr.resolve_resume(str(tmp_path / "iter_0000007")) == 7
    (tmp_path / "iter_0000008" / "complete").unlink()
    with pytest.raises(CheckpointError, match="iter_0000008.*not a complete checkpoint"):
        mgr.resolve_resume(str(tmp_path / "iter_0000008"))
    with pytest.raises(CheckpointError, match="iter_0000042.*does not exist"):
        mgr.resolve_resume(str(tmp_path / "iter_0000042"))
    with pytest.raises(CheckpointError, match="'latest'"):
        mgr.resolve_resume("latest")
    with pytest.raises(CheckpointError, match="not inside the save directory"):
        mgr.resolve_resume(str(tmp_path / "other" / "iter_0000007"))


def test_multi_process_api(tmp_path):
    """The per-rank path the real trainer uses: one stage, each rank writes, one commit."""
    mgr = CheckpointManager(tmp_path, keep_last=0)
    staging = mgr.stage(3)
    assert mgr.stage(3) == staging and staging.name.startswith(".iter_0000003.tmp-")
    mgr.write_rank(staging, 0, 0, rank_state(1), pp_size=2)
    with pytest.raises(CheckpointError, match="lacks rank files of pipeline stages"):
        mgr.commit(staging, 3)
    mgr.write_rank(staging, 1, 1, rank_state(3), pp_size=2)
    with pytest.raises(CheckpointError, match=r"lacks rank files.*\(0, 1\), \(1, 0\)"):
        mgr.commit(staging, 3)
    with pytest.raises(CheckpointError, match="expected"):
        mgr.commit(staging, 3, expected={(0, 0), (0, 1)})
    mgr.write_rank(staging, 1, 0, rank_state(4), pp_size=2)
    mgr.write_rank(staging, 0, 1, rank_state(2), pp_size=2)
    mgr.commit(staging, 3)
    assert mgr.latest() == 3 and mgr.load(3, 0, 1)["iteration"] == 3
    with pytest.raises(CheckpointError, match="saved without a trainer state"):
        mgr.load_trainer_state(3)


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from mm_rl.checkpoint import CheckpointManager

    class Stall:
        # pickled in the middle of a rank file: the parent kills the process while it is being written
        def __reduce__(self):
            Path(sys.argv[2]).touch()
            time.sleep(60)
            return (int, ())

    big = {"model": {"w": torch.ones(4 << 20)}}
    stalled = {"model": {"w": torch.ones(4 << 20)}, "z": Stall()}
    CheckpointManager(sys.argv[1], keep_last=1).save(2, {(0, 0): big, (1, 0): stalled}, {"step": 2})
""")


def test_sigkill_during_save_keeps_previous(tmp_path):
    save_dir, ready = tmp_path / "ckpt", tmp_path / "ready"
    mgr = CheckpointManager(save_dir, keep_last=1)
    mgr.save(1, states(1), trainer_state(1))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(save_dir), str(ready)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert child.poll() is None, f"child exited early with {child.returncode}"
            assert time.monotonic() < deadline, "child never reached the stalled write"
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    staging = [p for p in save_dir.iterdir() if p.name.startswith(".iter_0000002.tmp-")]
    assert len(staging) == 1 and (staging[0] / "mp_rank_00" / "model_optim_rng.pt").is_file()
    fresh = CheckpointManager(save_dir, keep_last=1)
    assert fresh.latest() == 1 and fresh.complete_steps() == [1]
    assert_same(states(1)[(1, 0)]["model"], fresh.load(1, 1, 0)["model"])
    assert fresh.load_trainer_state(1)["sampler"] == {"epoch": 0, "index": 8}
    assert fresh.cleanup_stale() == staging and not staging[0].exists()
