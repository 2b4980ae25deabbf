"""The code is ruff-clean and ruff-formatted (``ruff check`` and ``ruff format --check`` over what the repository
ships), in the suite CI runs: a change that breaks either fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ["mm_rl", "cli", "tests", "bench"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(command):
    done = subprocess.run([sys.executable, "-m", "ruff", *command, *TREES], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
