"""Objects a job yaml names by import path (``package.module:attribute``): the reward function, the tools."""

from __future__ import annotations

import importlib
from typing import Any


def import_attribute(path: str, what: str, example: str, form: str = "module:attribute") -> Any:
    """The object at ``path``; the errors name ``what`` it is for, the path and what was wrong with it (a
    ValueError for the form, an ImportError for a module or attribute that is not there)."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{what} {path!r} must be '{form}', e.g. {example!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ImportError(f"{what} {path!r}: cannot import module {module_name!r}: {error}") from error
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ImportError(f"{what} {path!r}: module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    return target
