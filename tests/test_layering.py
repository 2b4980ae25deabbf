"""mm_rl's packages import downwards only: no package cycle, and no package imports one above it in ``LAYERS``.

Read from the source (every ``import`` / ``from`` statement, those inside functions too; imports under
``if TYPE_CHECKING:`` are for type checkers only and do not count), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mm_rl"

# Top first. A package may import those in its own layer (without a cycle) and those below it.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"job"}),  # what the CLI's verbs do: create, validate, run and submit a job
    frozenset({"trainer", "demo"}),  # the GRPO loop and its Ray deployment; the embedded tiny models and data
    frozenset({"workers", "rollout"}),  # the Megatron ranks; the rollout engines
    frozenset({"sync"}),  # the weight sync into the engines
    frozenset({"checkpoint"}),  # training checkpoints
    frozenset({"convert"}),  # hf2mg / mg2hf and the tensor mapping
    # the data sets, the rule rewards and the tools a model calls (above models: no model code reads them)
    frozenset({"data", "rewards", "tools"}),
    frozenset({"models"}),  # the model families and their megatron model
    frozenset({"algorithms", "platform"}),
    frozenset({"config"}),  # the schema, loader, planner, topology, presets and writer
    frozenset({"partition", "files", "cache", "imports"}),
)


def _package(path: Path) -> str:
    """``mm_rl/<package>/...`` or ``mm_rl/<module>.py`` -> its first name under mm_rl."""
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.AST, module: str) -> set[str]:
    """The mm_rl packages a module's source imports (relative imports resolved against ``module``)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: -node.level]
                base = ".".join([*parent, base] if base else parent)
            names = [f"{base}.{alias.name}" if base == "mm_rl" else base for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "mm_rl" and len(parts) > 1:
                out.add(parts[1])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    """package -> the other mm_rl packages its modules import."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sorted(ROOT.rglob("*.py")):
        if path.parent == ROOT and path.name == "__init__.py":
            continue
        module = ".".join(("mm_rl", *path.relative_to(ROOT).with_suffix("").parts))
        package = _package(path)
        graph[package] |= _imported(ast.parse(path.read_text(), str(path)), module) - {package}
    return dict(graph)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every package that can reach itself, with one path back (depth-first)."""
    found = []
    for start in sorted(graph):
        stack = [(start, [start])]
        seen: set[str] = set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    found.append([*path, start])
                    stack.clear()
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return found


def _layer(package: str) -> int:
    for index, layer in enumerate(LAYERS):
        if package in layer:
            return index
    raise AssertionError(f"mm_rl/{package} is in no layer of tests/test_layering.py: add it to LAYERS")


def upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} -> {b}" for a, targets in sorted(graph.items()) for b in sorted(targets) if _layer(b) < _layer(a)]


def test_no_package_imports_one_above_it_or_forms_a_cycle():
    graph = import_graph()
    assert {"config", "models", "trainer", "job"} <= set(graph)  # the scan sees the packages
    assert upward(graph) == []
    assert cycles(graph) == []


def test_config_imports_no_other_package_but_the_leaves():
    assert import_graph()["config"] <= {"files", "partition", "cache"}


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b", "a"], ["b", "a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert cycles(graph) == expected


def test_lazy_and_relative_imports_count_and_type_checking_ones_do_not():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from mm_rl.trainer import grpo\n"
        "def f():\n    from mm_rl.rollout.base import X\n"
        "from ..data import dataset\n"
        "import mm_rl.sync.buckets\n"
        "from mm_rl import files\n"
    )
    assert _imported(ast.parse(source), "mm_rl.job.validate") == {"rollout", "data", "sync", "files"}
    assert upward({"config": {"rollout"}}) == ["config -> rollout"]
