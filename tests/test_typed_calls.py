"""Calls into other processes name the method itself, never a string: a Megatron rank group's ``run`` /
``run_sharded`` / ``submit`` / ``_run_in`` take ``RankClass.method`` and the vLLM engine's ``_rpc`` takes
``WeightReceiver.method`` (Ray and vLLM then call it by its name). Read from the source of mm_rl, the tests and the
benchmarks, so a renamed or misspelt method fails here, before any process starts."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "mm_rl").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").glob("*.py")])
CALLS = {"run", "run_sharded", "submit", "_run_in", "_rpc"}


def _module_name(path: Path) -> str | None:
    """The importable name of an mm_rl module (classes defined beside their callers resolve through it)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__") if parts[0] == "mm_rl" else None


def _imports(tree: ast.AST) -> dict[str, tuple[str, str]]:
    """Every ``from module import name [as alias]`` of a file, at any depth: alias -> (module, name)."""
    return {
        alias.asname or alias.name: (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and not node.level
        for alias in node.names
    }


def calls(tree: ast.AST) -> list[tuple[int, ast.expr]]:
    """(line, first argument) of every cross-process call in a module (``subprocess.run`` is not one)."""
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in CALLS
            and node.args
            and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess")
        ):
            found.append((node.lineno, node.args[0]))
    return found


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


def problems(path: Path, tree: ast.AST) -> list[str]:
    imports, own = _imports(tree), _module_name(path)
    out = []
    for line, target in calls(tree):
        where = f"{path.relative_to(ROOT)}:{line}"
        if isinstance(target, ast.Constant) and isinstance(target.value, str):
            out.append(f"{where}: method named by the string {target.value!r}: pass RankClass.{target.value}")
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            owner = target.value.id
            module, name = imports.get(owner, (own, owner))
            if module is None:
                out.append(f"{where}: {owner} is not imported by name")
                continue
            cls = getattr(importlib.import_module(module), name, None)
            if cls is None or not callable(getattr(cls, target.attr, None)):
                out.append(f"{where}: {owner}.{target.attr} does not exist")
    return out


def test_every_cross_process_call_names_an_existing_method():
    trees = {path: _tree(path) for path in SOURCES}
    checked = [path for path, tree in trees.items() if calls(tree)]
    assert len(checked) >= 6  # the scan sees the group, the sync driver, the engine and the tests
    assert [problem for path in checked for problem in problems(path, trees[path])] == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("group.run('build', d)\n", "method named by the string 'build'"),
        (
            "from mm_rl.workers.megatron_worker import MegatronWorker\ngroup.run(MegatronWorker.biuld, d)\n",
            "MegatronWorker.biuld does not exist",
        ),
        ("from mm_rl.workers.megatron_worker import MegatronWorker\ngroup.run(MegatronWorker.build, d)\n", None),
        ("import subprocess\nsubprocess.run('ls')\n", None),
    ],
)
def test_the_scan_catches_strings_and_missing_methods(source, expected):
    found = problems(ROOT / "tests" / "probe.py", ast.parse(source))
    assert [expected in p for p in found] == ([True] if expected else [])


def test_a_group_refuses_a_method_its_ranks_lack():
    from mm_rl.workers.group import WorkerGroup
    from mm_rl.workers.megatron_worker import MegatronWorker
    from mm_rl.workers.training import TrainingWorker

    group = WorkerGroup.__new__(WorkerGroup)
    group.worker_cls, group.role = MegatronWorker, "reference"
    assert group._name(MegatronWorker.build) == "build"
    with pytest.raises(TypeError, match="reference ranks \\(MegatronWorker\\) have no method train_mini_batch"):
        group._name(TrainingWorker.train_mini_batch)
