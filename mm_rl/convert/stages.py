"""Which pipeline stage holds which part of a model, following MindSpeed-MM.

The ViT comes first, then the LLM, split by ``vit_pp_layers`` / ``llm_pp_layers`` (one entry per stage); a stage
may hold the end of the ViT and the start of the LLM. The patch embedding sits with the first ViT block, the
merger with the last ViT block, the word embeddings on the first stage holding LLM layers, the final norm and
the output layer on the last stage. With tied embeddings the output layer reuses the word embeddings; only when
they live on another stage does the last stage hold a copy (Megatron keeps it in sync through the embedding
group), as ``text_decoder.output_layer.weight``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from mm_rl.config.loader import ConfigError, Violation
from mm_rl.config.schema import ModelConfig, ParallelConfig

PARALLEL_KEY = "cfg.parallel_config"
MODEL_KEY = "model"
LAYER_SCOPES = ("vit_layer", "llm_layer")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: the global ViT / LLM layer indices it holds and its other parts (``holds``)."""

    pp_rank: int
    vit: range
    llm: range
    holds: frozenset[str]
    deepstack: tuple[int, ...] = ()  # global ViT blocks that hold a DeepStack merger (Qwen3-VL)

    def layers(self, scope: str) -> list[tuple[int, int]]:
        """(index on this stage, global index) of the layers of ``scope``; ``[(0, 0)]`` for a part it holds.

        Megatron numbers layers from 0 on every stage; HuggingFace numbers them globally."""
        if scope in LAYER_SCOPES:
            span = self.vit if scope == "vit_layer" else self.llm
            return list(enumerate(span))
        if scope == "deepstack":  # (block on this stage, the merger's place in deepstack_visual_indexes)
            return [(block - self.vit.start, k) for k, block in enumerate(self.deepstack) if block in self.vit]
        return [(0, 0)] if scope in self.holds else []


@dataclass(frozen=True)
class Pipeline:
    """The TP size, the stages and the EP size of one converted checkpoint."""

    tp: int
    stages: tuple[Stage, ...]
    ep: int = 1

    @property
    def pp(self) -> int:
        return len(self.stages)


def plan_pipeline(model: ModelConfig, parallel: ParallelConfig) -> Pipeline:
    """The stage layout for ``parallel``; a ConfigError lists every rule the split or the TP size breaks."""
    problems = [
        *_split_problems(model, parallel),
        *_tp_problems(model, parallel.tp_size),
        *_ep_problems(model, parallel.ep_size or 1),
    ]
    if problems:
        raise ConfigError(problems)
    tied = not model.text_decoder.untie_embeddings_and_output_weights
    vit, llm = list(parallel.vit_pp_layers), list(parallel.llm_pp_layers)
    first_vit = next(i for i, n in enumerate(vit) if n)
    last_vit = max(i for i, n in enumerate(vit) if n)
    first_llm = next(i for i, n in enumerate(llm) if n)
    last = len(llm) - 1
    stages = []
    for rank in range(len(llm)):
        holds = {
            name
            for name, at in (
                ("patch_embed", first_vit),
                ("merger", last_vit),
                ("embedding", first_llm),
                ("final_norm", last),
                ("output_layer", last),
            )
            if at == rank
        }
        if tied and rank == first_llm:
            holds.discard("output_layer")  # the output layer shares the embedding weight on the same stage
        stages.append(
            Stage(
                rank,
                range(sum(vit[:rank]), sum(vit[: rank + 1])),
                range(sum(llm[:rank]), sum(llm[: rank + 1])),
                frozenset(holds),
                tuple(model.image_encoder.vision_encoder.deepstack_visual_indexes),
            )
        )
    return Pipeline(parallel.tp_size, tuple(stages), parallel.ep_size or 1)


def _ep_problems(model: ModelConfig, ep: int) -> Iterator[Violation]:
    experts = model.text_decoder.num_moe_experts or 0
    if ep < 1 or (ep > 1 and experts % ep):
        yield Violation(
            f"{PARALLEL_KEY}.ep_size",
            ep,
            f"EP must divide {MODEL_KEY}.text_decoder.num_moe_experts "
            f"= {experts or None} (each EP rank holds as many experts)",
            "use 1 for a dense model"
            if not experts
            else f"use an EP among {[d for d in range(1, experts + 1) if experts % d == 0][:12]}",
        )


def _split_problems(model: ModelConfig, parallel: ParallelConfig) -> Iterator[Violation]:
    vit, llm = list(parallel.vit_pp_layers), list(parallel.llm_pp_layers)
    totals = {
        "vit_pp_layers": (
            vit,
            model.image_encoder.vision_encoder.num_layers,
            f"{MODEL_KEY}.image_encoder.vision_encoder.num_layers",
        ),
        "llm_pp_layers": (llm, model.text_decoder.num_layers, f"{MODEL_KEY}.text_decoder.num_layers"),
    }
    for name, (layers, total, total_key) in totals.items():
        key = f"{PARALLEL_KEY}.{name}"
        if total < 1:
            yield Violation(total_key, total, "must be at least 1", "keep at least one layer")
        elif not layers or min(layers) < 0 or sum(layers) != total:
            yield Violation(
                key,
                layers,
                f"entries must be >= 0 and sum to {total_key} = {total} (they sum to {sum(layers)})",
                f"give one entry per pipeline stage summing to {total}",
            )
    if len(vit) != len(llm):
        yield Violation(
            f"{PARALLEL_KEY}.vit_pp_layers",
            vit,
            f"has {len(vit)} entries but llm_pp_layers has {len(llm)}: both need one per pipeline stage",
            f"give {len(llm)} entries, e.g. {[sum(vit)] + [0] * (len(llm) - 1)}",
        )
    elif any(vit) and any(llm):
        first_llm = next(i for i, n in enumerate(llm) if n)
        if any(vit[first_llm + 1 :]):
            yield Violation(
                f"{PARALLEL_KEY}.vit_pp_layers",
                vit,
                f"the ViT must end by stage {first_llm}, the first holding LLM layers ({llm})",
                f"move the ViT blocks to earlier stages, e.g. {[sum(vit)] + [0] * (len(vit) - 1)}",
            )


def _tp_problems(model: ModelConfig, tp: int) -> Iterator[Violation]:
    key = f"{PARALLEL_KEY}.tp_size"
    if tp < 1:
        yield Violation(key, tp, "must be at least 1", "use 1 for no tensor parallelism")
        return
    text, vit = model.text_decoder, model.image_encoder.vision_encoder
    groups = text.num_query_groups if text.group_query_attention else text.num_attention_heads
    sizes: Sequence[tuple[str, int, str]] = (
        ("text_decoder.num_query_groups", groups, "each rank holds whole query groups of the interleaved qkv"),
        ("text_decoder.num_attention_heads", text.num_attention_heads, "attention heads split across ranks"),
        ("text_decoder.ffn_hidden_size", text.ffn_hidden_size, "the MLP splits across ranks"),
        ("text_decoder.vocab_size", text.vocab_size, "embeddings and output layer split on the vocab"),
        ("image_encoder.vision_encoder.num_attention_heads", vit.num_attention_heads, "ViT heads split"),
        ("image_encoder.vision_encoder.ffn_hidden_size", vit.ffn_hidden_size, "the ViT MLP splits"),
        (
            "image_encoder.vision_projector.ffn_hidden_size",
            model.image_encoder.vision_projector.ffn_hidden_size,
            "the merger MLP splits",
        ),
        *(
            (("text_decoder.moe_intermediate_size", text.moe_intermediate_size or 0, "each expert's MLP splits"),)
            if text.num_moe_experts
            else ()
        ),
    )
    for name, size, why in sizes:
        if size % tp:
            yield Violation(
                key,
                tp,
                f"TP must divide {MODEL_KEY}.{name} = {size} ({why})",
                f"use a TP among {[d for d in range(1, size + 1) if size % d == 0][:12]}",
            )
    if vit.num_query_groups != vit.num_attention_heads:
        yield Violation(
            f"{MODEL_KEY}.image_encoder.vision_encoder.num_query_groups",
            vit.num_query_groups,
            f"the ViT has full multi-head attention: must equal num_attention_heads = {vit.num_attention_heads}",
            f"set it to {vit.num_attention_heads}",
        )
