"""HuggingFace checkpoint -> Megatron shards in MindSpeed-MM's layout (``mm_dir/release/mp_rank_*``).

Everything is checked before anything is written: the pipeline split and TP size (ConfigError), then every
tensor the split needs against the checkpoint (missing, unexpected, misshapen: ConversionError naming the file
and tensor). A model.json with fewer layers than the checkpoint keeps the bottom layers (the others are left
out on purpose, not reported); more layers than the checkpoint is an error. Then one rank file at a time is
built from exactly the slices it needs and saved; the release directory is renamed into place when every file
is written, and the latest file is written last. A failed run leaves an earlier conversion in ``mm_dir`` as it
was.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from mm_rl.config.loader import ConfigError, Violation
from mm_rl.config.schema import Hf2MgCfg, ModelConfig
from mm_rl.convert.errors import ConversionError, listing
from mm_rl.convert.hf_reader import HfReader
from mm_rl.convert.layout import (
    RELEASE,
    check_rank_dirs,
    rank_file,
    read_latest,
    remove_latest_if,
    save_model_state,
    staged_dir,
    write_latest,
)
from mm_rl.convert.mapping import (
    Bound,
    dropped_layer,
    hf_layer_index,
    hf_shape,
    model_dims,
    model_family,
    published_name,
    shard_from_hf,
    stage_tensors,
    unused_tensor,
)
from mm_rl.convert.reshape import plan_reshape
from mm_rl.convert.stages import Pipeline, plan_pipeline
from mm_rl.files import require_space

SOURCE_RECORD = "hf2mg_source.json"  # in release/: what it was converted from, to reuse it only when that matches
LAYER_KEYS = {
    "vit_layer": "model.image_encoder.vision_encoder.num_layers",
    "llm_layer": "model.text_decoder.num_layers",
}


def hf2mg(cfg: Hf2MgCfg, model: ModelConfig, zip_crc32: bool = False) -> Path:
    """Convert ``cfg.hf_config.hf_dir`` into ``cfg.mm_dir``; returns ``cfg.mm_dir``.

    ``zip_crc32``: checksum the rank files' zip records (see ``layout.save_model_state``; torch.load ignores it)."""
    pipeline = plan_pipeline(model, cfg.parallel_config)
    hf_dir, mm_dir = Path(cfg.hf_config.hf_dir), Path(cfg.mm_dir)
    if mm_dir.resolve() == hf_dir.resolve():
        raise ConfigError(
            [
                Violation(
                    "cfg.mm_dir",
                    cfg.mm_dir,
                    "is the HuggingFace checkpoint directory itself",
                    "write the Megatron shards to another directory",
                )
            ]
        )
    plan = [
        [stage_tensors(model, stage, ep_rank, pipeline.ep) for ep_rank in range(pipeline.ep)]
        for stage in pipeline.stages
    ]
    dims = model_dims(model)
    shapes = {
        name: hf_shape(b.entry, part, dims)
        for stage in plan
        for rank in stage
        for b in rank
        if b.entry.expert
        for part, name in enumerate(b.hf)
    }
    reshape = plan_reshape(hf_dir, model)  # model.json narrower than the checkpoint, or its KV heads regrouped
    reader = HfReader(hf_dir, lambda name: published_name(model, name), model_family(model).hf_fused, shapes, reshape)
    check_checkpoint(reader, model, [b for stage in plan for rank in stage for b in rank])
    weights = [p for pattern in ("*.safetensors", "*.bin") for p in hf_dir.glob(pattern)]
    require_space(mm_dir, sum(p.stat().st_size for p in weights), "hf2mg's Megatron shards")  # at least that much
    write_release(reader, model, pipeline, plan, mm_dir, zip_crc32, source_record(cfg, model))
    return mm_dir


def source_record(cfg: Hf2MgCfg, model: ModelConfig) -> dict[str, Any]:
    """What a conversion depends on: the source files (name, size, mtime), model.json and the layout."""
    hf_dir = Path(cfg.hf_config.hf_dir).resolve()
    files = {
        p.name: [p.stat().st_size, p.stat().st_mtime_ns]
        for p in sorted(hf_dir.iterdir())
        if p.suffix == ".safetensors" or p.name in ("config.json", "model.safetensors.index.json")
    }
    parallel = cfg.parallel_config
    return {
        "hf_dir": str(hf_dir),
        "files": files,
        "model": dataclasses.asdict(model),
        "tp": parallel.tp_size,
        "ep": parallel.ep_size or 1,
        "llm_pp_layers": list(parallel.llm_pp_layers),
        "vit_pp_layers": list(parallel.vit_pp_layers),
    }


def reusable_conversion(cfg: Hf2MgCfg, model: ModelConfig) -> str | None:
    """None when ``cfg.mm_dir`` holds a complete conversion of the same source with the same model.json and
    layout (checked from the record hf2mg writes and the rank files present); else why it cannot be reused."""
    release = Path(cfg.mm_dir) / RELEASE
    try:
        recorded = json.loads((release / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        return f"{release} holds no complete conversion"
    if read_latest(Path(cfg.mm_dir)) != RELEASE:
        return f"{cfg.mm_dir}'s latest file does not name the release conversion"
    current = source_record(cfg, model)
    changed = [key for key in current if recorded.get(key) != current[key]]
    if changed:
        return f"the conversion in {release} was made with other {', '.join(changed)}"
    pipeline = plan_pipeline(model, cfg.parallel_config)
    try:
        check_rank_dirs(release, pipeline.tp, pipeline.pp, pipeline.ep)
    except ConversionError as error:
        return str(error)
    files = [
        rank_file(release, t, s.pp_rank, pipeline.pp, e, pipeline.ep)
        for s in pipeline.stages
        for t in range(pipeline.tp)
        for e in range(pipeline.ep)
    ]
    missing = [str(path) for path in files if not path.is_file()]
    return f"rank files are missing: {missing}" if missing else None


def check_checkpoint(reader: HfReader, model: ModelConfig, bounds: list[Bound]) -> None:
    """Layer counts, then missing, unexpected and misshapen tensors, each reported with its file."""
    _check_layer_counts(reader, model)
    needed = {name for b in bounds for name in b.hf}
    missing = sorted(needed - reader.names)
    if missing:
        raise ConversionError(
            f"{reader.dir} lacks tensors that model.json needs (another model, or an "
            "incomplete checkpoint?):\n" + listing(missing)
        )
    unexpected = sorted(n for n in reader.names - needed if not (dropped_layer(model, n) or unused_tensor(model, n)))
    if unexpected:
        raise ConversionError(
            f"{reader.dir} holds tensors that model.json does not use (another model, or "
            "tied/untied embeddings or biases set differently?):\n"
            + listing([f"{n} (in {reader.file[n]})" for n in unexpected])
        )
    dims = model_dims(model)
    wrong = [
        f"{name} in {reader.file[name]}: shape {list(reader.shape[name])}, model.json gives "
        f"{list(hf_shape(b.entry, part, dims))}"
        for b in bounds
        for part, name in enumerate(b.hf)
        if reader.shape[name] != hf_shape(b.entry, part, dims)
    ]
    if wrong:
        raise ConversionError(
            f"tensors of {reader.dir} do not have the shapes model.json gives:\n" + listing(sorted(set(wrong)))
        )


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with a storage of exactly its own bytes, which is what torch.save writes.

    A row range of a memory-mapped HF tensor becomes such a tensor without a copy (a numpy array over the same
    memory, wrapped again), so its bytes go from the page cache to the output file once; a column range is
    strided and is copied."""
    if not tensor.is_contiguous():
        return tensor.contiguous()
    if tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return torch.from_numpy(tensor.view(torch.uint8).numpy()).view(tensor.dtype).view(tensor.shape)


def _check_layer_counts(reader: HfReader, model: ModelConfig) -> None:
    have = {"vit_layer": 0, "llm_layer": 0}
    for name in reader.names:
        found = hf_layer_index(model, name)
        if found:
            have[found[0]] = max(have[found[0]], found[1] + 1)
    want = {"vit_layer": model.image_encoder.vision_encoder.num_layers, "llm_layer": model.text_decoder.num_layers}
    problems = [
        Violation(
            LAYER_KEYS[scope],
            want[scope],
            f"the checkpoint {reader.dir} has only {have[scope]} (layers may be removed, never added)",
            f"use at most {have[scope]}",
        )
        for scope in want
        if want[scope] > have[scope]
    ]
    if problems:
        raise ConfigError(problems)


def write_release(
    reader: HfReader,
    model: ModelConfig,
    pipeline: Pipeline,
    plan: list[list[list[Bound]]],
    mm_dir: Path,
    zip_crc32: bool = False,
    record: dict[str, Any] | None = None,
) -> None:
    """Write every rank file (``plan``: per stage, per EP rank, its tensors) into a staging directory, rename it
    to ``release``, then write the latest file."""
    dims = model_dims(model)
    mm_dir.mkdir(parents=True, exist_ok=True)
    with staged_dir(mm_dir / RELEASE, before_swap=lambda: remove_latest_if(mm_dir, RELEASE)) as staging:
        for stage, ranks in zip(pipeline.stages, plan, strict=True):
            for ep_rank, bounds in enumerate(ranks):
                for tp_rank in range(pipeline.tp):
                    state = {}
                    for bound in bounds:
                        state[bound.mg] = _compact(shard_from_hf(bound, dims, tp_rank, pipeline.tp, reader.read, False))
                    reader.release()
                    path = rank_file(staging, tp_rank, stage.pp_rank, pipeline.pp, ep_rank, pipeline.ep)
                    save_model_state(path, state, zip_crc32)
                    del state
        if record is not None:
            (staging / SOURCE_RECORD).write_text(json.dumps(record, indent=1))
    write_latest(mm_dir, RELEASE)
