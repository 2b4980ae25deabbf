"""The model-family seam: one :class:`ModelFamily` object per family holds every fact that the trainer, the
converter, the weight sync, the rollout and ``config`` need about it. They ask the family named by model.json's
``model_id`` (:func:`family`) or by an HF config.json's ``model_type`` (:func:`family_for_hf`); none of them
names a family. Adding a family means one package under ``mm_rl/models/`` and one line in :data:`_PACKAGES`.

A family's tensor mapping is a tuple of :class:`Entry` (one per Megatron tensor; ``mm_rl.convert.mapping``
turns it into hf2mg / mg2hf / weight-sync pieces). Its megatron model lives in a module named by
``ModelFamily.megatron``, imported only by the processes that build a model (megatron-core is heavy).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from mm_rl.config.schema import ModelConfig

# deepstack: a DeepStack merger, held by its ViT block (``{i}``: the block on its stage, HF: its place in the list)
Scope = Literal["patch_embed", "vit_layer", "merger", "deepstack", "embedding", "llm_layer", "final_norm",
                "output_layer"]
Layout = Literal["plain", "glu", "qkv", "fused_qkv"]
Shape = tuple[str, ...]
SCOPES: tuple[Scope, ...] = ("patch_embed", "vit_layer", "merger", "deepstack", "embedding", "llm_layer",
                             "final_norm", "output_layer")

# The special tokens of Qwen's vision-language tokenizers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL share them).
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


@dataclass(frozen=True)
class Entry:
    """One Megatron tensor and the HF tensors it is made of (see ``mm_rl.convert.mapping``)."""

    scope: Scope
    mg: str
    hf: tuple[str, ...]
    shapes: tuple[Shape, ...]  # per HF part, in the dimension names of the family's ``model_dims``
    layout: Layout = "plain"
    split: int | None = None  # the TP split dimension of the Megatron tensor; None = replicated
    heads: tuple[str, str, str] = ("", "", "")  # qkv layouts: dimension names of (heads, groups, head_dim)
    when: str | None = None  # a ``model_flags`` key: the tensor exists only when that flag is true
    duplicate: bool = False  # a Megatron-only copy of another entry's HF tensor (tied output layer)
    expert: bool = False  # one per routed expert (``{e}``: local to the EP rank in ``mg``, global in ``hf``)


@dataclass(frozen=True)
class Fused:
    """A stored HF tensor [experts, in, k * out] holding, per expert, k tensors [out, in] transposed and side by
    side: Qwen3-VL-MoE's published ``experts.gate_up_proj`` ([E, H, 2F]: gate then up) and ``experts.down_proj``
    ([E, F, H]). The tensor table names the per-expert ``parts`` (``{i}`` layer, ``{e}`` expert), which is also
    how vLLM takes them; the reader serves the parts from the stored tensor and mg2hf writes it back whole."""

    stored: str
    parts: tuple[str, ...]


@cache
def name_pattern(template: str) -> re.Pattern[str]:
    """A table name (``{i}``: a layer, ``{e}``: an expert) as a regular expression for whole names (``match``),
    the layer and expert as groups ``i`` and ``e``."""
    escaped = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile(escaped + "$")


# A model rule's finding: (model.json key below ``model``, value, rule, fix).
ModelFinding = tuple[str, Any, str, str]


@dataclass(frozen=True)
class ModelFamily:
    """Everything mm_rl knows about one model family.

    Fields:
        name: the family's package under ``mm_rl/models/`` and its ``config`` preset prefix.
        label: the published name, for messages.
        model_id: model.json's ``model_id`` (MindSpeed-MM's name).
        hf_model_types: config.json ``model_type`` values of its HF checkpoints.
        hf_architecture: the transformers (and vLLM) class its checkpoints name in ``architectures``.
        tensors: the tensor mapping (hf2mg, mg2hf, weight sync).
        model_dims / model_flags: model.json -> the dimension names / ``Entry.when`` switches of ``tensors``.
        model_json: HF config.json content -> model.json content (everything on one pipeline stage).
        megatron: module providing ``build_model(model, flags, actor, ...)`` and ``embedding_ranks(model)``.
        tiny: module providing the tiny builder's ``hf_config(text, vision, ids, tied)``, its default text and
            vision fields (``TEXT_CONFIG``, ``VISION_CONFIG``) and ``PROCESSOR_CLASS``; None: no tiny model.
        rules: extra model.json rules of this family (findings); the shared ones are in ``job.validate``.
        hf_aliases: other spellings of HF tensor names (prefix, published prefix), mapped when reading.
        hf_fused: stored tensors that hold several of the table's HF tensors (fused experts).
        vision_tokens: special tokens a response may not contain (the trainer cuts a response before one).
    """

    name: str
    label: str
    model_id: str
    hf_model_types: tuple[str, ...]
    hf_architecture: str
    tensors: tuple[Entry, ...]
    model_dims: Callable[[ModelConfig], dict[str, int]]
    model_flags: Callable[[ModelConfig], dict[str, bool]]
    model_json: Callable[[Mapping[str, Any]], dict[str, Any]]
    megatron: str
    tiny: str | None = None
    rules: Callable[[ModelConfig], Iterator[ModelFinding]] | None = None
    hf_aliases: tuple[tuple[str, str], ...] = ()
    hf_fused: tuple[Fused, ...] = ()
    vision_tokens: tuple[str, ...] = QWEN_VISION_TOKENS

    def megatron_module(self) -> ModuleType:
        """The module that builds this family's megatron model (imports megatron-core)."""
        return importlib.import_module(self.megatron)

    def tiny_module(self) -> ModuleType:
        if self.tiny is None:
            raise UnknownFamily(f"{self.label} has no tiny model")
        return importlib.import_module(self.tiny)

    def findings(self, model: ModelConfig) -> list[ModelFinding]:
        return list(self.rules(model)) if self.rules is not None else []


def hf_token_types(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """transformers' ``mm_token_type_ids`` of the Qwen VL families (1 on image tokens, 0 elsewhere).

    transformers 5 computes the 3D positions only from these types: a forward or ``generate`` call without them
    gives every token a 1D text position, a different model input from the one vLLM and the actor see (measured
    on the tiny model: log-prob gaps of up to 12 nats on the same tokens). Pass them on every call."""
    return (input_ids == image_token_id).int()


class UnknownFamily(ValueError):
    """A model_id or HF model_type no family claims (its message lists the known ones)."""


class HfConfigError(ValueError):
    """An HF config.json its family cannot read (a missing field)."""


# Packages whose ``family`` module defines ``FAMILY``.
_PACKAGES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")


@cache
def families() -> tuple[ModelFamily, ...]:
    return tuple(importlib.import_module(f"mm_rl.models.{package}.family").FAMILY for package in _PACKAGES)


def family(model_id: str) -> ModelFamily:
    """The family whose model.json ``model_id`` is ``model_id``."""
    for candidate in families():
        if candidate.model_id == model_id:
            return candidate
    known = ", ".join(f"{f.model_id} ({f.label})" for f in families())
    raise UnknownFamily(f"model_id {model_id!r} is not a model family mm_rl knows; known: {known}")


def family_of(model: ModelConfig) -> ModelFamily:
    return family(model.model_id)


def family_for_hf(config: Mapping[str, Any]) -> ModelFamily:
    """The family of an HF checkpoint from its config.json content (``model_type``, else ``architectures``)."""
    model_type = config.get("model_type")
    architectures = list(config.get("architectures") or ())
    for candidate in families():
        if model_type in candidate.hf_model_types or candidate.hf_architecture in architectures:
            return candidate
    known = ", ".join(f"{t} ({f.label})" for f in families() for t in f.hf_model_types)
    raise UnknownFamily(f"config.json has model_type {model_type!r} (architectures {architectures}): not a model "
                        f"family mm_rl knows; known model_type values: {known}")
