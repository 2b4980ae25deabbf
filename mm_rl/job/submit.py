"""``ascendfactory-cli submit``: the same job through Ray's job submission API on a running cluster.

The job yaml is composed here (overrides applied, validated), relative paths are made absolute against the
submitting directory (cluster nodes share the file system the paths point to), and the resolved yaml travels
to the cluster in the job's ``working_dir``; the entrypoint is ``ascendfactory-cli train job.yaml``. Logs are
streamed until the job ends, unless ``--no-wait``.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mm_rl.config.loader import load_checked
from mm_rl.config.writer import write_job_yaml
from mm_rl.job.validate import validate
from mm_rl.workers.group import error_line

# Keys holding paths the user sets directly (the others interpolate these).
PATH_KEYS = (
    "af_output_dir",
    "backend_config.megatron_training.tokenizer_name_or_path",
    "backend_config.megatron_training.save",
    "backend_config.data.dataset_param.basic_parameters.dataset_dir",
    "backend_config.convert_ckpt_hf2mg.cfg.mm_dir",
    "backend_config.convert_ckpt_mg2hf.cfg.save_hf_dir",
)
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def absolute_paths(node: DictConfig, base: Path) -> None:
    """Make the directly-set relative paths absolute against ``base`` (interpolations keep following them)."""
    raw = OmegaConf.to_container(node, resolve=False)
    for key in PATH_KEYS:
        value: Any = raw
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, str) and value and "${" not in value and not Path(value).is_absolute():
            OmegaConf.update(node, key, str((base / value).resolve()))


def submit(
    job_path: str,
    overrides: Sequence[str],
    address: str,
    *,
    wait: bool = True,
    report: Callable[[str], None] = print,
    poll_s: float = 2.0,
) -> int:
    """Submit the job; with ``wait`` stream its logs and return 0 when it succeeded, else 1."""
    from ray.job_submission import JobSubmissionClient

    node, _ = load_checked(job_path, overrides, lambda job: validate(job, check_paths=False))
    absolute_paths(node, Path.cwd())
    _use_token_if_present()
    try:
        client = JobSubmissionClient(address)
        with tempfile.TemporaryDirectory(prefix="mm_rl-submit-") as folder:
            write_job_yaml(node, Path(folder) / "job.yaml", header="submitted by ascendfactory-cli submit")
            job_id = client.submit_job(
                entrypoint="ascendfactory-cli train job.yaml", runtime_env={"working_dir": folder}
            )
    except Exception as error:  # Ray raises ConnectionError, RuntimeError or its own auth errors here
        raise SubmitError(
            f"could not submit to {address}: {error_line(error)}. Is the head's dashboard at that "
            "address (ray start --head prints it; default port 8265), and, with token "
            "authentication on, is RAY_AUTH_MODE=token set with the cluster's token?"
        ) from error
    report(f"submitted {job_id} to {address}")
    if not wait:
        report(f"follow it with: ray job logs --address {address} --follow {job_id}")
        return 0
    return follow(client, job_id, report, poll_s)


class SubmitError(RuntimeError):
    """The cluster could not be reached or refused the job; the message says what to check."""


def _use_token_if_present() -> None:
    """Ray's token authentication: a head started where ``~/.ray/auth_token`` exists requires the token, and
    the client only sends it in token mode; turn that on when the token file exists and nothing says otherwise."""
    if "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def follow(client: object, job_id: str, report: Callable[[str], None], poll_s: float) -> int:
    """Print the job's new log lines until it ends; 0 when it succeeded."""
    shown = 0
    while True:
        status = str(client.get_job_status(job_id).value)  # type: ignore[attr-defined]
        logs = client.get_job_logs(job_id)  # type: ignore[attr-defined]
        if len(logs) > shown:
            report(logs[shown:].rstrip("\n"))
            shown = len(logs)
        if status in TERMINAL:
            report(f"job {job_id}: {status}")
            return 0 if status == "SUCCEEDED" else 1
        time.sleep(poll_s)
