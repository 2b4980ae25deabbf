"""Pipeline parallelism of the Qwen-VL stage: which ViT blocks and LLM layers a stage holds, what travels between
stages, the ranks holding the word embeddings, and a stage output that megatron's schedule can run backward from.

The ViT fills stages 0..k, the LLM the stages from k (sharing stage k) or k + 1 on, no stage empty
(:func:`stage_layout`). When the word embeddings are not on stage 0, pass :func:`embedding_ranks` to megatron's
``initialize_model_parallel`` (its default assumes stage 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from mm_rl.config.schema import ModelConfig

Received = Literal["none", "vit", "image", "llm"]


@dataclass(frozen=True)
class StageLayout:
    """What one pipeline stage holds (global ViT block / LLM layer indices) and what it receives and sends.

    The ViT runs on stages ``0 .. last_vit`` (patch embedding on stage 0, merger on ``last_vit``), the LLM on
    ``first_llm .. pp_size - 1`` (word embeddings on ``first_llm``, final norm and output layer on the last
    stage), with ``first_llm`` equal to ``last_vit`` (a stage holds the end of the ViT and the start of the
    LLM) or ``last_vit + 1``.
    """

    pp_rank: int
    pp_size: int
    vit_layers: range
    llm_layers: range
    last_vit: int
    first_llm: int

    @property
    def has_vit(self) -> bool:
        return len(self.vit_layers) > 0

    @property
    def has_patch_embed(self) -> bool:
        return self.pp_rank == 0

    @property
    def has_merger(self) -> bool:
        return self.pp_rank == self.last_vit

    @property
    def has_llm(self) -> bool:
        return self.pp_rank >= self.first_llm

    @property
    def has_embedding(self) -> bool:
        return self.pp_rank == self.first_llm

    @property
    def has_output(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def received(self) -> Received:
        """What the previous stage sends: ViT hidden states [N_patches, 1, vit_hidden] (window order), image
        embeddings [N_tokens, 1, llm_hidden], or LLM hidden states [S, B, llm_hidden]."""
        if self.pp_rank == 0:
            return "none"
        if self.has_vit:
            return "vit"
        return "image" if self.has_embedding else "llm"


def _per_stage(layers: Sequence[int], total: int, pp_size: int, what: str) -> list[int]:
    """The per-stage layer counts for ``pp_size`` stages (one stage: everything), validated."""
    if pp_size == 1:
        return [total]
    if len(layers) != pp_size or min(layers) < 0 or sum(layers) != total:
        raise ValueError(
            f"{what}.pipeline_num_layers {list(layers)} must have {pp_size} entries >= 0 summing to {total}"
        )
    return list(layers)


def _split(model: ModelConfig, pp_size: int) -> tuple[list[int], list[int], int, int]:
    """Per-stage ViT and LLM counts, the last ViT stage and the first LLM stage; ValueError for a split the
    pipeline cannot run (a stage holding nothing, a gap, or LLM stages before the ViT ends)."""
    vision = model.image_encoder.vision_encoder
    vit = _per_stage(vision.pipeline_num_layers, vision.num_layers, pp_size, "image_encoder.vision_encoder")
    llm = _per_stage(model.text_decoder.pipeline_num_layers, model.text_decoder.num_layers, pp_size, "text_decoder")
    last_vit = max(i for i, n in enumerate(vit) if n)
    first_llm = min(i for i, n in enumerate(llm) if n)
    contiguous = all(vit[: last_vit + 1]) and all(llm[first_llm:])
    if not contiguous or first_llm not in (last_vit, last_vit + 1):
        raise ValueError(
            f"pipeline split vit {vit} / llm {llm}: the ViT must fill stages 0..k and the LLM the stages from k "
            f"or k + 1 on, with no stage left empty (e.g. vit {[sum(vit)] + [0] * (pp_size - 1)} / llm "
            f"[{max(llm[0], 1)}, ...])"
        )
    return vit, llm, last_vit, first_llm


def stage_layout(model: ModelConfig, pp_rank: int, pp_size: int) -> StageLayout:
    """The parts of stage ``pp_rank`` of ``pp_size`` from model.json's ``pipeline_num_layers``."""
    vit, llm, last_vit, first_llm = _split(model, pp_size)
    return StageLayout(
        pp_rank=pp_rank,
        pp_size=pp_size,
        vit_layers=range(sum(vit[:pp_rank]), sum(vit[: pp_rank + 1])),
        llm_layers=range(sum(llm[:pp_rank]), sum(llm[: pp_rank + 1])),
        last_vit=last_vit,
        first_llm=first_llm,
    )


def embedding_ranks(model: ModelConfig) -> Callable[..., list[int]]:
    """``get_embedding_ranks`` for megatron's ``initialize_model_parallel``: the stages holding the word
    embeddings and the output layer (megatron's default, first and last, is wrong when the ViT fills the
    first stages; tied embeddings are synchronised over this group)."""

    def ranks(pp_ranks: list[int], *_: Any) -> list[int]:
        first_llm = _split(model, len(pp_ranks))[3]
        return sorted({pp_ranks[first_llm], pp_ranks[-1]})

    return ranks


def keep_in_graph(output: Tensor, received: Tensor | None) -> Tensor:
    """``output``, made a valid pipeline stage output for backward.

    megatron's schedule runs backward from every stage's output and sends the gradient of the received
    tensor back; a frozen ViT (run without a graph), a micro-batch without images or an unused input would
    leave either without a graph and stall or break the pipeline. Adding ``0 * received.sum()`` gives the
    received tensor a (zero) gradient; a still graph-less output becomes a leaf that accepts one.
    """
    if not torch.is_grad_enabled():
        return output
    if received is not None and received.requires_grad:
        output = output + 0.0 * received.sum()
    if not output.requires_grad:
        output = output.detach().requires_grad_()
    return output
