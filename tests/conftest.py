"""Shared test set-up: one torch thread per process (2-core machines run several processes at once), the suite's
time budget per file (``budget.py``), and the embedded tiny jobs (checkpoint, synthetic data, format warm-up) as
``ascendfactory-cli config`` writes them, whose models come from the per-machine cache (``mm_rl.cache``)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before anything imports torch

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from budget import pytest_runtest_logreport, pytest_sessionfinish, pytest_terminal_summary  # noqa: E402, F401
from trainer_utils import configure  # noqa: E402


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    """A directory holding the tiny ``job.yaml``, ``tiny_hf/`` and ``geo3k_synthetic/``, written once per pytest
    session. Its runs skip the validation before training (the default's), which the tests of few steps do not
    look at; the learning test turns it on."""
    base = tmp_path_factory.getbasetemp() / "tiny_base"
    configure("tiny", base / "job.yaml", "backend_config.rl_config.val_before_train=false")
    return base


@pytest.fixture(scope="session")
def tools_base(tmp_path_factory) -> Path:
    """The multi-turn demo's ``job.yaml`` (``tiny_tools``: the calculator and crop tools, the tool warm-up, the
    arithmetic problems) with ``tiny_hf/`` and ``geo3k_synthetic/``, written once per pytest session."""
    base = tmp_path_factory.getbasetemp() / "tools_base"
    configure("tiny_tools", base / "job.yaml")
    return base


@pytest.fixture(scope="session")
def video_base(tmp_path_factory) -> Path:
    """The video demo's ``job.yaml`` (``tiny_video``: clips and multi-image prompts, the format-warmed tiny model)
    with ``tiny_hf/`` and ``video_synthetic/``, written once per pytest session."""
    base = tmp_path_factory.getbasetemp() / "video_base"
    configure("tiny_video", base / "job.yaml")
    return base
