"""One whole job, as ``ascendfactory-cli train`` runs it: hf2mg -> GRPO -> mg2hf, then the plot and a summary.

Each stage announces itself. hf2mg is skipped only when ``mm_dir`` holds a conversion of the same source files
with the same model.json and layout (checked from the record the conversion wrote, not assumed from the
directory's existence). A run whose ``save`` directory holds a checkpoint resumes from it (``resume_mode``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mm_rl.config.schema import JobConfig

PLOT_FILE = "metrics.png"


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
    """mg2hf of the latest checkpoint into ``save_hf_dir``."""
    from mm_rl.convert.mg2hf import mg2hf

    b = job.backend_config
    cfg = b.convert_ckpt_mg2hf.cfg
    report(f"[3/3] mg2hf: {cfg.load_dir} (latest) -> {cfg.save_hf_dir}")
    start = time.perf_counter()
    out = mg2hf(cfg, b.model, b.convert_ckpt_hf2mg.cfg.hf_config.hf_dir)
    report(f"      done in {time.perf_counter() - start:.1f} s")
    return out


def run_job(job: JobConfig, report: Callable[[str], None] = print) -> JobResult:
    """The whole job; a worker failure or a stop raises after the roles are torn down (resume with the same
    command)."""
    from mm_rl.trainer.grpo import build_trainer
    from mm_rl.trainer.metrics import METRICS_FILE, plot_metrics

    start = time.perf_counter()
    out_dir = Path(job.af_output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mm_dir = convert_in(job, report)
    total = job.backend_config.megatron_training.train_iters
    report(f"[2/3] GRPO: {total} steps, metrics in {out_dir / METRICS_FILE}")
    trainer = build_trainer(job, mm_dir, report)
    graceful = False
    try:
        resumed = trainer.resume()
        history = trainer.fit()
        graceful = True
    finally:
        trainer.close(graceful)
    plot = plot_metrics(out_dir / METRICS_FILE, out_dir / PLOT_FILE)
    hf_dir = convert_out(job, report)
    return JobResult(out_dir, Path(job.backend_config.megatron_training.save), hf_dir, plot,
                     history[-1] if history else {}, resumed, time.perf_counter() - start)


def summary(result: JobResult, job_path: str) -> str:
    """What the user reads at the end: where everything is, the last numbers, how to resume or go on."""
    final = result.final
    numbers = ", ".join(f"{label} {final[key]:.3f}" for key, label in
                        (("reward/score", "reward"), ("reward/accuracy", "accuracy"), ("actor/kl_loss", "kl"))
                        if key in final)
    lines = [
        f"done in {result.seconds / 60:.1f} min" + (f" (resumed from step {result.resumed_from})"
                                                    if result.resumed_from else ""),
        f"  last step:        {numbers or 'no step ran (already at train_iters)'}",
        f"  metrics:          {result.out_dir / 'metrics.jsonl'} (TensorBoard: {result.out_dir / 'tensorboard'})",
        f"  plot:             {result.plot}",
        f"  checkpoints:      {result.checkpoint_dir}",
        f"  HF checkpoint:    {result.hf_dir} (loads in transformers and vLLM)",
        f"  train further:    ascendfactory-cli train {job_path} "
        "--backend_config.megatron_training.train_iters=N  (resumes from the latest checkpoint)",
    ]
    return "\n".join(lines)
