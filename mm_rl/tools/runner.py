"""Running a rollout's tool calls: the job's tools by name or import path, each call bounded in time and size.

A call that cannot run (unknown tool, arguments against the schema, a malformed turn) or that fails (an exception,
the timeout) gives a :class:`ToolResult` with ``error`` set and a text the model reads as the tool's answer: the
rollout goes on and the error is counted. A tool returns text, an image, or a list of both; anything else is shown as
its ``str``. A tool function that takes an ``image`` argument gets the prompt's first image, one that takes
``images`` every image of the trajectory so far; the model never passes them.

Timeouts: each call runs on a thread of the runner's pool and is waited for ``timeout`` seconds. Python cannot stop
a thread, so a call past its timeout keeps its thread until it returns; the model has its error text by then. A tool
that can hang for good or runs untrusted code must bound or sandbox itself (the README says so).
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mm_rl.tools import Tool, ToolCall, ToolCallError, check_arguments, find_tool

if TYPE_CHECKING:
    from PIL import Image

BUILTIN = "mm_rl.tools.builtin"
BUILTIN_NAMES = {"calculator": "CALCULATOR", "crop_image": "CROP_IMAGE"}


def load_tool(entry: str) -> Tool:
    """A built-in by name (``calculator``, ``crop_image``) or the :class:`Tool` at import path ``module:attribute``;
    ImportError / TypeError / ValueError name what is wrong."""
    from mm_rl.imports import import_attribute

    path = f"{BUILTIN}:{BUILTIN_NAMES[entry]}" if entry in BUILTIN_NAMES else entry
    if ":" not in path:
        raise ValueError(f"tool {entry!r} is neither a built-in ({', '.join(BUILTIN_NAMES)}) nor 'module:attribute'")
    target = import_attribute(path, "tool", "my_tools:LOOKUP")
    if not isinstance(target, Tool):
        raise TypeError(
            f"tool {entry!r} is a {type(target).__name__}, not an mm_rl.tools.Tool (its name, description, "
            "JSON schema of the arguments and function)"
        )
    if target.parameters.get("type", "object") != "object" or not isinstance(target.parameters.get("properties"), dict):
        raise ValueError(f"tool {entry!r}: parameters must be an object schema with 'properties'")
    return target


def load_tools(entries: Sequence[str]) -> list[Tool]:
    """The job's tools, in order; two tools with one name are an error (the model names the one it calls)."""
    tools = [load_tool(entry) for entry in entries]
    names = [tool.name for tool in tools]
    doubles = sorted({name for name in names if names.count(name) > 1})
    if doubles:
        raise ValueError(f"tools {doubles} are named twice; every tool needs a name of its own")
    return tools


@dataclass
class ToolRequest:
    """One call to run (or, with ``error`` set, a turn that could not be parsed: its text is the answer)."""

    call: ToolCall | None
    images: list[Image.Image] = field(default_factory=list)  # the trajectory's images: the prompt's first
    error: str | None = None


@dataclass
class ToolResult:
    """What the model sees of a call: text and images; ``error`` when it failed or could not run."""

    text: str
    images: list[Image.Image] = field(default_factory=list)
    error: bool = False
    malformed: bool = False  # the call itself was wrong (format, name, arguments), not the tool
    seconds: float = 0.0


def as_result(value: Any) -> ToolResult:
    """A tool's return value as text and images (see the module docstring)."""
    from PIL import Image

    parts = value if isinstance(value, list | tuple) else [value]
    texts, images = [], []
    for part in parts:
        if isinstance(part, Image.Image):
            images.append(part.convert("RGB"))
        elif isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict):
            texts.append(json.dumps(part))
        else:
            texts.append(str(part))
    return ToolResult("\n".join(texts), images)


class ToolRunner:
    """Runs calls of one job's tools with its timeout and output cap, several at once on a thread pool."""

    def __init__(self, entries: Sequence[str], timeout: float, max_chars: int, threads: int = 4) -> None:
        self.tools = load_tools(entries)
        self.timeout, self.max_chars = timeout, max_chars
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="mm_rl-tool")

    def run(self, requests: Sequence[ToolRequest]) -> list[ToolResult]:
        """The results in request order; the calls run side by side, each waited for at most ``timeout``."""
        started = [self._start(request) for request in requests]
        return [self._finish(item) for item in started]

    def _start(self, request: ToolRequest) -> tuple[Tool | None, Any, float]:
        if request.error is not None or request.call is None:
            return None, ToolResult(request.error or "empty tool call", error=True, malformed=True), 0.0
        try:
            tool = find_tool(self.tools, request.call.name)
            check_arguments(tool, request.call.arguments)
            arguments = dict(request.call.arguments) | context_arguments(tool, request.images)
        except ToolCallError as error:
            return None, ToolResult(str(error), error=True, malformed=True), 0.0
        function = tool.function  # a local call on this process's pool (not a rank's method by name)
        return tool, self.pool.submit(function, **arguments), time.perf_counter()

    def _finish(self, item: tuple[Tool | None, Any, float]) -> ToolResult:
        tool, future, start = item
        if tool is None:
            return future
        try:
            result = as_result(future.result(timeout=self.timeout))
            if len(result.text) > self.max_chars:  # the tool's own answer is capped; errors are short already
                result.text = result.text[: self.max_chars] + " [cut]"
        except concurrent.futures.TimeoutError:
            result = ToolResult(f"{tool.name}: no answer within {self.timeout:g} s", error=True)
        except ToolCallError as error:  # the tool refused its arguments (a built-in's checks)
            result = ToolResult(str(error), error=True)
        except Exception as error:  # a user's tool: its failure is the model's answer, never the rollout's end
            result = ToolResult(f"{tool.name} failed: {type(error).__name__}: {error}", error=True)
        result.seconds = time.perf_counter() - start
        return result

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def context_arguments(tool: Tool, images: Sequence[Image.Image]) -> dict[str, Any]:
    """What the rollout passes besides the model's arguments: ``image`` (the prompt's first), ``images`` (all)."""
    try:
        names = inspect.signature(tool.function).parameters
    except (TypeError, ValueError):
        return {}
    extra: dict[str, Any] = {}
    if "image" in names:
        if not images:
            raise ToolCallError(f"{tool.name} works on the problem's image, and this problem has none")
        extra["image"] = images[0]
    if "images" in names:
        extra["images"] = list(images)
    return extra
