"""The geo3k rule reward: answer accuracy (mathruler's grader on the last ``\\boxed{}``) plus a format bonus.

score = accuracy_weight * accuracy + format_weight * format, where format = 1 when the whole response is
``<think>...</think> ... \\boxed{...} ...`` and accuracy = 1 when the last boxed answer grades equal to the label.
geo3k has labels rounded from exact values (0.53 for 8/15); ``numeric_tolerance`` > 0 also accepts an answer whose
numeric value is within that relative distance of a numeric label, so an exact answer is not punished for the
label's rounding.
"""

from __future__ import annotations

import math
import re

from mathruler.grader import extract_boxed_content, grade_answer

FORMAT_PATTERN = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
_NO_BOX = "None"  # what extract_boxed_content returns when there is no complete \boxed{...}


def format_reward(response: str) -> float:
    """1.0 when the response fully matches ``<think>.*</think>.*\\boxed{.*}.*`` (dot matches newlines)."""
    return 1.0 if FORMAT_PATTERN.fullmatch(response) else 0.0


def last_boxed(response: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (nested braces kept), or None."""
    if "\\boxed{" not in response:
        return None
    content = extract_boxed_content(response)
    return None if content == _NO_BOX and "\\boxed{None}" not in response.replace(" ", "") else content


def numeric_value(text: str) -> float | None:
    """The value of a numeric answer (``0.53``, ``\\frac{8}{15}``, ``8/15``, ``2\\sqrt{3}``), else None.

    Uses mathruler's own normalisation (units, ``\\text{}``, LaTeX to plain text) so tolerance sees the answer
    the way the grader does, then evaluates with sympy only expressions without free symbols.
    """
    try:
        from mathruler.grader import _normalize, _sympy_parse, should_allow_eval

        normalized = _normalize(text)
        if not normalized:
            return None
        try:
            return float(normalized)
        except ValueError:
            pass
        if not should_allow_eval(normalized):
            return None
        expression = _sympy_parse(normalized)
        if expression.free_symbols:
            return None
        value = float(expression.evalf())
    except Exception:  # anything sympy or the LaTeX parser cannot handle is simply not numeric
        return None
    return value if math.isfinite(value) else None


def within_tolerance(answer: str, ground_truth: str, tolerance: float) -> bool:
    """|answer - label| <= tolerance * |label| for numeric answer and label (a zero label needs equality)."""
    given, truth = numeric_value(answer), numeric_value(ground_truth)
    if given is None or truth is None:
        return False
    return abs(given - truth) <= tolerance * abs(truth)


def accuracy_reward(response: str, ground_truth: str, numeric_tolerance: float = 0.0) -> float:
    """1.0 when the last boxed answer grades equal to ``ground_truth`` (or is within the numeric tolerance)."""
    answer = last_boxed(response)
    if answer is None:
        return 0.0
    if grade_answer(answer, ground_truth.strip()):
        return 1.0
    return 1.0 if numeric_tolerance > 0 and within_tolerance(answer, ground_truth, numeric_tolerance) else 0.0


def compute_score(
    response: str,
    ground_truth: str,
    *,
    accuracy_weight: float = 0.9,
    format_weight: float = 0.1,
    numeric_tolerance: float = 0.0,
) -> dict[str, float]:
    """{"score", "accuracy", "format"} for one response; score = weighted sum of the two components."""
    accuracy = accuracy_reward(response, ground_truth, numeric_tolerance)
    fmt = format_reward(response)
    return {"score": accuracy_weight * accuracy + format_weight * fmt, "accuracy": accuracy, "format": fmt}
