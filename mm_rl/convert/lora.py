"""LoRA adapters in the converter's terms: each adapter matrix's TP mapping, and the PEFT adapter directory.

An adapter matrix follows its base weight's entry in the family's tensor table (see ``mm_rl.models.lora`` for
the splits): the half split over TP (B of a column-parallel base, A of a row-parallel one) is the base entry with
its other dimension replaced by the adapter rank (``lora_rank``), so the table's own rules place its rows (fused
q / k / v and gate / up, Gated DeltaNet sections, TP pieces); the other half is whole on every rank. An HF model
has one linear per table part (q_proj, k_proj, v_proj of a fused ``linear_qkv``): each part gets the fused
adapter's whole half (the same A for q, k and v) and its own rows of the split half, which is the same model.

The PEFT directory (``adapter_config.json``, ``adapter_model.safetensors``) holds PEFT's names
(``base_model.model.<HF module>.lora_A.weight`` [r, in], ``lora_B.weight`` [out, r]) and the exact module list
as PEFT's ``target_modules`` pattern, so PEFT puts adapters on those linears only (the ViT has gate / up / down
projections too).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from mm_rl.config.schema import ModelConfig
from mm_rl.convert.errors import ConversionError
from mm_rl.convert.layout import load_rank_data, rank_file
from mm_rl.convert.mapping import Bound, hf_from_shards, model_dims, module_name, shard_from_hf, stage_tensors
from mm_rl.convert.stages import Pipeline
from mm_rl.models.lora import LORA_A, LORA_B

LORA_RANK = "lora_rank"
ADAPTER_DIR = "lora_adapter"  # inside the merged HF checkpoint's directory
PEFT_PREFIX = "base_model.model."


def adapter_entry(bound: Bound) -> Bound:
    """The TP-split adapter matrix of ``bound``'s linear as a bound of its own: B [out, r] of a column-parallel
    base (split 0), A [r, in] of a row-parallel one (split 1)."""
    entry = bound.entry
    if entry.split == 0:
        shapes = tuple((shape[0], LORA_RANK) for shape in entry.shapes)
    elif entry.split == 1:
        shapes = tuple((LORA_RANK, shape[1]) for shape in entry.shapes)
    else:
        raise ConversionError(f"{bound.mg}: an adapter needs a TP-split linear")
    return Bound(dataclasses.replace(entry, shapes=shapes), bound.mg, bound.hf)


def hf_adapters(
    bound: Bound, dims: Mapping[str, int], a_shards: Sequence[torch.Tensor], b_shards: Sequence[torch.Tensor]
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Per HF part of ``bound`` (a linear's weight): (its HF weight name, A [r, in], B [out, r]) from the TP
    ranks' adapter shards (rank order)."""
    dims = {**dims, LORA_RANK: a_shards[0].shape[0]}
    split = adapter_entry(bound)
    if bound.entry.split == 0:
        parts_b = hf_from_shards(split, dims, b_shards)
        parts_a = [a_shards[0]] * len(parts_b)
    else:
        parts_a = hf_from_shards(split, dims, a_shards)
        parts_b = [b_shards[0]] * len(parts_a)
    return list(zip(bound.hf, parts_a, parts_b, strict=True))


def shard_adapters(
    bound: Bound, dims: Mapping[str, int], rank: int, tp: int, hf: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse: TP rank ``rank``'s (A, B) of ``bound``'s linear from each HF part's (A, B) (``hf``: HF weight
    name -> pair); the parts of a fused linear must share the whole half."""
    first_a, first_b = hf[bound.hf[0]]
    whole = first_a if bound.entry.split == 0 else first_b
    if any(not torch.equal(hf[name][0 if bound.entry.split == 0 else 1], whole) for name in bound.hf):
        raise ConversionError(f"{bound.mg}: its HF parts {list(bound.hf)} need one shared adapter half")
    dims = {**dims, LORA_RANK: first_a.shape[0]}

    def read(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return hf[name][1 if bound.entry.split == 0 else 0].narrow(dim, start, stop - start)

    split = shard_from_hf(adapter_entry(bound), dims, rank, tp, read)
    return (whole, split) if bound.entry.split == 0 else (split, whole)


def peft_name(hf_weight: str, matrix: str) -> str:
    """PEFT's key of an adapter matrix (``lora_A`` / ``lora_B``) of the linear whose weight is ``hf_weight``."""
    return f"{PEFT_PREFIX}{hf_weight.removesuffix('.weight')}.{matrix}.weight"


def target_pattern(modules: Sequence[str]) -> str:
    """PEFT's ``target_modules`` as a pattern that full-matches exactly these HF module names (layer numbers as
    ``\\d+``)."""
    shapes = sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(m)) for m in modules})
    return "^(" + "|".join(shapes) + ")$"


def write_peft_adapter(
    iteration_dir: Path, model: ModelConfig, pipeline: Pipeline, lora: Mapping[str, Any], out: Path, base: str
) -> Path | None:
    """The PEFT adapter directory of a LoRA checkpoint's iteration (``lora``: its rank files' metadata) at
    ``out``; None (nothing written) when experts carry adapters (transformers keeps a layer's experts in one
    fused tensor, which PEFT's linear adapters do not reach): the merged checkpoint holds them."""
    from safetensors.torch import save_file

    dims, tensors, modules = model_dims(model), {}, []
    for stage in pipeline.stages:
        for ep_rank in range(pipeline.ep):
            states = [
                load_rank_data(rank_file(iteration_dir, r, stage.pp_rank, pipeline.pp, ep_rank, pipeline.ep))["model"]
                for r in range(pipeline.tp)
            ]
            for bound in stage_tensors(model, stage, ep_rank, pipeline.ep):
                key = bound.mg.removesuffix(".weight")
                if f"{key}.{LORA_A}" not in states[0] or bound.entry.duplicate:
                    continue
                if bound.entry.expert:
                    return None
                a_shards = [s[f"{key}.{LORA_A}"] for s in states]
                b_shards = [s[f"{key}.{LORA_B}"] for s in states]
                for name, a, b in hf_adapters(bound, dims, a_shards, b_shards):
                    name = module_name(model, name)
                    tensors[peft_name(name, "lora_A")] = a.clone()  # a fused linear's parts share one half
                    tensors[peft_name(name, "lora_B")] = b.clone()
                    modules.append(name.removesuffix(".weight"))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": int(lora["rank"]),
        "lora_alpha": float(lora["alpha"]),
        "lora_dropout": 0.0,
        "target_modules": target_pattern(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
