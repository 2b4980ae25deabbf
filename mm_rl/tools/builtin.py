"""The built-in tools geometry problems use: a calculator and an image crop / zoom.

The calculator evaluates arithmetic by walking Python's syntax tree: numbers, + - * / // % **, unary signs,
parentheses and a few math functions and constants; any other syntax (names, attributes, calls of anything else,
comprehensions) is refused, so no user text is ever executed. Exponents and results are bounded (a model can write
``9**9**9``). The crop tool cuts a region of one of the prompt's images, given in fractions of its width and height,
and scales it up, returning a new image that the rollout processes like a prompt image.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mm_rl.tools import Tool, ToolCallError

if TYPE_CHECKING:
    from PIL import Image

MAX_EXPONENT = 1000
MAX_MAGNITUDE = 1e100
MAX_EXPRESSION = 500  # characters
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., float]] = {
    "sqrt": math.sqrt,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "asin": math.asin,
    "acos": math.acos,
    "atan": math.atan,
    "radians": math.radians,
    "degrees": math.degrees,
    "abs": abs,
    "round": round,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic expression (see the module docstring); ToolCallError names what was refused."""
    if len(expression) > MAX_EXPRESSION:
        raise ToolCallError(f"calculator: the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ToolCallError(f"calculator: {expression!r} is not an arithmetic expression") from None
    try:
        value = _value(tree.body)
    except (ZeroDivisionError, ValueError, OverflowError) as error:
        raise ToolCallError(f"calculator: {error}") from None
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > MAX_MAGNITUDE:
        raise ToolCallError("calculator: the result is not a finite number within 1e100")
    return value


def _value(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponents above {MAX_EXPONENT} are refused")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex) or abs(result) > MAX_MAGNITUDE:
            raise ValueError("the result is not a real number within 1e100")
        return result
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        return _FUNCTIONS[node.func.id](*(_value(arg) for arg in node.args))
    raise ValueError(f"{ast.unparse(node)!r} is not allowed (numbers, + - * / // % **, {', '.join(_FUNCTIONS)})")


def calculator(expression: str) -> str:
    """The tool's answer: the value, integers exact and floats to 10 significant digits."""
    value = evaluate(expression)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate arithmetic: + - * / // % **, sqrt, sin, cos, tan, asin, acos, atan (radians), pi.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
    function=calculator,
)

MIN_CROP_PIXELS = 28  # a crop narrower than two 14-pixel patches carries nothing the ViT can see
MAX_ZOOM = 4.0


def crop_image(image: Image.Image, box: list[float], zoom: float = 2.0) -> Image.Image:
    """The region ``box`` = [left, top, right, bottom] (fractions of the width and height, 0 to 1) of ``image``,
    scaled by ``zoom`` (1 to 4). ``image`` is not the model's argument: the rollout passes the prompt's image."""
    if len(box) != 4 or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in box):
        raise ToolCallError("crop_image: box must be [left, top, right, bottom], four numbers")
    left, top, right, bottom = box
    if not (0 <= left < right <= 1 and 0 <= top < bottom <= 1):
        raise ToolCallError("crop_image: box needs 0 <= left < right <= 1 and 0 <= top < bottom <= 1")
    if not 1 <= zoom <= MAX_ZOOM:
        raise ToolCallError(f"crop_image: zoom must lie in [1, {MAX_ZOOM}]")
    width, height = image.size
    pixels = (round(left * width), round(top * height), round(right * width), round(bottom * height))
    if min(pixels[2] - pixels[0], pixels[3] - pixels[1]) < MIN_CROP_PIXELS:
        raise ToolCallError(f"crop_image: the region is under {MIN_CROP_PIXELS} pixels on a side; take a larger box")
    region = image.crop(pixels)
    return region.resize((round(region.width * zoom), round(region.height * zoom)))


CROP_IMAGE = Tool(
    name="crop_image",
    description="Crop a region of the problem's image and zoom into it; returns the region as a new image.",
    parameters={
        "type": "object",
        "properties": {
            "box": {"type": "array", "description": "[left, top, right, bottom] as fractions of width and height"},
            "zoom": {"type": "number", "description": "scale factor from 1 to 4 (default 2)"},
        },
        "required": ["box"],
    },
    function=crop_image,
)
