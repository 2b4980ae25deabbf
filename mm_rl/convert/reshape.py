"""The job's LLM cut from a larger checkpoint: the tensor changes model.json may ask of the checkpoint it starts from.

model.json may make the LLM narrower than its checkpoint (hidden size, MLP width, attention heads: the parameter
reference's "smaller hidden size, weights sliced") and regroup its key/value heads (another ``num_query_groups``,
or GQA off). The family's tensor table names every dimension of every HF tensor (``Entry.shapes``), so one rule
per dimension name serves every tensor, in hf2mg (``HfReader``) and in the engine's start checkpoint
(``hf_writer.job_model_dir``) alike:

- a smaller ``h`` / ``ph`` (the LLM's width, the projector's output), ``ffn`` or ``q`` keeps the leading part:
  the first channels, the first MLP units, the first query heads (``q`` is head-major, heads keep their size);
- ``kv`` (key/value heads) is regrouped: query head ``h`` used the checkpoint's group ``h // (heads / groups)``;
  each new group gets the mean of the checkpoint groups its query heads used. Where every query head of a new
  group used one checkpoint group (more groups, GQA off, or heads cut along group lines) that is a copy and the
  attention is unchanged; fewer groups average, as GQA's uptraining does.

Any other dimension must match the checkpoint (``check`` says which sizes may change, hf2mg reports a shape that
does not fit).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from mm_rl.config.schema import ModelConfig, ParallelConfig

SLICED = frozenset({"h", "ph", "ffn", "q"})  # the leading part is kept
REGROUPED = "kv"


@dataclass(frozen=True)
class Reshape:
    """Checkpoint dimensions ``have`` to the job's ``want``, for the HF tensors whose dimension names ``names``
    gives (published name -> one name per axis)."""

    have: Mapping[str, int]
    want: Mapping[str, int]
    names: Mapping[str, tuple[str, ...]]

    def changes(self, name: str) -> bool:
        """Whether HF tensor ``name`` is not taken as stored."""
        axes = self.names.get(name, ())
        return any(a in SLICED and self.have[a] != self.want[a] for a in axes) or (
            REGROUPED in axes and not kv_unchanged(self.have, self.want)
        )

    def shape(self, name: str, stored: tuple[int, ...]) -> tuple[int, ...]:
        """The job's shape of ``name`` (stored as ``stored``)."""
        axes = self.names.get(name)
        if axes is None or len(axes) != len(stored):
            return stored
        return tuple(
            self.want[a] if a in SLICED or a == REGROUPED else size for a, size in zip(axes, stored, strict=True)
        )

    def tensor(self, name: str, stored: torch.Tensor) -> torch.Tensor:
        """``stored`` cut and regrouped to the job's model (a new tensor; ``stored`` untouched)."""
        out = stored
        for axis, a in enumerate(self.names.get(name, ())):
            if a in SLICED and self.have[a] != self.want[a]:
                out = out.narrow(axis, 0, self.want[a])
            elif a == REGROUPED and not kv_unchanged(self.have, self.want):
                out = regroup_kv(out, axis, self.have, self.want)
        return out.contiguous() if out is not stored else stored


def kv_sources(have: Mapping[str, int], want: Mapping[str, int]) -> list[Counter[int]]:
    """Per new key/value group, the checkpoint groups its query heads used (group -> number of heads)."""
    per_old, per_new = have["heads"] // have["groups"], want["heads"] // want["groups"]
    return [Counter(h // per_old for h in range(j * per_new, (j + 1) * per_new)) for j in range(want["groups"])]


def kv_unchanged(have: Mapping[str, int], want: Mapping[str, int]) -> bool:
    sources = kv_sources(have, want)
    return len(sources) == have["groups"] and all(list(s) == [j] for j, s in enumerate(sources))


def regroup_kv(tensor: torch.Tensor, axis: int, have: Mapping[str, int], want: Mapping[str, int]) -> torch.Tensor:
    """``tensor``'s ``axis`` of ``groups x hd`` key/value rows regrouped (see the module): a group that takes one
    checkpoint group is an exact copy, otherwise the head-weighted mean in fp32."""
    groups = tensor.movedim(axis, 0).unflatten(0, (have["groups"], have["hd"]))
    parts = []
    for sources in kv_sources(have, want):
        if len(sources) == 1:
            parts.append(groups[next(iter(sources))])
            continue
        total = sum(sources.values())
        mean = sum(groups[g].float() * (n / total) for g, n in sorted(sources.items()))
        parts.append(mean.to(tensor.dtype))
    return torch.stack(parts).flatten(0, 1).movedim(0, axis)


def plan_reshape(hf_dir: str | Path, model: ModelConfig) -> Reshape | None:
    """What turns the checkpoint in ``hf_dir`` into the job's ``model`` (None when nothing: the usual case)."""
    from mm_rl.convert.mapping import model_family, stage_tensors
    from mm_rl.convert.model_config import model_config_from_hf
    from mm_rl.convert.stages import plan_pipeline

    if not (Path(hf_dir) / "config.json").is_file():
        return None  # nothing to cut from: the reader reports what the directory lacks
    family = model_family(model)
    have, want = family.model_dims(model_config_from_hf(hf_dir)), family.model_dims(model)
    if have["hd"] != want["hd"]:
        return None  # heads keep their size: ``check`` refuses another one, hf2mg reports the shapes
    if all(have[a] == want[a] for a in SLICED) and kv_unchanged(have, want):
        return None
    whole = ParallelConfig(
        tp_size=1,
        ep_size=1,
        llm_pp_layers=[model.text_decoder.num_layers],
        vit_pp_layers=[model.image_encoder.vision_encoder.num_layers],
    )
    stage = plan_pipeline(model, whole).stages[0]
    names = {hf: b.entry.shapes[part] for b in stage_tensors(model, stage) for part, hf in enumerate(b.hf)}
    return Reshape(have, want, names)
