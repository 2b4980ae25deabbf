"""The CPU-wheel bridges: torchvision imports in a fresh interpreter of the venv; the hook is a no-op otherwise."""

import subprocess
import sys
from pathlib import Path

from mm_rl.platform import cpu_wheels


def run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_torchvision_and_qwen_processor_import_in_a_fresh_process():
    probe = run("import torchvision.transforms, transformers.models.qwen2_5_vl.modeling_qwen2_5_vl; print('ok')")
    assert probe.returncode == 0, probe.stderr[-2000:]


def test_hook_is_installed_by_the_pth_file():
    pth = Path(cpu_wheels.write_pth())
    assert pth.read_text().startswith("import mm_rl.platform.cpu_wheels")
    probe = run(
        "import sys, mm_rl.platform.cpu_wheels as c; print('torchvision' in sys.modules or "
        "any(isinstance(f, c._TorchvisionFinder) for f in sys.meta_path))"
    )
    assert probe.stdout.strip() == "True"


def test_schemas_are_declared_only_when_missing():
    import torch
    import torchvision  # noqa: F401  (through the hook)

    assert torch.ops.torchvision.nms is not None
    # Once the op exists (declared or real), a second call changes nothing.
    assert cpu_wheels.declare_missing_ops(Path(torchvision.__file__).parent) is False


def test_broken_optional_extensions_are_gone():
    for name in cpu_wheels.OPTIONAL_EXTENSIONS:
        probe = run(f"import {name}")
        assert probe.returncode == 0 or "ModuleNotFoundError" in probe.stderr, probe.stderr[-1000:]
