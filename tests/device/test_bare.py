"""The device check's cases (bench/device_check.py) under pytest, on a machine with a CUDA GPU or an Ascend NPU and
megatron-core installed; no Ray or vLLM needed. On a bare image without pytest, ``bench/device_check.sh run DIR``
runs the same functions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mm_rl.platform.device import device_kind

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import device_check  # noqa: E402

pytestmark = pytest.mark.skipif(device_kind() == "cpu", reason="needs a CUDA GPU or an Ascend NPU (torch sees none)")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("device_check")
    device_check.prepare(out, wheels=False)
    return out


@pytest.mark.parametrize("name", list(device_check.CHECKS))
def test_device_check(prepared: Path, name: str) -> None:
    try:
        print(f"\n{name}: {device_check.CHECKS[name](device_check.Context(prepared, dry_run=False))}")
    except device_check.Skip as reason:
        pytest.skip(str(reason))
