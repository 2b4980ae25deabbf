"""What the user sees: the console of ``train`` holds the job's own lines (stages, steps, validation, checkpoints,
summary, notices), while the rollout engine's, the ranks' and Ray's output goes to ``af_output_dir/logs/workers.log``
(``--verbose`` keeps it on the console); an interrupt during start-up stops the Ray instance the job started, with no
traceback.

The routing pieces run without Ray (a worker's hook in a child process, ``ray.init``'s options, the "ray" logger of
the driver with a stand-in ``ray.init``); the interrupt case starts the tiny job (slow). A whole run's console is
checked in ``test_trainer.py`` (the resumed run of its SIGKILL test).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from trainer_utils import job_for

from mm_rl.trainer import runtime
from mm_rl.trainer.runtime import LOG_ENV, VERBOSE_ENV, WORKER_LOG, Resources

RESOURCES = Resources(
    device="cpu",
    world_size=1,
    bundle_cpus=1.0,
    actor_share=0.5,
    ref_share=0.5,
    device_share_actor=0.4,
    device_share_ref=0.2,
    device_share_rollout=0.4,
    threads=1,
)


def _job(out_dir: Path, address: str | None = None) -> SimpleNamespace:
    """What the connection reads of a job."""
    return SimpleNamespace(
        af_output_dir=str(out_dir),
        env=SimpleNamespace(RAY_ADDRESS=address),
        backend_config=SimpleNamespace(rl_config=SimpleNamespace(reward=SimpleNamespace(num_workers=1))),
    )


# ------------------------------------------------------------------------------------------- the worker's side
WORKER = textwrap.dedent("""
    import os, sys
    from mm_rl.trainer.runtime import setup_worker
    setup_worker()
    print("a python line", flush=True)
    os.write(2, b"a C-level line\\n")
    os.system("echo a child process line")
""")


def _worker(env: dict[str, str]) -> str:
    """A process running the workers' set-up hook, then writing from Python, C and a child; what its console got."""
    import os

    done = subprocess.run(
        [sys.executable, "-c", WORKER],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout + done.stderr


def test_a_worker_writes_everything_to_the_log_file(tmp_path):
    log = tmp_path / "workers.log"
    assert _worker({LOG_ENV: str(log)}) == ""
    lines = log.read_text().splitlines()
    assert "Ray worker started" in lines[0]
    assert lines[1:] == ["a python line", "a C-level line", "a child process line"]


@pytest.mark.parametrize("where", ["no log file", "a node that cannot open it"])
def test_a_worker_without_the_log_file_keeps_its_output(tmp_path, where):
    (tmp_path / "not_a_dir").write_text("")
    env = {} if where == "no log file" else {LOG_ENV: str(tmp_path / "not_a_dir" / "workers.log")}
    output = _worker(env)
    assert all(line in output for line in ("a python line", "a C-level line", "a child process line")), output


# ------------------------------------------------------------------------------------------- the driver's side
def test_ray_forwards_nothing_to_the_console_unless_verbose(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    log = tmp_path / "logs" / "workers.log"
    quiet, where = runtime.init_options(_job(tmp_path), RESOURCES, log)
    assert quiet["log_to_driver"] is False and where.startswith("a local Ray instance")
    assert quiet["runtime_env"]["worker_process_setup_hook"] == "mm_rl.trainer.runtime.setup_worker"
    assert quiet["runtime_env"]["env_vars"][LOG_ENV] == str(log)
    verbose, _ = runtime.init_options(_job(tmp_path), RESOURCES, None)
    assert verbose["log_to_driver"] is True
    assert "worker_process_setup_hook" not in verbose["runtime_env"]
    assert LOG_ENV not in verbose["runtime_env"]["env_vars"]
    joined, where = runtime.init_options(_job(tmp_path, "head:6379"), RESOURCES, log)
    assert joined["address"] == "head:6379" and "num_cpus" not in joined and where == "Ray cluster at head:6379"
    assert joined["log_to_driver"] is False


class FakeRay:
    """``ray.init`` / ``ray.shutdown`` stand-ins: init logs a line on the "ray" logger (as Ray's own notices do),
    then raises ``fail`` if given."""

    def __init__(self, fail: type[BaseException] | None = None) -> None:
        self.fail, self.init_options, self.shutdowns = fail, None, []

    def init(self, **options):
        self.init_options = options
        logging.getLogger("ray.fake").warning("a notice of ray.init")
        if self.fail is not None:
            raise self.fail

    def shutdown(self, **kwargs):
        self.shutdowns.append(kwargs)


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    def use(fail=None):
        fake = FakeRay(fail)
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        monkeypatch.setattr(ray, "init", fake.init)
        monkeypatch.setattr(ray, "shutdown", fake.shutdown)
        monkeypatch.delenv(VERBOSE_ENV, raising=False)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        return fake

    return use


def _ray_handlers() -> list[logging.Handler]:
    return list(logging.getLogger("ray").handlers)


def test_the_drivers_ray_lines_go_to_the_log_until_close(tmp_path, fake_ray, capsys):
    """The "ray" logger's lines and the raylet's relayed messages (coloured "(raylet)" lines that Ray's driver thread
    prints even with log_to_driver off) go to the worker log, uncoloured, until the connection closes."""
    import ray._private.worker as ray_worker

    fake, console, printer = fake_ray(), _ray_handlers(), ray_worker.print_to_stdstream
    connection = runtime.connect(_job(tmp_path), RESOURCES)
    log = tmp_path.resolve() / WORKER_LOG
    assert connection.log_file == log and fake.init_options["log_to_driver"] is False
    assert [type(handler) for handler in _ray_handlers()] == [logging.FileHandler]
    killed = "\x1b[33mWarning:\x1b[0m A worker died or was killed while executing a task"
    ray_worker.print_to_stdstream({"lines": [killed], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    assert capsys.readouterr().out == ""
    assert "(raylet) Warning: A worker died or was killed" in log.read_text() and "\x1b[" not in log.read_text()
    connection.close()
    assert ray_worker.print_to_stdstream is printer
    assert fake.shutdowns == [{"wait_for_processes": True}]
    assert _ray_handlers() == console  # the "ray" logger prints to the console again
    logging.getLogger("ray.fake").warning("after the run")
    text = log.read_text()
    assert "a run starts" in text.splitlines()[0] and "a notice of ray.init" in text and "after the run" not in text


def test_verbose_keeps_everything_on_the_console(tmp_path, fake_ray, monkeypatch):
    fake, console = fake_ray(), _ray_handlers()
    monkeypatch.setenv(VERBOSE_ENV, "1")
    connection = runtime.connect(_job(tmp_path), RESOURCES)
    assert connection.log_file is None and fake.init_options["log_to_driver"] is True
    assert _ray_handlers() == console
    assert not (tmp_path / WORKER_LOG).exists()
    connection.close()


def test_an_interrupted_ray_init_is_shut_down(tmp_path, fake_ray):
    fake, console = fake_ray(KeyboardInterrupt), _ray_handlers()
    with pytest.raises(KeyboardInterrupt):
        runtime.connect(_job(tmp_path), RESOURCES)
    assert fake.shutdowns == [{"wait_for_processes": True}]
    assert _ray_handlers() == console


def test_a_slow_placement_is_reported(monkeypatch):
    import importlib

    import ray

    placement_module = importlib.import_module("ray.util.placement_group")  # ray.util's attribute is the function
    group = SimpleNamespace(ready=lambda: "ready-ref")
    monkeypatch.setattr(placement_module, "placement_group", lambda bundles, strategy: group)
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: ([], refs))  # not ready within the notice time
    monkeypatch.setattr(ray, "get", lambda ref, timeout: None)
    lines: list[str] = []
    assert runtime.make_placement(RESOURCES, report=lines.append) is group
    assert len(lines) == 1 and lines[0].startswith("waiting for Ray to place 1 bundles") and "ray status" in lines[0]


def test_the_summary_names_the_worker_log(tmp_path, monkeypatch):
    from mm_rl.job.run import JobResult, summary

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    result = JobResult(out_dir=tmp_path, checkpoint_dir=tmp_path / "ckpt", hf_dir=None, plot=None)
    assert "worker log" not in summary(result, "job.yaml")  # none written
    (tmp_path / WORKER_LOG).parent.mkdir()
    (tmp_path / WORKER_LOG).write_text("")
    assert f"  worker log:       {tmp_path / WORKER_LOG}" in summary(result, "job.yaml")
    monkeypatch.setenv(VERBOSE_ENV, "1")
    assert "worker log" not in summary(result, "job.yaml")  # a verbose run wrote nothing there


def test_the_engines_thread_binding_warning_is_dropped():
    from mm_rl.rollout.vllm_engine import _DropThreadBindingWarning

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("vllm.v1.worker.cpu_worker", logging.WARNING, __file__, 1, message, None, None)

    drop = _DropThreadBindingWarning()
    assert not drop.filter(
        record("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.")
    )
    assert drop.filter(record("libtcmalloc is not found in LD_PRELOAD."))


def test_a_partial_weight_reload_mutes_only_vllms_per_layer_warnings_and_keeps_the_loggers_caches(caplog):
    """During a reload the reload loggers' warnings (a layer the push did not carry) are dropped, their errors and
    every other logger's warnings kept, and afterwards all is as before; no logger's level cache is cleared (a
    level change would clear every logger's, ~1 ms each time with vLLM's, torch's and Ray's loggers loaded)."""
    from mm_rl.rollout.vllm_engine import _RELOAD_LOGGERS, _quiet_reload

    reload, other = logging.getLogger(_RELOAD_LOGGERS[0]), logging.getLogger("mm_rl.test.other")
    with caplog.at_level(logging.INFO):
        assert other.isEnabledFor(logging.WARNING) and other._cache  # logging caches the answer per logger
        cache = dict(other._cache)
        with _quiet_reload():
            reload.warning("layer 3 got no tensor")
            reload.error("a real failure")
            other.warning("another module's warning")
        assert other._cache == cache
        reload.warning("after the reload")
    assert [r.getMessage() for r in caplog.records] == [
        "a real failure",
        "another module's warning",
        "after the reload",
    ]


# --------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_an_interrupt_in_start_up_stops_the_local_ray(tiny_base, tmp_path, monkeypatch, capfd):
    """SIGTERM (as Ctrl-C) while the engine starts (after Ray, the placement and the ranks): no Ray left, no
    traceback. ray.init has installed its own SIGTERM handler by then; the job's own replaces it."""
    import psutil
    import ray

    from mm_rl.trainer import ray_roles

    assert not ray.is_initialized()  # else the roles would join that instance and leave it running
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    started: list[psutil.Process] = []

    def interrupted(self) -> None:
        # the local instance (raylet, GCS, the ranks): what this process started since, not earlier tests' helpers
        started.extend(p for p in psutil.Process().children(recursive=True) if p.pid not in earlier)
        names.update(process.name() for process in started)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends

    names: set[str] = set()
    earlier = {p.pid for p in psutil.Process().children(recursive=True)}

    monkeypatch.setattr(ray_roles.RayRoles, "_start_engine", interrupted)
    job = job_for(tiny_base / "job.yaml", tiny_base, tmp_path / "out")
    lines: list[str] = []
    try:
        with pytest.raises(runtime.Terminated):
            ray_roles.RayRoles(job, tmp_path / "not_built", lines.append)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert not ray.is_initialized()
    assert {"raylet", "gcs_server"} <= names
    _, alive = psutil.wait_procs(started, timeout=30)
    assert alive == [], alive
    output = "".join(capfd.readouterr())
    assert "Traceback" not in output and "Ray" not in output, output
    assert lines[-1] == f"the engine's and workers' output: {(tmp_path / 'out').resolve() / WORKER_LOG}"


def test_a_cluster_address_where_nothing_answers_fails_fast_naming_its_source(tmp_path, fake_ray, monkeypatch):
    """A wrong RAY_ADDRESS (yaml key or environment variable) fails after env.RAY_CONNECT_TIMEOUT_S, not after minutes
    of Ray's retries, naming where the address came from; ray.init is never called. A live address passes."""
    import socket
    import time

    from mm_rl.config.loader import ConfigError

    fake = fake_ray()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    for address, env in ((f"127.0.0.1:{port}", None), (None, f"127.0.0.1:{port}")):
        if env:
            monkeypatch.setenv("RAY_ADDRESS", env)
        job = _job(tmp_path, address)
        job.env.RAY_CONNECT_TIMEOUT_S = 1.5
        started = time.monotonic()
        with pytest.raises(ConfigError) as err:
            runtime.connect(job, RESOURCES)
        (problem,) = err.value.violations
        assert problem.key == ("env.RAY_ADDRESS" if address else "RAY_ADDRESS (environment variable)")
        assert problem.value == f"127.0.0.1:{port}" and "no Ray cluster answers" in problem.rule
        assert "unset" in problem.fix and 1.5 <= time.monotonic() - started < 10
    assert fake.init_options is None
    with socket.create_server(("127.0.0.1", 0)) as server:
        runtime.wait_for_cluster(f"ray://127.0.0.1:{server.getsockname()[1]}", "env.RAY_ADDRESS", 5.0)


TRAIN_THAT_WAITS = textwrap.dedent("""
    import sys, time
    import mm_rl.job.run as run
    import mm_rl_cli.main as cli

    def waits(job, report=print):
        print("running", flush=True)
        time.sleep(60)

    cli._validated_job = lambda path, overrides: None
    run.run_job = waits
    sys.exit(cli.main(["train", "job.yaml"]))
""")


def test_sigterm_to_train_stops_it_like_ctrl_c_with_exit_143():
    """``kill`` / a scheduler's SIGTERM to ``train`` (a real process): the job's teardown runs as for Ctrl-C, it exits
    143 with the resume hint and no traceback."""
    process = subprocess.Popen([sys.executable, "-c", TRAIN_THAT_WAITS], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert process.stdout is not None and process.stdout.readline().strip() == "running"
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 143, err
    assert "terminated (SIGTERM); run the same command again to resume" in err and "Traceback" not in err
