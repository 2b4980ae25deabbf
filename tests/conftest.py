"""Shared test set-up: one torch thread per process (2-core machines run several processes at once), and the
tiny job (checkpoint, synthetic data, format warm-up) built once per session for the end-to-end tests."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    """A directory holding the tiny ``job.yaml``, ``tiny_hf/`` and ``geo3k_synthetic/`` (``ascendfactory-cli
    config --af_model_name tiny``, ~25-40 s), built once per pytest session. Its runs skip the validation
    before training (the default's), which the tests of few steps do not look at; the learning test turns it on."""
    base = tmp_path_factory.getbasetemp() / "tiny_base"
    if not (base / ".built").exists():
        subprocess.run([str(Path(sys.executable).parent / "ascendfactory-cli"), "config", "--af_model_name", "tiny",
                        "--exp_name", "tiny_test", "--output_file_path", str(base / "job.yaml"),
                        f"af_output_dir={base}", "backend_config.rl_config.val_before_train=false"],
                       check=True, capture_output=True, text=True)
        (base / ".built").touch()
    return base
