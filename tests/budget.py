"""The suite's time budget per test file, and the guard that holds it (pytest hooks, taken up by conftest).

`make test` must stay within 25 minutes on the 2-core machine with a warm cache of tiny models, so each file has a
share (seconds: setup, call and teardown of its tests together, measured on that machine plus headroom). At the
end of a run the guard prints every file's time against its share; a file over its share gets a loud
``SUITE BUDGET`` line, and a file over twice its share fails the run, so that the next slow test is seen when it is
added. Building the tiny models into the cache (the ``embedded_models`` fixture, the first time on a machine) is
counted apart: it is the machine's one-time cost, not a file's. A new file gets ``DEFAULT_SHARE_S`` until it is
listed here. Only whole runs are judged (``make test``, ``make test-quick``): a run of a few selected tests is not.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

DEFAULT_SHARE_S = 20.0
FAIL_FACTOR = 2.0
SUITE_S = 25 * 60.0  # the whole run, warm cache: over it, a SUITE BUDGET line (no failure: the files say where)
# Measured on the 2-core machine (Intel Xeon, warm cache), then ~50% added (the machine's own speed moves by up to
# ~30% between runs). Files not listed take DEFAULT_SHARE_S.
SHARE_S: dict[str, float] = {
    "test_trainer.py": 370,  # the 4-step job + SIGKILL resume (77 s), PP2 / CP2 jobs, two learning runs (one
    # resumed), a job stopped by its data: 244 s
    "test_family_jobs.py": 290,  # 2-step jobs: Qwen2-VL, Qwen3-VL-MoE at TP2; learning runs: the MoE's 40 steps
    # at EP2 (64 s), Qwen3.5's first 10 at TP2 (67 s): 189 s
    "test_weight_sync.py": 190,
    "test_trainer_worker.py": 160,
    "test_rollout.py": 90,
    "test_submit.py": 65,
    "test_multinode.py": 45,
    "test_tiny_warmup.py": 50,
    "test_family_parity.py": 35,  # the ranks fork from a pre-loaded server (tests/mp_utils.py): 20 s
    "test_accelerator_path.py": 35,
    "test_device_check.py": 45,  # the CPU rehearsal: three ranks (dense, MoE, Qwen3.5 hybrid), 29 s
    "test_model_parity.py": 25,
    "test_lora.py": 30,  # three families, one rank and a parallel layout each: 10 s
    "test_multi_turn_job.py": 140,  # the agent loop on vLLM, the demo's 20 steps and a 2-step resume: 94 s
    "test_video_job.py": 75,  # vLLM on clips for two families, the video demo's 20 steps (39 s): 49 s
    "test_config_command.py": 25,
    "test_config_checks.py": 30,  # every rule's cases, the multi-turn ones with tool imports: 18 s
    "test_console.py": 25,
}

_spent: dict[str, float] = defaultdict(float)
_builds: list[float] = []  # seconds spent building the cache, each once
_pending = [0.0]  # built since the last report: taken off the next phase's time (the test that waited for it)


def note_build(seconds: float) -> None:
    """Seconds a test (or its set-up) spent building the embedded models into the cache: not its file's."""
    _builds.append(seconds)
    _pending[0] += seconds


@contextmanager
def cache_build() -> Iterator[None]:
    """The time inside is the cache's first build on this machine (a hit takes a moment): :func:`note_build`."""
    start = time.perf_counter()
    yield
    note_build(time.perf_counter() - start)


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def share(path: str) -> float:
    return SHARE_S.get(Path(path).name, DEFAULT_SHARE_S)


def over_budget(spent: dict[str, float]) -> tuple[list[str], list[str]]:
    """(files over their share, files over FAIL_FACTOR x their share), each as a line for the report."""
    warn, fail = [], []
    for path, seconds in sorted(spent.items()):
        limit = share(path)
        if seconds > limit:
            line = f"SUITE BUDGET: {path} took {seconds:.0f} s, its share is {limit:.0f} s (tests/budget.py)"
            (fail if seconds > FAIL_FACTOR * limit else warn).append(line)
    return warn, fail


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _spent[_file(report.nodeid)] += max(0.0, report.duration - _pending[0])
    _pending[0] = 0.0


def _whole_run(config: pytest.Config) -> bool:
    """Only a run of whole files is judged: ``-k`` / node ids / a marker other than the quick suite's pick a few
    tests, whose files then look cheaper or dearer than they are."""
    return not config.getoption("keyword") and not any("::" in arg for arg in config.args)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _spent or not _whole_run(config):
        return
    write = terminalreporter.write_line
    terminalreporter.section("time per test file (s) against its share")
    for path, seconds in sorted(_spent.items(), key=lambda kv: -kv[1]):
        write(f"{seconds:8.1f} / {share(path):6.0f}  {path}")
    if _builds:
        write(f"{sum(_builds):8.1f}           the embedded tiny models from the cache (built there once per machine)")
    total = sum(_spent.values())
    write(f"{total:8.1f} / {SUITE_S:6.0f}  the whole run, the cache's first builds apart")
    warn, fail = over_budget(_spent)
    if total > SUITE_S:
        warn.append(f"SUITE BUDGET: the run took {total:.0f} s, the suite's is {SUITE_S:.0f} s (tests/budget.py)")
    for line in warn + fail:
        write(line, red=True, bold=True)
    if fail:
        write(
            f"SUITE BUDGET: {len(fail)} file(s) over {FAIL_FACTOR:.0f}x their share: the run fails", red=True, bold=True
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _spent and _whole_run(session.config) and over_budget(_spent)[1] and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
