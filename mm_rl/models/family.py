"""The model-family seam: one :class:`ModelFamily` object per family holds every fact that the trainer, the
converter, the weight sync, the rollout and ``config`` need about it. They ask ``mm_rl.models.registry`` for the
family named by model.json's ``model_id`` or by an HF config.json's ``model_type``; none of them names a family.
Adding a family means one package under ``mm_rl/models/`` and one entry in the registry.

A family's tensor mapping is a tuple of :class:`Entry` (one per Megatron tensor; ``mm_rl.convert.mapping``
turns it into hf2mg / mg2hf / weight-sync pieces). Its megatron model is a stage module returned by
``ModelFamily.stage`` (imported only by the processes that build a model: megatron-core is heavy), with the LLM
layers the family's ``decoder_layer`` chooses.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from mm_rl.config.schema import ActorConfig, ModelConfig, TextDecoderConfig, TrainingFlags

# deepstack: a DeepStack merger, held by its ViT block (``{i}``: the block on its stage, HF: its place in the list)
Scope = Literal[
    "patch_embed", "vit_layer", "merger", "deepstack", "embedding", "llm_layer", "final_norm", "output_layer"
]
Layout = Literal["plain", "glu", "qkv", "fused_qkv", "gated_qkv", "sections"]
Shape = tuple[str, ...]
SCOPES: tuple[Scope, ...] = (
    "patch_embed",
    "vit_layer",
    "merger",
    "deepstack",
    "embedding",
    "llm_layer",
    "final_norm",
    "output_layer",
)

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
    layer: str | None = None  # an LLM layer kind (``text_decoder.layer_types``) it exists in; None: every layer
    sections: tuple[tuple[str, ...], ...] = ()  # "sections" layout: per HF part, its blocks along the split dim


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

# (model.json's text decoder, the layer's global index, Ulysses context parallelism on) -> the megatron-core
# ``ModuleSpec`` of that LLM layer: the seam where a family chooses its layers (a hybrid decoder per index).
DecoderLayer = Callable[["TextDecoderConfig", int, bool], Any]


class MegatronStage(Protocol):
    """A module building one pipeline stage of a family's model on megatron-core (``mm_rl.models.qwen_vl.model``)."""

    def build_model(
        self,
        model_cfg: ModelConfig,
        flags: TrainingFlags | None = None,
        actor: ActorConfig | None = None,
        *,
        decoder_layer: DecoderLayer,
        params_dtype: torch.dtype = ...,
        remove_padding: bool = True,
        **config_overrides: Any,
    ) -> torch.nn.Module: ...

    def embedding_ranks(self, model: ModelConfig) -> Callable[..., list[int]]: ...


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
        hf_config: (a checkpoint's config.json, the job's model.json) -> the config.json of the job's model.
        stage: returns the module that builds a pipeline stage (imports megatron-core when called).
        decoder_layer: the megatron-core spec of each LLM layer (see :data:`DecoderLayer`).
        tiny: module providing the tiny builder's ``hf_config(text, vision, ids, tied)``, its default text and
            vision fields (``TEXT_CONFIG``, ``VISION_CONFIG``) and ``PROCESSOR_CLASS``; None: no tiny model.
        rules: extra model.json rules of this family (findings); the shared ones are in ``job.validate``.
        hf_aliases: other spellings of HF tensor names (prefix, published prefix), mapped when reading.
        hf_fused: stored tensors that hold several of the table's HF tensors (fused experts).
        vision_tokens: special tokens a response may not contain (the trainer cuts a response before one).
        cpu_engine_dtype: the engine's precision on CPU where ``generate_config.dtype`` is auto.
        hf_unused: prefixes of checkpoint tensors the RL model does not hold (hf2mg leaves them out, mg2hf
            writes the model without them).
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
    hf_config: Callable[[Mapping[str, Any], ModelConfig], dict[str, Any]]
    stage: Callable[[], MegatronStage]
    decoder_layer: DecoderLayer
    tiny: ModuleType | None = None
    rules: Callable[[ModelConfig], Iterator[ModelFinding]] | None = None
    hf_aliases: tuple[tuple[str, str], ...] = ()
    hf_fused: tuple[Fused, ...] = ()
    vision_tokens: tuple[str, ...] = QWEN_VISION_TOKENS
    hf_unused: tuple[str, ...] = ()
    cpu_engine_dtype: str = "float32"

    def build_model(
        self, model: ModelConfig, flags: TrainingFlags | None = None, actor: ActorConfig | None = None, **options: Any
    ) -> torch.nn.Module:
        """This rank's pipeline stage of the model, after megatron's ``initialize_model_parallel`` (imports
        megatron-core); ``options`` as the stage module's ``build_model`` takes them. With ``actor.lora`` on, the
        stage is frozen and its target linears get adapters (``mm_rl.models.lora``)."""
        stage = self.stage().build_model(model, flags, actor, decoder_layer=self.decoder_layer, **options)
        if actor is not None and actor.lora.enabled:
            from mm_rl.models.lora import add_adapters

            add_adapters(stage, actor.lora, seed=int(flags.seed) if flags is not None else 0)
        return stage

    def embedding_ranks(self, model: ModelConfig) -> Callable[..., list[int]]:
        """``get_embedding_ranks`` for megatron's ``initialize_model_parallel`` (imports megatron-core)."""
        return self.stage().embedding_ranks(model)

    def tiny_module(self) -> ModuleType:
        if self.tiny is None:
            raise UnknownFamily(f"{self.label} has no tiny model")
        return self.tiny

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
