"""Tool calls (``mm_rl.tools``): Qwen's ``<tool_call>`` blocks parsed strictly, arguments checked against a tool's
schema, and the built-ins: a calculator that evaluates arithmetic without executing anything else, an image crop."""

from __future__ import annotations

import pytest
from PIL import Image

from mm_rl.tools import Tool, ToolCall, ToolCallError, check_arguments, find_tool, parse_tool_calls
from mm_rl.tools.builtin import CALCULATOR, CROP_IMAGE, calculator, crop_image, evaluate


def test_a_turn_without_calls_answers_and_well_formed_calls_parse_in_order():
    assert parse_tool_calls("The answer is \\boxed{3}.") == []
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 4"}}\n</tool_call>'
        '<tool_call>{"name": "crop_image", "arguments": {"box": [0, 0, 0.5, 0.5]}}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "3 * 4"}),
        ToolCall("crop_image", {"box": [0, 0, 0.5, 0.5]}),
    ]


@pytest.mark.parametrize(
    "text, says",
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "must be closed"),
        ('{"name": "calculator"}</tool_call>', "must be closed"),
        ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
        ('<tool_call>{"name": "calculator"}</tool_call>', '"arguments"'),
        ('<tool_call>{"name": "calculator", "arguments": "1 + 1"}</tool_call>', "arguments an object"),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "name must be a string"),
        ('<tool_call>[{"name": "calculator", "arguments": {}}]</tool_call>', '"arguments"'),
        ('<tool_call>{"name": "c", "arguments": {}, "id": 1}</tool_call>', '"arguments"'),
    ],
)
def test_malformed_calls_are_errors_the_model_can_read(text, says):
    with pytest.raises(ToolCallError, match=says):
        parse_tool_calls(text)


def test_arguments_are_checked_against_the_tools_schema():
    check_arguments(CALCULATOR, {"expression": "1 + 1"})
    check_arguments(CROP_IMAGE, {"box": [0, 0, 1, 1], "zoom": 2})
    for arguments, says in (
        ({}, "missing arguments \\['expression'\\]"),
        ({"expression": "1", "precision": 3}, "unknown arguments \\['precision'\\]"),
        ({"expression": 7}, "must be a JSON string"),
    ):
        with pytest.raises(ToolCallError, match=says):
            check_arguments(CALCULATOR, arguments)
    with pytest.raises(ToolCallError, match="must be a JSON number"):
        check_arguments(CROP_IMAGE, {"box": [0, 0, 1, 1], "zoom": True})  # a bool is not a number
    assert find_tool([CALCULATOR, CROP_IMAGE], "crop_image") is CROP_IMAGE
    with pytest.raises(ToolCallError, match="no tool named 'python'"):
        find_tool([CALCULATOR], "python")
    assert CALCULATOR.spec()["function"]["parameters"]["required"] == ["expression"]
    assert isinstance(CALCULATOR, Tool)


@pytest.mark.parametrize(
    "expression, value",
    [
        ("3 + 4 * 2", "11"),
        ("(3 + 4) * 2", "14"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-2 ** 2", "-4"),
        ("2 ** 10", "1024"),
        ("sqrt(2) * sqrt(2)", "2"),
        ("round(pi, 3)", "3.142"),
        ("degrees(atan(1))", "45"),
        ("10 % 4 + abs(-1.5)", "3.5"),
    ],
)
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, says",
    [
        ("__import__('os').system('true')", "not allowed"),
        ("open('/etc/passwd').read()", "not allowed"),
        ("(1).__class__", "not allowed"),
        ("x + 1", "not allowed"),
        ("[1, 2][0]", "not allowed"),
        ("sqrt(x=4)", "not allowed"),
        ("9 ** 9 ** 9", "exponents above"),
        ("10 ** 200", "within 1e100"),
        ("1 / 0", "division by zero"),
        ("sqrt(-1)", "math domain error"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an arithmetic expression"),
        ("1 + " * 200 + "1", "longer than"),
    ],
)
def test_the_calculator_refuses_everything_else_with_a_reason(expression, says):
    with pytest.raises(ToolCallError, match=says):
        evaluate(expression)


def test_crop_image_cuts_the_region_and_zooms_it():
    image = Image.new("RGB", (200, 100), "white")
    image.paste((255, 0, 0), (100, 50, 200, 100))  # the bottom-right quarter is red
    region = crop_image(image, [0.5, 0.5, 1.0, 1.0], zoom=2)
    assert region.size == (200, 100)
    assert region.getpixel((0, 0)) == region.getpixel((199, 99)) == (255, 0, 0)
    for box, zoom, says in (
        ([0.5, 0.5, 0.4, 1.0], 2, "left < right"),
        ([0, 0, 1.2, 1], 2, "<= 1"),
        ([0, 0, 1], 2, "four numbers"),
        ([0, 0, 0.1, 0.1], 2, "under 28 pixels"),
        ([0, 0, 1, 1], 8, "zoom must lie"),
    ):
        with pytest.raises(ToolCallError, match=says):
            crop_image(image, box, zoom)
