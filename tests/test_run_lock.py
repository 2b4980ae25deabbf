"""One run per output directory (``mm_rl.job.lock``): a second run on a directory a live run holds is refused at
once, naming the holder, in check's format; a lock left by a killed run (a dead process here, or another node whose
heartbeat stopped) is taken over with a notice. The holder is a real second process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mm_rl.config.loader import ConfigError, load_job
from mm_rl.job import lock
from mm_rl.job.lock import LOCK_FILE, run_lock
from mm_rl.job.run import run_locks

HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from mm_rl.job.lock import run_lock
    with run_lock(Path(sys.argv[1]), "af_output_dir"):
        print("held", flush=True)
        time.sleep(600)
""")


def _holder(directory: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


def test_a_second_run_is_refused_while_the_first_lives_and_takes_over_once_it_is_killed(tmp_path):
    first = _holder(tmp_path)
    try:
        started = time.monotonic()
        with pytest.raises(ConfigError) as err, run_lock(tmp_path, "af_output_dir"):
            pass
        (problem,) = err.value.violations
        assert problem.key == "af_output_dir" and problem.value == str(tmp_path)
        assert f"pid {first.pid} on {socket.gethostname()}" in problem.rule and "another af_output_dir" in problem.fix
        assert time.monotonic() - started < 1  # at once, not after a wait
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    notices: list[str] = []
    with run_lock(tmp_path, "af_output_dir", notices.append):
        held = json.loads((tmp_path / LOCK_FILE).read_text())
        assert held["pid"] == os.getpid()
    assert len(notices) == 1 and f"pid {first.pid}" in notices[0] and "taking it over" in notices[0]
    with run_lock(tmp_path, "af_output_dir", notices.append):  # released cleanly: nothing to take over
        pass
    assert len(notices) == 1


def test_another_nodes_lock_refuses_while_its_heartbeat_is_fresh(tmp_path, monkeypatch):
    def left(beat_age: float) -> None:
        holder = {"host": "node-7", "pid": 4242, "started": time.time() - 100, "beat": time.time() - beat_age,
                  "command": "ascendfactory-cli train job.yaml"}  # fmt: skip
        (tmp_path / LOCK_FILE).write_text(json.dumps(holder))

    left(beat_age=5)
    with pytest.raises(ConfigError, match="pid 4242 on node-7"), run_lock(tmp_path, "af_output_dir"):
        pass
    left(beat_age=lock.STALE_S + 1)  # a node that no longer answers
    notices: list[str] = []
    with run_lock(tmp_path, "af_output_dir", notices.append):
        pass
    assert "node-7" in notices[0]


def test_the_holder_keeps_its_heartbeat_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.05)
    with run_lock(tmp_path, "af_output_dir"):
        first = json.loads((tmp_path / LOCK_FILE).read_text())["beat"]
        time.sleep(0.3)
        assert json.loads((tmp_path / LOCK_FILE).read_text())["beat"] > first


def test_a_job_locks_its_checkpoint_directory_too_when_it_lies_elsewhere(tmp_path):
    save = tmp_path / "elsewhere"
    job = load_job(None, [f"--af_output_dir={tmp_path / 'run'}", f"--backend_config.megatron_training.save={save}"])
    first = _holder(save)
    try:
        with pytest.raises(ConfigError) as err, run_locks(job, print):
            pass
        assert err.value.violations[0].key == "backend_config.megatron_training.save"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
