"""The device check's CPU rehearsal (bench/device_check.py): ``prepare`` then ``run --dry-run`` as the bare device
image would run them, in a Python where ray and vllm cannot be imported (the image has neither), every check
reported, none failed (the CPU cannot share storages between processes: that check says it skips, and why)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.stack

REPO = Path(__file__).resolve().parents[1]
BARE = """
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("ray", "vllm"):
            raise ImportError(f"{name} is not installed on the bare device image")
sys.meta_path.insert(0, _Absent())
"""


def test_the_device_check_rehearses_on_cpu_without_ray_or_vllm(tmp_path):
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "sitecustomize.py").write_text(BARE)
    env = {"PYTHONPATH": str(tmp_path / "bare"), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    script = [sys.executable, str(REPO / "bench" / "device_check.py")]
    subprocess.run([*script, "prepare", str(tmp_path / "dc"), "--no-wheels"], check=True, env=env, timeout=300)
    assert (tmp_path / "dc" / "dense" / "model.json").is_file() and (tmp_path / "dc" / "moe" / "mm").is_dir()
    done = subprocess.run(
        [*script, "run", str(tmp_path / "dc"), "--dry-run"], capture_output=True, text=True, env=env, timeout=600
    )
    lines = [line for line in done.stdout.splitlines() if line.split(" ", 1)[0] in ("ok", "skip", "FAIL")]
    print("\n".join(lines))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    status = {line.split()[1].rstrip(":"): line.split()[0] for line in lines}
    assert status == {
        "transfers": "ok",
        "ipc_bucket": "skip",
        "sync_group": "ok",
        "attention": "ok",
        "rank_dense": "ok",
        "rank_moe": "ok",
        "rank_hybrid": "ok",
        "timed_update": "ok",
        "log_prob_memory": "ok",
    }
    assert "expert load max" in next(line for line in lines if "rank_moe" in line)
    assert "Gated DeltaNet kernel: megatron-core" in next(line for line in lines if "rank_hybrid" in line)
    # the plan's log-prob micro-batches hold several update micro-batches there: the device compares their peaks
    assert "scale 3: an update of 2 samples and a log-prob pass of 6 ran" in next(
        line for line in lines if "log_prob_memory" in line
    )
