"""Megatron shards (MindSpeed-MM layout, release or a training iteration) -> a HuggingFace checkpoint.

Two passes over the memory-mapped rank files. The first only reads their key lists and tensor headers: every
missing, unexpected or misshapen tensor is reported (naming the file) before any output exists, and it yields
the name, shape and dtype of every HF tensor, which fixes the output shards up front. The second streams one
tensor at a time into its safetensors shard: where TP split rows, straight from the shards' row blocks (never
assembled); where it split columns, assembled first. Input pages are given back before the bytes read pass one
rank file's size, so memory stays near one input file plus one column-split tensor. Non-model entries of
training checkpoints (optimizer, RNG, args) are never constructed. The result is built in a staging
directory beside ``save_hf_dir`` and renamed into place when complete. An iteration the trainer saved must be
whole (its completion marker vouches for every file): otherwise the error names the newest complete earlier one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from mm_rl.config.loader import ConfigError, Violation
from mm_rl.config.schema import Mg2HfCfg, ModelConfig
from mm_rl.convert.errors import ConversionError, listing
from mm_rl.convert.fused import FusingWriter, fuse_specs
from mm_rl.convert.hf_writer import DEFAULT_MAX_SHARD_BYTES, ShardedWriter, TensorSpec, copy_side_files
from mm_rl.convert.layout import (
    COMPLETE,
    Iteration,
    check_rank_dirs,
    complete_steps,
    incomplete_reason,
    iteration_name,
    load_model_state,
    lora_meta,
    rank_file,
    resolve_iteration,
    staged_dir,
)
from mm_rl.convert.mapping import Bound, check_shards, hf_blocks, hf_shape, model_dims, model_family, stage_tensors
from mm_rl.convert.pages import prefault
from mm_rl.convert.stages import Pipeline, Stage, plan_pipeline

EXTRA_STATE = "._extra_state"


def mg2hf(
    cfg: Mg2HfCfg,
    model: ModelConfig,
    hf_dir: str | Path,
    iteration: Iteration | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Convert ``iteration`` of ``cfg.load_dir`` (None: the latest) into ``cfg.save_hf_dir``; returns it. A LoRA
    checkpoint's adapters are merged into their base's weights, and its PEFT adapter directory goes beside them
    (``lora_adapter/``, see ``mm_rl.convert.lora``; not for adapters on experts).

    ``hf_dir`` is the HF checkpoint the model came from: its config, tokenizer, processor and chat template
    files are copied (config.json adjusted when model.json keeps fewer layers)."""
    pipeline = plan_pipeline(model, cfg.parallel_config)
    source, out = Path(hf_dir), Path(cfg.save_hf_dir)
    _check_target(out, source, Path(cfg.load_dir))
    iteration_dir = _complete_iteration(Path(cfg.load_dir), iteration)
    check_rank_dirs(iteration_dir, pipeline.tp, pipeline.pp, pipeline.ep)
    plan = [
        (stage, ep_rank, stage_tensors(model, stage, ep_rank, pipeline.ep))
        for stage in pipeline.stages
        for ep_rank in range(pipeline.ep)
    ]
    specs = [
        spec
        for stage, ep_rank, bounds in plan
        for spec in _stage_specs(iteration_dir, model, pipeline, stage, ep_rank, bounds)
    ]
    fused = model_family(model).hf_fused
    with staged_dir(out) as staging:
        writer = FusingWriter(ShardedWriter(staging, fuse_specs(specs, fused), max_shard_bytes), fused)
        try:
            for stage, ep_rank, bounds in plan:
                _write_stage(writer, iteration_dir, model, pipeline, stage, ep_rank, bounds)
            writer.finish()
        finally:
            writer.abort()
        copy_side_files(source, staging, model)
        lora = lora_meta(rank_file(iteration_dir, 0, 0, pipeline.pp, 0, pipeline.ep))
        if lora is not None:
            from mm_rl.convert.lora import ADAPTER_DIR, write_peft_adapter

            write_peft_adapter(iteration_dir, model, pipeline, lora, staging / ADAPTER_DIR, str(source))
    return out


def _check_target(out: Path, source: Path, load_dir: Path) -> None:
    for other, what in ((source, "the source HuggingFace checkpoint (hf_dir)"), (load_dir, "cfg.load_dir")):
        if out.resolve() == other.resolve():
            raise ConfigError([Violation("cfg.save_hf_dir", str(out), f"is {what}", "write to another directory")])
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ConfigError(
            [
                Violation(
                    "cfg.save_hf_dir",
                    str(out),
                    "exists and is not a HuggingFace checkpoint",
                    "choose a new or empty directory (an earlier output is replaced)",
                )
            ]
        )


def _complete_iteration(root: Path, iteration: Iteration | None) -> Path:
    """The directory of ``iteration`` (None: the latest); in a training checkpoint directory (its iterations
    carry the trainer's completion markers) it must be complete, and every error names the complete one to ask
    for instead."""
    trained = _trained_here(root)
    try:
        path = resolve_iteration(root, iteration)
    except ConversionError as err:
        raise ConversionError(f"{err}{_complete_hint(root, None) if trained else ''}") from None
    step = _step_of(path)
    reason = incomplete_reason(root / iteration_name(step)) if trained and step is not None else None
    if reason is not None:
        raise ConversionError(f"iteration {step} is incomplete: {reason}{_complete_hint(root, step)}")
    return path


def _trained_here(root: Path) -> bool:
    """Whether ``root`` was written by mm_rl's trainer: one of its iterations carries a completion marker."""
    return root.is_dir() and any((p / COMPLETE).exists() for p in root.glob("iter_*"))


def _step_of(path: Path) -> int | None:
    return int(path.name.removeprefix("iter_")) if path.name.startswith("iter_") else None


def _complete_hint(root: Path, before: int | None) -> str:
    """ "; iteration N (path) is complete: convert it with --iteration N", or that none (before ``before``) is."""
    steps = [s for s in complete_steps(root) if before is None or s < before]
    earlier = "" if before is None else "earlier "
    if not steps:
        return f"; no {earlier}iteration in {root} is complete"
    return (
        f"; the newest complete {earlier}iteration is {steps[-1]} ({root / iteration_name(steps[-1])}): "
        f"convert it with --iteration {steps[-1]}"
    )


class _StageFiles:
    """The TP rank files of one stage and EP rank, memory-mapped lazily; they are dropped (which gives their pages
    back) and mapped again, cheaply, whenever the next tensor would take the bytes read past ``budget``, one
    file's size."""

    def __init__(self, iteration_dir: Path, pipeline: Pipeline, stage: Stage, ep_rank: int) -> None:
        self.paths = [
            rank_file(iteration_dir, r, stage.pp_rank, pipeline.pp, ep_rank, pipeline.ep) for r in range(pipeline.tp)
        ]
        self.budget = max(p.stat().st_size for p in self.paths) if all(p.is_file() for p in self.paths) else 0
        self._states: list[Mapping[str, torch.Tensor] | None] = [None] * pipeline.tp
        self._read = 0

    def state(self, rank: int) -> Mapping[str, torch.Tensor]:
        loaded = self._states[rank]
        if loaded is None:
            loaded = self._states[rank] = load_model_state(self.paths[rank])
        return loaded

    def shards(self, name: str) -> list[torch.Tensor]:
        """The TP shards of ``name``; first gives back the pages read so far if these would pass the budget."""
        size = sum(self.state(r)[name].nbytes for r in range(len(self.paths)))
        if self._read and self._read + size > self.budget:
            self._states = [None] * len(self.paths)
            self._read = 0
        self._read += size
        shards = [self.state(r)[name] for r in range(len(self.paths))]
        for shard in shards:
            prefault(shard)
        return shards


def _written(bound: Bound, ep_rank: int) -> bool:
    """Whether this EP rank's copy of ``bound`` is written: its own experts; the rest from EP rank 0 (every EP
    rank holds the same copy), the tied output-layer copy never."""
    return not bound.entry.duplicate and (bound.entry.expert or ep_rank == 0)


def _stage_specs(
    iteration_dir: Path, model: ModelConfig, pipeline: Pipeline, stage: Stage, ep_rank: int, bounds: list[Bound]
) -> list[TensorSpec]:
    """Check the stage's rank files hold exactly the expected tensors with the expected shapes; the HF tensors
    they make, in writing order (per-expert parts unfused)."""
    files = _StageFiles(iteration_dir, pipeline, stage, ep_rank)
    expected = {b.mg for b in bounds}
    for rank, path in enumerate(files.paths):
        keys = {k for k in files.state(rank) if not k.endswith(EXTRA_STATE)}
        if keys != expected:
            lines = [f"missing {k}" for k in sorted(expected - keys)]
            lines += [f"unexpected {k}" for k in sorted(keys - expected)]
            raise ConversionError(
                f"{path} does not hold the tensors of pipeline stage {stage.pp_rank} (ViT blocks "
                f"{_span(stage.vit)}, LLM layers {_span(stage.llm)}): check the pipeline split "
                "and model.json against the checkpoint\n" + listing(lines)
            )
    dims = model_dims(model)
    specs = []
    for bound in bounds:
        check_shards(bound, dims, [files.state(r)[bound.mg] for r in range(pipeline.tp)], files.paths)
        if _written(bound, ep_rank):
            dtype = files.state(0)[bound.mg].dtype
            specs += [TensorSpec(name, hf_shape(bound.entry, part, dims), dtype) for part, name in enumerate(bound.hf)]
    return specs


def _write_stage(
    writer: FusingWriter,
    iteration_dir: Path,
    model: ModelConfig,
    pipeline: Pipeline,
    stage: Stage,
    ep_rank: int,
    bounds: list[Bound],
) -> None:
    files = _StageFiles(iteration_dir, pipeline, stage, ep_rank)
    dims = model_dims(model)
    for bound in bounds:
        if not _written(bound, ep_rank):
            continue
        for name, blocks in zip(bound.hf, hf_blocks(bound, dims, files.shards(bound.mg)), strict=True):
            writer.write(name, blocks)


def _span(layers: range) -> str:
    return f"{layers.start}-{layers.stop - 1}" if len(layers) else "none"
