"""Let a torchvision whose C extension cannot load beside this torch still import.

vLLM's Qwen2.5-VL code imports torchvision. The torchvision wheel on the package index is a CUDA build;
next to the CPU torch its ``_C`` extension fails to load, so the ops ``torchvision::nms`` / ``qnms`` never
get a schema and ``torchvision/_meta_registrations.py`` raises "operator torchvision::nms does not exist"
at import. Declaring the two schemas first is enough: transforms and the Qwen processors never call them.

``install()`` puts a one-shot finder on ``sys.meta_path``. When torchvision is first imported it tries to
load the real extension; only if ``torchvision::nms`` is still undefined does it declare the schemas, so
with a torchvision that matches torch it changes nothing. The set-up writes a ``.pth`` file calling
``install()`` so that every interpreter of the venv (vLLM and Ray workers included) gets it.
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
