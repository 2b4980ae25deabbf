"""``ascendfactory-cli submit`` against a real Ray head started with the ``ray`` CLI (job submission API on the
dashboard port), on the tiny job:

- a 1-step job submitted and followed exits 0, its streamed logs hold the step line, and the HF checkpoint
  (``save_hf_dir``) is written;
- ``--no-wait`` returns 0 at once and prints the job id (the job is then stopped);
- an unknown override exits 1 naming the key, and nothing reaches the cluster.

The head runs ``ray start --head --block`` in its own process group and temp dir, on free ports only (the
machine may run other Ray instances: no default port is taken and ``ray stop``, which would end every Ray
process of the machine, is never called); teardown signals that process group alone. ``ray start`` turns
Ray's token authentication on by default: the head, the submitting command and this test's client share a
token of their own (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN``), as a user submitting to such a cluster must.
"""

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from mp_utils import free_port
from trainer_utils import write_job

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
CLI = str(BIN / "ascendfactory-cli")
SHORT_RUN = (
    "--backend_config.megatron_training.train_iters=1",
    "--backend_config.rl_config.rollout_batch_size=2",
    "--backend_config.megatron_training.global_batch_size=16",
    "--backend_config.generate_config.sampling_config.max_tokens=16",
)
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
TOKEN = secrets.token_hex(32)
AUTH_ENV = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}


def client(address: str):
    """A job client of the test's own (the token goes as a header: Ray reads the auth mode once per process)."""
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address, headers={"Authorization": f"Bearer {TOKEN}"})


def cli_env() -> dict[str, str]:
    """The environment of the head and of the submitting command: no inherited cluster address, the venv's
    commands first on PATH (the job's entrypoint is ``ascendfactory-cli``), the test's token."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env | AUTH_ENV


# --------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ray_head():
    """A Ray head with the dashboard (job submission API); yields its http address."""
    temp_dir = tempfile.mkdtemp(prefix="rayhead_", dir="/tmp")  # short: Ray's socket paths live under it
    dashboard = free_port()
    ports = {
        "--port": free_port(),
        "--dashboard-port": dashboard,
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--runtime-env-agent-port": free_port(),
        "--metrics-export-port": free_port(),
        "--ray-client-server-port": free_port(),
        "--min-worker-port": 0,
        "--max-worker-port": 0,
    }
    log = open(Path(temp_dir) / "ray_start.log", "w")  # closed in teardown
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--num-cpus=4",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
            *(f"{k}={v}" for k, v in ports.items()),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=cli_env() | {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"},
    )  # no 30 s drain
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if head.poll() is not None:
                pytest.fail(f"ray start exited {head.returncode}:\n{(Path(temp_dir) / 'ray_start.log').read_text()}")
            try:
                client(address).list_jobs()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        yield address
    finally:
        stop_group(head)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the head's process group (``ray start --block`` then ends the processes it started), SIGKILL
    to what is left of that group after 30 s. Only this group: other Ray instances on the machine live on."""
    with_group = process.pid
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(with_group, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            process.poll()
            try:
                os.killpg(with_group, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


def submit(job: Path, address: str, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CLI, "submit", str(job), "--address", address, *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=job.parent,
        env=cli_env(),
    )


def job_ids(address: str) -> set[str]:
    return {job.submission_id for job in client(address).list_jobs()}


# ------------------------------------------------------------------------------------------------------ tests
def test_submit_follows_a_job_to_success(ray_head, tiny_base, tmp_path):
    job = write_job(tiny_base, tmp_path)
    result = submit(job, ray_head, *SHORT_RUN)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert re.search(r"^step 1/1 \| reward", output, re.MULTILINE), output
    assert "SUCCEEDED" in output
    assert (tmp_path / "out" / "ckpt_converted_mg2hf" / "config.json").is_file()


def test_submit_no_wait_returns_the_job_id(ray_head, tiny_base, tmp_path):
    job = write_job(tiny_base, tmp_path)
    start = time.monotonic()
    result = submit(job, ray_head, "--no-wait", *SHORT_RUN, timeout=120)
    seconds = time.monotonic() - start
    assert result.returncode == 0, result.stdout + result.stderr
    found = re.search(r"submitted (\S+) to ", result.stdout)
    assert found, result.stdout
    job_id = found.group(1)
    assert job_id in job_ids(ray_head)
    assert f"ray job logs --address {ray_head} --follow {job_id}" in result.stdout
    assert seconds < 60, f"--no-wait took {seconds:.0f} s"
    jobs = client(ray_head)  # the job itself is not this test's subject: stop it
    jobs.stop_job(job_id)
    deadline = time.monotonic() + 120
    while str(jobs.get_job_status(job_id).value) not in TERMINAL and time.monotonic() < deadline:
        time.sleep(1)
    assert str(jobs.get_job_status(job_id).value) in TERMINAL


def test_submit_unknown_override_submits_nothing(ray_head, tiny_base, tmp_path):
    job = write_job(tiny_base, tmp_path)
    before = job_ids(ray_head)
    result = submit(job, ray_head, "--backend_config.rl_config.no_such_key=3", timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "backend_config.rl_config.no_such_key" in result.stderr
    assert "submitted" not in result.stdout
    assert job_ids(ray_head) == before
