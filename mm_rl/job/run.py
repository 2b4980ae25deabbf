"""One whole job, as ``ascendfactory-cli train`` runs it: hf2mg -> GRPO -> mg2hf, then the plot and a summary.

Each stage announces itself. hf2mg is skipped only when ``mm_dir`` holds a conversion of the same source files
with the same model.json and layout (checked from the record the conversion wrote, not assumed from the
directory's existence). A run whose ``save`` directory holds a checkpoint resumes from it (``resume_mode``); one
that names no usable checkpoint is refused by ``check`` (``mm_rl.job.validate``), and again here, in the same
format, should the directory change in between.
``failure_message`` is what ``train`` prints when the run fails: the error, then a rerun only where one can help.
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mm_rl.config.loader import ConfigError, Violation
from mm_rl.config.schema import JobConfig

if TYPE_CHECKING:
    from mm_rl.trainer.grpo import GRPOTrainer

PLOT_FILE = "metrics.png"
RESUME_KEY = "backend_config.megatron_training.resume_mode"
RERUN = "the last complete checkpoint is kept; run the same command again to resume from it"
_NO_WRITE = (
    "give this user write permission there, or point af_output_dir (and megatron_training.save) at a "
    "directory it may write"
)
# The disk errors a user fixes outside mm_rl, and how; any other OSError is a bug and keeps its traceback.
_DISK_FIXES = {
    errno.ENOSPC: "free space on that file system (backend_config.megatron_training.max_keep_ckpts bounds the "
    "checkpoints kept)",
    errno.EDQUOT: "free space within your quota there",
    errno.EROFS: "make that file system writable, or point af_output_dir (and megatron_training.save) at a "
    "writable one",
    errno.EACCES: _NO_WRITE,
    errno.EPERM: _NO_WRITE,
}


@dataclass
class JobResult:
    """Where a finished job put its outputs, and its last metrics."""

    out_dir: Path
    checkpoint_dir: Path
    hf_dir: Path | None
    plot: Path | None
    final: dict[str, float] = field(default_factory=dict)
    resumed_from: int | None = None
    seconds: float = 0.0


def convert_in(job: JobConfig, report: Callable[[str], None]) -> Path:
    """hf2mg, unless ``mm_dir`` already holds a matching conversion."""
    from mm_rl.convert.hf2mg import hf2mg, reusable_conversion

    b = job.backend_config
    cfg = b.convert_ckpt_hf2mg.cfg
    reason = reusable_conversion(cfg, b.model)
    if reason is None:
        report(f"[1/3] hf2mg: {cfg.mm_dir} already holds this conversion (same files, model.json and layout); skipped")
        return Path(cfg.mm_dir)
    report(f"[1/3] hf2mg: {cfg.hf_config.hf_dir} -> {cfg.mm_dir} ({reason})")
    start = time.perf_counter()
    out = hf2mg(cfg, b.model)
    report(f"      done in {time.perf_counter() - start:.1f} s")
    return out


def convert_out(job: JobConfig, report: Callable[[str], None]) -> Path:
    """mg2hf of the latest checkpoint into ``save_hf_dir``; its failure says that training itself is done."""
    from mm_rl.convert.errors import ConversionError
    from mm_rl.convert.mg2hf import mg2hf

    b = job.backend_config
    cfg = b.convert_ckpt_mg2hf.cfg
    report(f"[3/3] mg2hf: {cfg.load_dir} (latest) -> {cfg.save_hf_dir}")
    start = time.perf_counter()
    try:
        out = mg2hf(cfg, b.model, b.convert_ckpt_hf2mg.cfg.hf_config.hf_dir)
    except ConversionError as err:
        raise ConversionError(
            f"{err}\ntraining finished and its checkpoints are kept in {cfg.load_dir}; once the "
            "above is fixed, `ascendfactory-cli convert mg2hf --job <this job yaml>` writes the "
            "HuggingFace checkpoint without training again"
        ) from err
    report(f"      done in {time.perf_counter() - start:.1f} s")
    if b.actor_config.lora.enabled:
        from mm_rl.convert.lora import ADAPTER_DIR

        adapter, base = out / ADAPTER_DIR, b.convert_ckpt_hf2mg.cfg.hf_config.hf_dir
        report(
            f"      LoRA: the adapters merged into {out}; as a PEFT adapter of {base}: {adapter}"
            if adapter.is_dir()
            else "      LoRA: the adapters merged; no PEFT adapter directory (adapters on experts: transformers keeps "
            "a layer's experts in one fused tensor)"
        )
    return out


def resume(trainer: GRPOTrainer, job: JobConfig) -> int | None:
    """``trainer.resume()``; a checkpoint whose state does not fit the job (another seed or data set: the
    sampler refuses it; another layout: ``check``'s rule, asked again here in case the directory changed since), or
    a save directory that holds no loadable checkpoint, is reported as the user's choice to make, not as a crash."""
    from mm_rl.checkpoint import CheckpointRefused
    from mm_rl.job.validate import resume_checkpoint

    refused = list(resume_checkpoint(job))
    if refused:
        raise ConfigError(refused)
    try:
        return trainer.resume()
    except CheckpointRefused as err:  # validation refuses it first, unless the directory changed since
        raise _resume_error(job, err.rule, err.fix) from None
    except ConfigError:
        raise
    except ValueError as err:
        raise _resume_error(
            job,
            f"the checkpoint cannot continue this job: {err}",
            "restore the settings the checkpoint was trained with, or set it to 'disable' to start over from step 0",
        ) from None


def _resume_error(job: JobConfig, rule: str, fix: str) -> ConfigError:
    return ConfigError([Violation(RESUME_KEY, job.backend_config.megatron_training.resume_mode, rule, fix)])


def run_job(job: JobConfig, report: Callable[[str], None] = print) -> JobResult:
    """The whole job; a worker failure or a stop raises after the roles are torn down (resume with the same
    command). The run holds its directories' locks throughout: a second run on them is refused at once."""
    start = time.perf_counter()
    out_dir = Path(job.af_output_dir)
    with run_locks(job, report):
        return _run(job, out_dir, start, report)


@contextlib.contextmanager
def run_locks(job: JobConfig, report: Callable[[str], None]) -> Iterator[None]:
    """The run directory's lock and, when the checkpoints are written elsewhere, theirs (``mm_rl.job.lock``)."""
    from mm_rl.job.lock import run_lock

    out_dir, save = Path(job.af_output_dir), Path(job.backend_config.megatron_training.save)
    with contextlib.ExitStack() as locks:
        locks.enter_context(run_lock(out_dir, "af_output_dir", report))
        if job.backend_config.megatron_training.save and not save.resolve().is_relative_to(out_dir.resolve()):
            locks.enter_context(run_lock(save, "backend_config.megatron_training.save", report))
        yield


def _run(job: JobConfig, out_dir: Path, start: float, report: Callable[[str], None]) -> JobResult:
    from mm_rl.trainer.grpo import build_trainer
    from mm_rl.trainer.metrics import METRICS_FILE, plot_metrics

    mm_dir = convert_in(job, report)
    total = job.backend_config.megatron_training.train_iters
    report(f"[2/3] GRPO: {total} steps, metrics in {out_dir / METRICS_FILE}")
    trainer = build_trainer(job, mm_dir, report)
    graceful = False
    try:
        resumed = resume(trainer, job)
        history = trainer.fit()
        graceful = True
    finally:
        trainer.close(graceful)
    plot = plot_metrics(out_dir / METRICS_FILE, out_dir / PLOT_FILE)
    hf_dir = convert_out(job, report)
    return JobResult(
        out_dir,
        Path(job.backend_config.megatron_training.save),
        hf_dir,
        plot,
        history[-1] if history else {},
        resumed,
        time.perf_counter() - start,
    )


def summary(result: JobResult, job_path: str) -> str:
    """What the user reads at the end: where everything is, the last numbers, how to resume or go on."""
    from mm_rl.trainer.runtime import worker_log

    final, log = result.final, worker_log(result.out_dir)
    numbers = ", ".join(
        f"{label} {final[key]:.3f}"
        for key, label in (("reward/score", "reward"), ("reward/accuracy", "accuracy"), ("actor/kl_loss", "kl"))
        if key in final
    )
    lines = [
        f"done in {result.seconds / 60:.1f} min"
        + (f" (resumed from step {result.resumed_from})" if result.resumed_from else ""),
        f"  last step:        {numbers or 'no step ran (already at train_iters)'}",
        f"  metrics:          {result.out_dir / 'metrics.jsonl'} (TensorBoard: {result.out_dir / 'tensorboard'})",
        f"  plot:             {result.plot}",
        f"  checkpoints:      {result.checkpoint_dir}",
        f"  HF checkpoint:    {result.hf_dir} (loads in transformers and vLLM)",
        *([f"  worker log:       {log} (the engine's, ranks' and Ray's output)"] if log else []),
        f"  train further:    ascendfactory-cli train {job_path} "
        "--backend_config.megatron_training.train_iters=N  (resumes from the latest checkpoint)",
    ]
    return "\n".join(lines)


def failure_message(error: BaseException) -> str | None:
    """What ``train`` prints (after ``error:``) when the run fails, instead of a traceback: the error, then the
    advice that fits it. A rerun is advised only where one can succeed: a worker that died (the cause may be
    transient), a disk problem once fixed. Where a rerun would only repeat the failure (a checkpoint refused or
    unreadable, a conversion error, a run stopped by non-finite losses, which a resume repeats exactly) the
    message itself names the fix. None for anything else: a bug, whose traceback is the report (a
    ``ConfigError`` goes to the CLI's own handler)."""
    from mm_rl.checkpoint import CheckpointError, describe_os_error
    from mm_rl.convert.errors import ConversionError
    from mm_rl.trainer.grpo import TrainingStopped
    from mm_rl.workers.group import WorkerError

    disk = _disk_error(error)
    if disk is not None:
        named = describe_os_error(disk)  # unless the error's own message says it (a save's says which step)
        text = str(error) if error is not disk and named in str(error) else named
        return (
            f"{text}\n{_DISK_FIXES[disk.errno]}, then run the same command again: it resumes from the last "
            "complete checkpoint"
        )
    if isinstance(error, WorkerError):
        return f"{error}\n{RERUN}"
    if isinstance(error, TrainingStopped):
        return (
            f"{error}\nthe last complete checkpoint is kept: after that change, run the command again to resume "
            "from it (unchanged, a rerun repeats this)"
        )
    if isinstance(error, CheckpointError | ConversionError):
        return str(error)
    return None


def _disk_error(error: BaseException | None) -> OSError | None:
    """The disk error (full, read-only, no permission) that ``error`` is or was raised from, if any (a rank's
    too: through the Ray error it came in)."""
    from mm_rl.files import os_error_in

    found = os_error_in(error)
    return found if found is not None and found.errno in _DISK_FIXES else None
