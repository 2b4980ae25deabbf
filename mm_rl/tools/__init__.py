"""Tools a model calls in a multi-turn rollout: their description, strict parsing of Qwen's tool calls, argument
checks against each tool's JSON schema, and the built-ins geometry problems use (``mm_rl.tools.builtin``).

A model turn calls tools as Qwen's chat templates teach it: ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` blocks after its text. :func:`parse_tool_calls` accepts exactly that: every opened block closed, each
holding one JSON object with a string ``name`` and an object ``arguments`` and nothing else, no stray closing tag.
Anything else is a :class:`ToolCallError` whose message is meant for the model (it sees it as the tool's answer and
can try again), never an exception out of the rollout. Nothing here imports Ray or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


@dataclass(frozen=True)
class Tool:
    """A callable the model may call by ``name``: ``parameters`` is the JSON schema of its ``arguments`` (an object
    schema: ``properties`` with a ``type`` each, ``required``), shown to the model through the chat template's
    ``tools=`` and checked before each call."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    function: Callable[..., Any] = field(compare=False)

    def spec(self) -> dict[str, Any]:
        """The OpenAI-style function description chat templates render for ``tools=``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


class ToolCallError(ValueError):
    """A malformed or invalid tool call; ``str(error)`` is the text the model gets back."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of a model turn, in order (none: the turn answers). Strict: see the module docstring."""
    calls = []
    for index, block in enumerate(_BLOCK.findall(text)):
        try:
            payload = json.loads(block)
        except json.JSONDecodeError as error:
            raise ToolCallError(f"tool call {index + 1} is not valid JSON ({error.msg} at char {error.pos})") from None
        if not isinstance(payload, dict) or set(payload) != {"name", "arguments"}:
            raise ToolCallError(f'tool call {index + 1} must be {{"name": <string>, "arguments": <object>}}')
        if not isinstance(payload["name"], str) or not isinstance(payload["arguments"], dict):
            raise ToolCallError(f"tool call {index + 1}: name must be a string and arguments an object")
        calls.append(ToolCall(payload["name"], payload["arguments"]))
    outside = _BLOCK.sub("", text)
    if OPEN in outside or CLOSE in outside:
        raise ToolCallError(f"every {OPEN} must be closed by {CLOSE}, one call per block")
    return calls


def check_arguments(tool: Tool, arguments: Mapping[str, Any]) -> None:
    """``arguments`` against ``tool.parameters``: every required key present, no unknown key, each value of its
    declared JSON type (a bool is not a number)."""
    properties = tool.parameters.get("properties", {})
    missing = [key for key in tool.parameters.get("required", ()) if key not in arguments]
    unknown = [key for key in arguments if key not in properties]
    if missing or unknown:
        raise ToolCallError(f"{tool.name}: missing arguments {missing}, unknown arguments {unknown}")
    for key, value in arguments.items():
        kind = properties[key].get("type")
        allowed = _JSON_TYPES.get(kind, (object,))
        if not isinstance(value, allowed) or (kind in ("number", "integer") and isinstance(value, bool)):
            raise ToolCallError(f"{tool.name}: argument {key!r} must be a JSON {kind}, got {json.dumps(value)}")


def find_tool(tools: Sequence[Tool], name: str) -> Tool:
    for tool in tools:
        if tool.name == name:
            return tool
    raise ToolCallError(f"no tool named {name!r}; the tools are {[t.name for t in tools]}")
