"""Qwen2.5-VL on megatron-core matches transformers: logits, log-probs, entropy (fp32, tiny checkpoint).

The tiny HF checkpoint (biases and norm weights randomised so their layouts matter) goes through hf2mg at
each parallel layout; every rank loads its own MindSpeed-MM rank file. Two right-padded micro-batches of 2
(one image + text beside two images of different sizes + text; then text only), then a left-padded one
with images, run through megatron's
forward-backward schedule. Checked on the last stage: logits vs transformers' (<= 1e-4), log-probs of the
labels and entropy vs the same computed from transformers' logits (<= 1e-4); then every parameter gradient
of a log-prob + entropy loss, gathered over TP and renamed to TP1 names, vs the TP1 run (<= 1e-5).
Layouts: TP1, TP2, PP2 (vit [2, 0] / llm [1, 3], ViT and LLM sharing stage 0, tied embeddings), TP2 x PP2.
The model packs each micro-batch's rows by default (``remove_padding``); at TP1, TP2, PP2 and CP2 the padded path
runs too: log-probs and entropy on real tokens and every gradient (relative, in norm) within 1e-5 of the packed.
With an output mask (a wanted span at the end of each row, as the response tokens are) only those positions reach
the output layer: at TP1 (packed and padded), TP2 (sequence parallelism: each rank's share of the rows), PP2, CP2
and TP2 x CP2 their log-probs and entropy match the full output's, every other position is 0, and the gradients of
a loss over the wanted positions match the full run's (relative, in norm) within 1e-5.
The TP1 run also checks the freeze switches and model.json switches (activation, norm, GQA off, rope theta,
mRoPE sections, fewer layers), and an LLM cut narrower than its checkpoint by hf2mg (hidden size, heads, KV groups,
MLP width) against transformers running the same cut (``job_model_dir``, the engine's start checkpoint), and the
model in bf16 (every parameter, the norms too) against fp32 (log-probs within 5e-3 mean, 2e-2 max).
Each layout is launched once and checks everything inside it.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mp_utils import (
    gather_cat,
    gather_list,
    init_megatron,
    load_rank_results,
    save_rank_result,
    shutdown,
    spawn,
)

ROOT = Path(__file__).resolve().parents[1]
TINY_JSON = ROOT / "configs" / "models" / "tiny.json"
IMAGE, VIDEO, VSTART, VEND, PAD = 1006, 1007, 1003, 1004, 1000
PATCH_DIM = 3 * 2 * 14 * 14
GRIDS = [(1, 4, 4), (1, 4, 12), (1, 6, 4)]  # sample 0: image 0; sample 1: images 1 and 2 (2 windows in image 1)
# videos (t frame pairs of h x w patches) and their mRoPE time steps (fractions: vLLM truncates t x step; 0.75 repeats
# a time id): sample 0 an image then a video, sample 1 two videos (the second 2 windows wide). Rows stay under ~60
# tokens: Qwen3.5's fp32 error grows with the row (85 tokens: logits 1.04e-4 of ~15, 7e-6 relative)
VIDEOS = [((2, 4, 6), 2.25), ((2, 6, 4), 1.5), ((2, 4, 8), 0.75)]
LOGIT_TOL, GRAD_TOL = 1e-4, 1e-5
# bf16 (8-bit mantissa, ~4e-3 relative per rounding) against fp32, on log-probs of about -7: measured 1.2e-3 / 3.6e-3
BF16_MEAN_TOL, BF16_MAX_TOL = 5e-3, 2e-2
ENTROPY_COEF = 0.1
# gelu, rope theta 1e4, mRoPE sections [2, 6, 8], no GQA (4 KV heads), 2 layers
VARIANT_HF = {
    "hidden_act": "gelu",
    "rope_theta": 1e4,
    "mrope_section": [2, 6, 8],
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
}
VARIANT_JSON = {
    "activation_func": "gelu",
    "rope_theta": 1e4,
    "mrope_section": [2, 6, 8],
    "group_query_attention": False,
    "num_query_groups": 4,
    "num_layers": 2,
    "pipeline_num_layers": [2],
}
# the LLM cut narrower than its checkpoint (hf2mg converts the full checkpoint; transformers loads the engine's
# start checkpoint, ``job_model_dir``): 3 of 4 heads, one KV group of the 2 (a mean), a narrower MLP, 3 layers
NARROW_JSON = {
    "hidden_size": 96,
    "num_attention_heads": 3,
    "num_query_groups": 1,
    "ffn_hidden_size": 192,
    "num_layers": 3,
    "pipeline_num_layers": [3],
}


# ------------------------------------------------------------------------------ model.json and weights
def model_json(
    *,
    tied: bool = False,
    llm_pp: list[int] | None = None,
    vit_pp: list[int] | None = None,
    text: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """configs/models/tiny.json with a pipeline split, tied embeddings or other text-decoder fields."""
    data = json.loads(TINY_JSON.read_text())
    decoder = data["text_decoder"]
    decoder.update(text or {})
    decoder["untie_embeddings_and_output_weights"] = not tied
    if llm_pp:
        decoder["pipeline_num_layers"] = llm_pp
    if vit_pp:
        data["image_encoder"]["vision_encoder"]["pipeline_num_layers"] = vit_pp
    return data


def load_model_config(data: dict[str, Any]) -> Any:
    from mm_rl.config.loader import load_section
    from mm_rl.config.schema import ModelConfig

    return load_section(ModelConfig, copy.deepcopy(data))


def build_hf_checkpoint(directory: Path, tied: bool, **overrides: Any) -> Path:
    """The tiny checkpoint with biases and norm weights redrawn (the builder makes them 0 and 1)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mm_rl.demo.tiny import build_tiny_checkpoint

    source = build_tiny_checkpoint(directory / "source", seed=0, tie_word_embeddings=tied, **overrides)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() == 1:
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(0.2 * noise if name.endswith(".bias") else 1.0 + 0.2 * noise)
    target = directory / "hf"
    model.save_pretrained(target)
    return target


def convert(hf_dir: Path, mm_dir: Path, data: dict[str, Any], tp: int, ep: int = 1) -> Path:
    from mm_rl.config.schema import Hf2MgCfg, HfConfig, ParallelConfig
    from mm_rl.convert.hf2mg import hf2mg

    model = load_model_config(data)
    parallel = ParallelConfig(
        tp_size=tp,
        ep_size=ep,
        llm_pp_layers=list(model.text_decoder.pipeline_num_layers),
        vit_pp_layers=list(model.image_encoder.vision_encoder.pipeline_num_layers),
    )
    return hf2mg(Hf2MgCfg(mm_dir=str(mm_dir), hf_config=HfConfig(hf_dir=str(hf_dir)), parallel_config=parallel), model)


# ------------------------------------------------------------------------------------------- inputs
def _text(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=generator).tolist()


def _image(grid: tuple[int, int, int], token: int = IMAGE) -> list[int]:
    t, h, w = grid
    return [VSTART] + [token] * (t * h * w // 4) + [VEND]


def _padded(rows: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span] = torch.tensor(row)
        mask[i, span] = 1
    return ids, mask


def make_micro_batches(
    patch_dim: int = PATCH_DIM, frames_apart: bool = False, videos: bool = True
) -> list[dict[str, torch.Tensor]]:
    """Right-padded [one image + text, two images + text] and [text, shorter text], then a left-padded
    [image + text, text + image + text] (explicit padding mask), then (``videos``) right-padded videos
    (:func:`video_batch`); labels are the next tokens."""
    g = torch.Generator().manual_seed(3)
    with_images = [
        _text(g, 5) + _image(GRIDS[0]) + _text(g, 6),
        _text(g, 3) + _image(GRIDS[1]) + _text(g, 2) + _image(GRIDS[2]) + _text(g, 4),
    ]
    text_only = [_text(g, 20), _text(g, 13)]
    left_padded = [_image(GRIDS[2]) + _text(g, 3), _text(g, 9) + _image(GRIDS[0]) + _text(g, 4)]
    batches = []
    for rows, grids, left in (
        (with_images, GRIDS, False),
        (text_only, [], False),
        (left_padded, [GRIDS[2], GRIDS[0]], True),
    ):
        ids, mask = _padded(rows, left)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.roll(ids, -1, dims=1)}
        if grids:
            patches = sum(t * h * w for t, h, w in grids)
            batch["pixel_values"] = torch.randn(patches, patch_dim, generator=g)
            batch["image_grid_thw"] = torch.tensor(grids)
        batches.append(batch)
    return [*batches, video_batch(g, patch_dim, frames_apart)] if videos else batches


def video_batch(g: torch.Generator, patch_dim: int, frames_apart: bool = False) -> dict[str, torch.Tensor]:
    """[text, image, text, video, text] and [text, video, text, video, text]: the model's entries (images and
    videos in the order they appear), and transformers' own inputs apart (``hf_*``: images and videos separately).

    Qwen2-VL / Qwen2.5-VL (one entry per video with its ``mrope_time_steps``): transformers gets the positions of
    mm_rl's rule, which is vLLM's (see ``rope_index``). ``frames_apart`` (Qwen3-VL / Qwen3.5): each frame pair within
    its own vision markers after a timestamp's text, one entry per pair; transformers computes its own positions."""
    from mm_rl.models.qwen_vl.rope_index import get_rope_index

    def video(grid: tuple[int, int, int]) -> list[int]:
        if not frames_apart:
            return _image(grid, VIDEO)
        t, h, w = grid
        return [VSTART] + [tok for _ in range(t) for tok in _text(g, 2) + _image((1, h, w), VIDEO)] + [VEND]

    (v0, s0), (v1, s1), (v2, s2) = VIDEOS
    rows = [
        _text(g, 4) + _image(GRIDS[0]) + _text(g, 3) + video(v0) + _text(g, 5),
        _text(g, 2) + video(v1) + _text(g, 3) + video(v2) + _text(g, 2),
    ]
    ids, mask = _padded(rows, left=False)
    pixels = {grid: torch.randn(grid[0] * grid[1] * grid[2], patch_dim, generator=g) for grid in (GRIDS[0], v0, v1, v2)}
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": torch.roll(ids, -1, dims=1),
        "pixel_values": torch.cat([pixels[e] for e in (GRIDS[0], v0, v1, v2)]),
        "hf_pixel_values": pixels[GRIDS[0]],
        "hf_image_grid_thw": torch.tensor([GRIDS[0]]),
        "hf_pixel_values_videos": torch.cat([pixels[v] for v in (v0, v1, v2)]),
        "hf_video_grid_thw": torch.tensor([v0, v1, v2]),
    }
    if frames_apart:
        pairs = [(1, h, w) for t, h, w in (v0, v1, v2) for _ in range(t)]
        return batch | {"image_grid_thw": torch.tensor([GRIDS[0], *pairs])}
    steps = torch.tensor([1.0, s0, s1, s2], dtype=torch.float64)
    grid = torch.tensor([GRIDS[0], v0, v1, v2])
    positions, _ = get_rope_index(
        ids, grid, mask, image_token_id=IMAGE, video_token_id=VIDEO, time_steps=steps, spatial_merge_size=2
    )
    return batch | {"image_grid_thw": grid, "mrope_time_steps": steps, "hf_position_ids": positions}


# megatron name -> transformers' in-memory parameter name, for tensors laid out alike (gradient spot checks)
_LM = "model.language_model."
HF_GRAD_NAMES = {
    "text_decoder.output_layer.weight": "lm_head.weight",
    "text_decoder.embedding.word_embeddings.weight": _LM + "embed_tokens.weight",
    "text_decoder.decoder.layers.3.self_attention.linear_proj.weight": _LM + "layers.3.self_attn.o_proj.weight",
    "text_decoder.decoder.layers.0.mlp.linear_fc2.weight": _LM + "layers.0.mlp.down_proj.weight",
    "image_encoder.projector.encoder.linear_fc2.weight": "model.visual.merger.mlp.2.weight",
    "image_encoder.encoder.blocks.layers.1.self_attention.linear_proj.weight": "model.visual.blocks.1.attn.proj.weight",
    "image_encoder.encoder.patch_embed.proj.weight": "model.visual.patch_embed.proj.weight",
}


def _hf_grad(params: dict[str, torch.nn.Parameter], name: str) -> torch.Tensor:
    """The gradient of transformers' parameter ``name``; ``name#e``: expert e's slice of a fused experts tensor
    (in memory [E, 2F, H] / [E, H, F], each slice an expert's megatron linear_fc1 / linear_fc2 as it is)."""
    base, _, expert = name.partition("#")
    grad = params[base].grad
    assert grad is not None
    return (grad[int(expert)] if expert else grad).clone()


def hf_reference(
    hf_dir: Path, batches: list[dict[str, torch.Tensor]], grad_names: dict[str, str] = HF_GRAD_NAMES
) -> dict[str, Any]:
    """transformers' logits per micro-batch, the label log-probs / entropy computed from them, and the
    gradients of the test loss (summed over micro-batches / their number, as megatron's schedule does)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    outputs = []
    for batch in batches:
        if "hf_pixel_values_videos" in batch:  # videos: transformers' inputs kept apart
            extra = {key[3:]: value for key, value in batch.items() if key.startswith("hf_")}
        else:
            extra = {k: batch[k] for k in ("pixel_values", "image_grid_thw") if k in batch}
        ids = batch["input_ids"]
        logits = model(
            input_ids=ids,
            attention_mask=batch["attention_mask"],
            mm_token_type_ids=(ids == IMAGE).int() + 2 * (ids == VIDEO).int(),
            **extra,
        ).logits
        log_softmax = torch.log_softmax(logits, dim=-1)
        output = {
            "logits": logits,
            "log_probs": log_softmax.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1),
            "entropy": -(log_softmax.exp() * log_softmax).sum(-1),
        }
        (_loss(output, batch["attention_mask"]) / len(batches)).backward()
        outputs.append({key: value.detach() for key, value in output.items()})
    params = dict(model.named_parameters())
    grads = {mg: _hf_grad(params, hf) for mg, hf in grad_names.items() if hf.partition("#")[0] in params}
    return {"outputs": outputs, "grads": grads}


# ------------------------------------------------------------------- TP shards and PP names (for grads)
_EXPERT = re.compile(r"local_experts\.(\d+)\.")
_LAYER = re.compile(r"^(text_decoder\.decoder\.layers|image_encoder\.encoder\.blocks\.layers)\.(\d+)\.")


def tp1_name(name: str, layout: Any, tied_copy: bool, first_expert: int = 0) -> str:
    """A stage-local parameter name as the TP1 / PP1 / EP1 model names it (layer indices restart on each stage,
    expert indices on each EP rank)."""
    if tied_copy and name == "text_decoder.output_layer.weight":
        return "text_decoder.embedding.word_embeddings.weight"
    match = _LAYER.match(name)
    if match is None:
        return name
    offset = layout.llm_layers.start if match.group(1).startswith("text") else layout.vit_layers.start
    rest = _EXPERT.sub(lambda m: f"local_experts.{int(m.group(1)) + first_expert}.", name[match.end() :])
    return f"{match.group(1)}.{int(match.group(2)) + offset}.{rest}"


# ------------------------------------------------------------------------------- in the spawned ranks
def _build_and_load(
    data: dict[str, Any],
    mm_dir: str | None,
    actor: Any = None,
    remove_padding: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Any:
    from megatron.core import parallel_state

    from mm_rl.convert.layout import rank_file
    from mm_rl.models.lora import load_stage
    from mm_rl.models.registry import family_of

    model_cfg = load_model_config(data)
    model = family_of(model_cfg).build_model(model_cfg, actor=actor, remove_padding=remove_padding, params_dtype=dtype)
    if mm_dir is not None:
        path = rank_file(
            Path(mm_dir) / "release",
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_rank(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
        load_stage(model, torch.load(path, weights_only=True)["model"])  # with LoRA adapters: the base's tensors
    return model


def _loss(output: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """A stand-in RL loss: masked mean of -log p(label) - ENTROPY_COEF * entropy."""
    weights = mask.float() / mask.sum()
    return -((output["log_probs"] + ENTROPY_COEF * output["entropy"]) * weights).sum()


def run_schedule(
    model: Any,
    batches: list[dict[str, torch.Tensor]],
    loss_mask: str = "attention_mask",
    select: bool = False,
    share: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Forward + backward over the micro-batches with megatron's schedule, the loss over the batch's ``loss_mask``
    positions; the last stage's outputs (with ``select``, only the ``loss_mask`` positions' log-probs and entropy,
    the model's ``output_mask``; else every position's, and the logits). ``share``: the batches' shared prompts
    (``shared_prompt``) computed once."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    captured: list[dict[str, torch.Tensor]] = []

    def forward_step(data: Iterator[dict[str, torch.Tensor]], chunk: Any) -> tuple[Any, Any]:
        batch = next(data)
        output = chunk(
            batch["input_ids"],
            attention_mask=batch["attention_mask"],
            pixel_values=batch.get("pixel_values"),
            image_grid_thw=batch.get("image_grid_thw"),
            mrope_time_steps=batch.get("mrope_time_steps"),
            labels=batch["labels"],
            output_mask=batch[loss_mask] if select else None,
            shared_prompt=batch.get("shared_prompt") if share else None,
            return_logits=not select,
        )

        def loss_func(out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            captured.append({key: value.detach().clone() for key, value in out.items()})
            loss = _loss(out, batch[loss_mask])
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=max(b["input_ids"].shape[1] for b in batches),
        micro_batch_size=2,
        forward_only=False,
    )
    return captured


def output_diffs(
    captured: list[dict[str, torch.Tensor]],
    reference: list[dict[str, torch.Tensor]],
    batches: list[dict[str, torch.Tensor]],
) -> dict[str, float]:
    """Max |ours - transformers'| over the real tokens of every micro-batch (logits gathered over TP)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    diffs = {"logits": 0.0, "log_probs": 0.0, "entropy": 0.0}
    for ours, theirs, batch in zip(captured, reference, batches, strict=True):
        valid = batch["attention_mask"].bool()
        full = {**ours, "logits": gather_cat(ours["logits"], group, dim=-1)}
        for key in diffs:
            diffs[key] = max(diffs[key], (full[key][valid] - theirs[key][valid]).abs().max().item())
    return diffs


def tp1_grads(model: Any) -> dict[str, torch.Tensor]:
    """This stage's parameter gradients, merged over TP (by the one mapping table) and named as in the TP1 model."""
    from megatron.core import parallel_state

    from mm_rl.convert.mapping import merge_tp_shards

    layout = model.layout
    tied_copy = model.share_embeddings_and_output_weights and layout.first_llm != layout.pp_size - 1
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    if tied_copy:  # the first stage's embedding and the last stage's copy each hold part of the gradient
        name = (
            "text_decoder.embedding.word_embeddings.weight"
            if layout.has_embedding
            else "text_decoder.output_layer.weight"
        )
        torch.distributed.all_reduce(grads[name], group=parallel_state.get_embedding_group())
    params = dict(model.named_parameters())
    for name, grad in grads.items():  # what finalize_model_grads sums over TP: the qk norms (each rank saw its
        # heads) and, under sequence parallelism, what each rank computed on its share of the tokens (norms, router)
        if (
            "q_layernorm" in name
            or "k_layernorm" in name
            or (model.config.sequence_parallel and getattr(params[name], "sequence_parallel", False))
        ):
            torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
    dp = parallel_state.get_data_parallel_world_size()
    experts = {name for name, p in model.named_parameters() if not getattr(p, "allreduce", True)}
    for name in experts:  # what megatron's DP averaging does to an expert: every DP rank's tokens reached it
        grads[name] = grads[name] / dp
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:  # what megatron's DP x CP gradient averaging does (the schedule scaled the loss by cp)
        for grad in grads.values():
            torch.distributed.all_reduce(grad, group=parallel_state.get_context_parallel_group())
            grad /= cp
    group = parallel_state.get_expert_tensor_parallel_group()
    return {
        tp1_name(name, layout, tied_copy, _first_expert(model.model_cfg) if name in experts else 0): merge_tp_shards(
            name,
            gather_list(grad, group if name in experts else parallel_state.get_tensor_model_parallel_group()),
            model.model_cfg,
        )
        for name, grad in grads.items()
    }


def _first_expert(model_cfg: Any) -> int:
    """The global index of this EP rank's first expert."""
    from megatron.core import parallel_state

    from mm_rl.convert.mapping import local_experts

    ep = parallel_state.get_expert_model_parallel_world_size()
    return local_experts(model_cfg, parallel_state.get_expert_model_parallel_rank(), ep)[0][1]


def _init(
    rank: int, world: int, port: int, data: dict[str, Any], tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1
) -> None:
    import warnings

    from mm_rl.platform.device import setup_process

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    setup_process(num_threads=1)
    from mm_rl.models.registry import family_of

    model_cfg = load_model_config(data)
    embedding_ranks = family_of(model_cfg).embedding_ranks(model_cfg)
    init_megatron(rank, world, port, tp=tp, pp=pp, cp=cp, ep=ep, embedding_ranks=embedding_ranks)


def _parallel_worker(rank: int, world: int, port: int, case: dict[str, Any], shared: str, out_dir: str) -> None:
    _init(rank, world, port, case["json"], tp=case["tp"], pp=case["pp"], cp=case["cp"], ep=case.get("ep", 1))
    from mm_rl.config.schema import ActorConfig

    started = time.perf_counter()
    inputs = torch.load(Path(shared) / "inputs.pt", weights_only=False)
    model = _build_and_load(case["json"], case["mm_dir"], ActorConfig(unfreeze_vision_encoder=True))
    captured = run_schedule(model, inputs["batches"])
    result: dict[str, Any] = {"grads": {}, "outputs": {}}
    if model.layout.has_output:
        result["outputs"] = output_diffs(captured, inputs["reference"][case["hf"]]["outputs"], inputs["batches"])
        tp1_outputs = torch.load(Path(shared) / f"outputs_{case['hf']}.pt", weights_only=True)
        result["outputs_vs_tp1"] = output_diffs(captured, tp1_outputs, inputs["batches"])
    reference_grads = torch.load(Path(shared) / f"grads_{case['hf']}.pt", weights_only=True)
    packed_grads = tp1_grads(model)
    for name, grad in packed_grads.items():
        result["grads"][name] = (grad - reference_grads[name]).abs().max().item()
    if case.get("padded_rerun"):
        result["packed_vs_padded"] = packed_vs_padded(
            case["json"], case["mm_dir"], inputs["batches"], captured, packed_grads
        )
    if case.get("selected_rerun"):
        result["selected_vs_full"] = selected_vs_full(case["json"], case["mm_dir"], inputs["batches"])
        result["shared_vs_separate"] = shared_vs_separate(case["json"], case["mm_dir"], inputs["batches"])
    if case.get("frozen_rerun"):  # default freeze switches: the frozen ViT stages still pass the pipeline
        captured = run_schedule(_build_and_load(case["json"], case["mm_dir"]), inputs["batches"])
        if captured:
            result["outputs_frozen"] = output_diffs(
                captured, inputs["reference"][case["hf"]]["outputs"], inputs["batches"]
            )
    result["seconds"] = time.perf_counter() - started
    save_rank_result(out_dir, rank, result)
    shutdown()


def _tp1_worker(rank: int, world: int, port: int, cases: dict[str, Any], shared: str, out_dir: str) -> None:
    """TP1 parity (untied and tied), reference gradients, freeze switches and model.json switches."""
    _init(rank, world, port, cases["untied"]["json"])
    from mm_rl.config.schema import ActorConfig

    inputs = torch.load(Path(shared) / "inputs.pt", weights_only=False)
    batches, result = inputs["batches"], {}
    for key in ("untied", "tied"):
        model = _build_and_load(cases[key]["json"], cases[key]["mm_dir"], ActorConfig(unfreeze_vision_encoder=True))
        captured = run_schedule(model, batches)
        result[key] = output_diffs(captured, inputs["reference"][key]["outputs"], batches)
        torch.save(captured, Path(shared) / f"outputs_{key}.pt")
        grads = tp1_grads(model)
        torch.save(grads, Path(shared) / f"grads_{key}.pt")
        result[f"{key}_grads_vs_hf"] = {
            name: (grads[name] - hf_grad).abs().max().item()
            for name, hf_grad in inputs["reference"][key]["grads"].items()
        }
        # every compared gradient is non-trivial (a zero gradient would match anything)
        result[f"{key}_zero_grads"] = [name for name, grad in grads.items() if not grad.abs().max() > 1e-7]
        if key == "untied":
            result["bf16"] = bf16_vs_fp32(cases[key]["json"], cases[key]["mm_dir"], batches, captured)
            result["packed_vs_padded"] = packed_vs_padded(
                cases[key]["json"], cases[key]["mm_dir"], batches, captured, grads
            )
            for packed in (True, False):
                result[f"selected_vs_full_{'packed' if packed else 'padded'}"] = selected_vs_full(
                    cases[key]["json"], cases[key]["mm_dir"], batches, remove_padding=packed
                )
            result["shared_vs_separate"] = shared_vs_separate(cases[key]["json"], cases[key]["mm_dir"], batches)
    for key in ("variant", "narrow"):
        model = _build_and_load(cases[key]["json"], cases[key]["mm_dir"])
        result[key] = output_diffs(run_schedule(model, batches), inputs["reference"][key]["outputs"], batches)
    result["freeze"] = _freeze_checks(cases["untied"], batches)
    result["switches"] = _switch_runs(batches)
    save_rank_result(out_dir, rank, result)
    shutdown()


def bf16_vs_fp32(
    data: dict[str, Any], mm_dir: str, batches: list[dict[str, torch.Tensor]], fp32: list[dict[str, torch.Tensor]]
) -> dict[str, Any]:
    """The model as accelerators run it, every parameter in bf16 (the norms too: an fp32 norm weight on bf16
    activations takes torch's unfused path): its label log-probs against the fp32 model's."""
    model = _build_and_load(data, mm_dir, dtype=torch.bfloat16)
    diffs = []
    with torch.no_grad():
        for batch, reference in zip(batches, fp32, strict=True):
            pixels = batch.get("pixel_values")
            out = model(
                batch["input_ids"],
                attention_mask=batch["attention_mask"],
                pixel_values=None if pixels is None else pixels.bfloat16(),
                image_grid_thw=batch.get("image_grid_thw"),
                mrope_time_steps=batch.get("mrope_time_steps"),
                labels=batch["labels"],
            )
            mask = batch["attention_mask"].bool()
            diffs.append((out["log_probs"].float() - reference["log_probs"])[mask].abs())
    gap = torch.cat(diffs)
    return {
        "not_bf16": [name for name, p in model.named_parameters() if p.dtype != torch.bfloat16],
        "log_probs_mean": gap.mean().item(),
        "log_probs_max": gap.max().item(),
    }


def packed_vs_padded(
    data: dict[str, Any],
    mm_dir: str,
    batches: list[dict[str, torch.Tensor]],
    packed: list[dict[str, torch.Tensor]],
    packed_grads: dict[str, torch.Tensor],
) -> dict[str, float]:
    """The same micro-batches through the padded path (``remove_padding`` off): the largest |difference| of the
    log-probs and entropy on real tokens, and of every gradient relative to its norm (TP1 names)."""
    from mm_rl.config.schema import ActorConfig

    model = _build_and_load(data, mm_dir, ActorConfig(unfreeze_vision_encoder=True), remove_padding=False)
    padded = run_schedule(model, batches)
    diffs = {"log_probs": 0.0, "entropy": 0.0}
    for ours, theirs, batch in zip(packed, padded, batches if packed else [], strict=True):  # last stage
        valid = batch["attention_mask"].bool()
        for key in diffs:
            diffs[key] = max(diffs[key], (ours[key][valid] - theirs[key][valid]).abs().max().item())
    grads = tp1_grads(model)
    diffs["grad_rel"] = max(
        ((packed_grads[name] - grad).norm() / grad.norm().clamp_min(1e-30)).item() for name, grad in grads.items()
    )
    return diffs


def with_wanted_tail(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The micro-batches with ``wanted``: the last 2 to 6 real positions of each row (as response tokens are)."""
    out = []
    for batch in batches:
        valid = batch["attention_mask"].bool()
        ends = valid.cumsum(-1)  # right or left padding alike: the rank of each real token in its row
        tail = torch.tensor([2 + 2 * row for row in range(valid.shape[0])])[:, None]
        out.append({**batch, "wanted": (valid & (ends > valid.sum(-1, keepdim=True) - tail)).float()})
    return out


def selected_vs_full(
    data: dict[str, Any], mm_dir: str, batches: list[dict[str, torch.Tensor]], remove_padding: bool = True
) -> dict[str, float]:
    """The micro-batches' log-probs and entropy at their ``wanted`` positions only (the model's ``output_mask``) vs
    every position's, both with a loss over the wanted positions: the largest |difference| there, the largest
    |value| elsewhere (must be 0), and every gradient's difference relative to its norm (TP1 names)."""
    from mm_rl.config.schema import ActorConfig

    batches = with_wanted_tail(batches)
    runs, grads = [], []
    for select in (False, True):
        model = _build_and_load(data, mm_dir, ActorConfig(unfreeze_vision_encoder=True), remove_padding=remove_padding)
        runs.append(run_schedule(model, batches, loss_mask="wanted", select=select))
        grads.append(tp1_grads(model))
    diffs = {"log_probs": 0.0, "entropy": 0.0, "unwanted": 0.0}
    for full, selected, batch in zip(*runs, batches if runs[0] else [], strict=True):  # last stage
        wanted = batch["wanted"].bool()
        for key in ("log_probs", "entropy"):
            diffs[key] = max(diffs[key], (full[key][wanted] - selected[key][wanted]).abs().max().item())
            diffs["unwanted"] = max(diffs["unwanted"], selected[key][~wanted].abs().max().item())
    diffs["grad_rel"] = max(
        ((grads[1][name] - grad).norm() / grad.norm().clamp_min(1e-30)).item() for name, grad in grads[0].items()
    )
    return diffs


def grouped(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """GRPO-like micro-batches from the right-padded ones (images, then text only): each row a prompt answered
    three times (responses of 2, 5 and 3 tokens; the images repeated per row, as micro-batches carry them), the
    first micro-batch's two groups side by side; ``wanted`` the response positions, ``shared_prompt`` the prompt
    but its last token on a group's later rows."""
    g = torch.Generator().manual_seed(11)
    out = []
    for batch in batches[:2]:
        prompts = [
            ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
        ]
        grids = batch.get("image_grid_thw")
        per_row = [[GRIDS[0]], GRIDS[1:]] if grids is not None else [[], []]
        rows, shared, row_grids, row_pixels = [], [], [], []
        pixels = batch.get("pixel_values")
        offsets = [0, sum(t * h * w for t, h, w in per_row[0])]
        for prompt, own, offset in zip(prompts, per_row, offsets, strict=True):
            patches = sum(t * h * w for t, h, w in own)
            for answer, length in enumerate((2, 5, 3)):
                rows.append(prompt + _text(g, length))
                shared.append(len(prompt) - 1 if answer else 0)
                row_grids += own
                if patches:
                    row_pixels.append(pixels[offset : offset + patches])
        ids, mask = _padded(rows, left=False)
        wanted = torch.zeros(ids.shape)
        for row, (tokens, prompt) in enumerate(zip(rows, (p for p in prompts for _ in range(3)), strict=True)):
            wanted[row, len(prompt) - 1 : len(tokens) - 1] = 1.0
        new = {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": torch.roll(ids, -1, dims=1),
            "wanted": wanted,
            "shared_prompt": torch.tensor(shared),
        }
        if row_grids:
            new["image_grid_thw"], new["pixel_values"] = torch.tensor(row_grids), torch.cat(row_pixels)
        out.append(new)
    return out


def _count_positions(seen: list[int], module: Any, args: Any, kwargs: dict[str, Any]) -> None:
    seen.append(kwargs["input_ids"].shape[1])


def shared_vs_separate(data: dict[str, Any], mm_dir: str, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """GRPO groups (:func:`grouped`) with each group's prompt computed once (``shared_prompt``) vs every row whole,
    both with the loss over the response positions: the largest |difference| of the log-probs and entropy there,
    every gradient's difference relative to its norm (TP1 names), and ``tokens``: the LLM's positions with shared
    prompts over those without."""
    from mm_rl.config.schema import ActorConfig

    batches = grouped(batches)
    runs, grads, positions = [], [], []
    for share in (False, True):
        model = _build_and_load(data, mm_dir, ActorConfig(unfreeze_vision_encoder=True))
        seen: list[int] = []
        model.text_decoder.register_forward_pre_hook(functools.partial(_count_positions, seen), with_kwargs=True)
        runs.append(run_schedule(model, batches, loss_mask="wanted", select=True, share=share))
        grads.append(tp1_grads(model))
        positions.append(sum(seen))
    diffs = {"log_probs": 0.0, "entropy": 0.0}
    for separate, shared, batch in zip(*runs, batches if runs[0] else [], strict=True):  # last stage
        wanted = batch["wanted"].bool()
        for key in diffs:
            diffs[key] = max(diffs[key], (separate[key][wanted] - shared[key][wanted]).abs().max().item())
    diffs["grad_rel"] = max(
        ((grads[1][name] - grad).norm() / grad.norm().clamp_min(1e-30)).item() for name, grad in grads[0].items()
    )
    return diffs | {"tokens": positions[1] / positions[0]}


def _freeze_checks(case: dict[str, Any], batches: list[dict[str, torch.Tensor]]) -> dict[str, bool]:
    """Default: ViT frozen (no grads), merger trained; freeze_vision_projector: the image encoder builds no graph."""
    from mm_rl.config.schema import ActorConfig

    checks = {}
    for label, actor in (("default", ActorConfig()), ("projector_frozen", ActorConfig(freeze_vision_projector=True))):
        model = _build_and_load(case["json"], case["mm_dir"], actor)
        run_schedule(model, batches[:1])
        params = dict(model.named_parameters())
        vit = [p for n, p in params.items() if n.startswith("image_encoder.encoder.")]
        merger = [p for n, p in params.items() if n.startswith("image_encoder.projector.")]
        checks[f"{label}: vit frozen, no grads"] = all(not p.requires_grad and p.grad is None for p in vit)
        merger_trains = label == "default"
        checks[f"{label}: merger trains={merger_trains}"] = all(
            p.requires_grad == merger_trains and (p.grad is not None) == merger_trains for p in merger
        )
        checks[f"{label}: llm has grads"] = all(
            p.grad is not None for n, p in params.items() if n.startswith("text_decoder.")
        )
        if label == "projector_frozen":
            batch = batches[0]
            embeds = model.image_embeddings(batch["pixel_values"], batch["image_grid_thw"])
            checks["projector_frozen: image embeddings carry no graph"] = embeds.grad_fn is None
    return checks


def _switch_runs(batches: list[dict[str, torch.Tensor]]) -> dict[str, bool]:
    """model.json switches beyond the HF-checked ones build and run forward + backward (random weights)."""
    runs = {}
    for label, text in (
        ("LayerNorm+relu", {"normalization": "LayerNorm", "activation_func": "relu"}),
        ("FusedLayerNorm+quick_gelu", {"normalization": "FusedLayerNorm", "activation_func": "quick_gelu"}),
        ("silu, 1 layer, mrope [8,4,4]", {"num_layers": 1, "pipeline_num_layers": [1], "mrope_section": [8, 4, 4]}),
    ):
        model = _build_and_load(model_json(text=text), None)
        outputs = run_schedule(model, batches[:1])
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        runs[label] = bool(outputs) and all(g is not None and torch.isfinite(g).all() for g in grads)
    runs["hybrid decoder (the family's layer seam)"] = _hybrid_decoder_runs(batches)
    return runs


def _hybrid_decoder_runs(batches: list[dict[str, torch.Tensor]]) -> bool:
    """A family's ``decoder_layer`` chooses each LLM layer by its index (as a hybrid linear / full attention
    decoder will): here q / k norms on the odd layers only. The stage builds exactly those layers and trains."""
    from mm_rl.models.qwen_vl.layers import llm_layer_spec
    from mm_rl.models.registry import family_of

    asked: list[int] = []

    def hybrid(text: Any, index: int, ulysses: bool) -> Any:
        asked.append(index)
        return llm_layer_spec(text.normalization, ulysses, qk_layernorm=index % 2 == 1)

    model_cfg = load_model_config(model_json())
    model = family_of(model_cfg).stage().build_model(model_cfg, decoder_layer=hybrid)
    layers = model.text_decoder.decoder.layers
    normed = [any(True for _ in layer.self_attention.q_layernorm.parameters()) for layer in layers]
    outputs = run_schedule(model, batches[:1])
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    return (
        asked == list(range(len(layers)))
        and normed == [i % 2 == 1 for i in range(len(layers))]
        and bool(outputs)
        and all(g is not None and torch.isfinite(g).all() for g in grads)
    )


# ------------------------------------------------------------------------------------------- fixtures
CASES = {  # name: (tp, pp, cp, tied, json kwargs)
    "tp2": (2, 1, 1, False, {}),
    "pp2": (1, 2, 1, True, {"llm_pp": [1, 3], "vit_pp": [2, 0]}),
    "tp2_pp2": (2, 2, 1, False, {"llm_pp": [1, 3], "vit_pp": [2, 0]}),
    # the ViT split over two stages, the second sending image embeddings to an LLM-only stage
    "pp3_vit_split": (1, 3, 1, True, {"llm_pp": [0, 0, 4], "vit_pp": [1, 1, 0]}),
    # Ulysses CP: 2 KV groups split over 2 CP ranks; with TP2 one group per TP rank is repeated per head
    "cp2": (1, 1, 2, False, {}),
    "tp2_cp2": (2, 1, 2, False, {}),
}
FROZEN_RERUN = {"pp3_vit_split"}
PADDED_RERUN = {"tp2", "pp2", "cp2"}  # packed (the default) against padded rows, beside TP1's
SELECTED_RERUN = {"tp2", "pp2", "cp2", "tp2_cp2"}  # only the wanted positions' outputs, beside TP1's


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Checkpoints, conversions, inputs, transformers' outputs, then the TP1 run (reference gradients)."""
    started = time.perf_counter()
    root = tmp_path_factory.mktemp("parity")
    from mm_rl.convert.hf_writer import job_model_dir

    hf = {
        "untied": build_hf_checkpoint(root / "untied", tied=False),
        "tied": build_hf_checkpoint(root / "tied", tied=True),
        "variant": build_hf_checkpoint(root / "variant", tied=False, **VARIANT_HF),
    }
    jsons = {"untied": model_json(), "tied": model_json(tied=True), "variant": model_json(text=VARIANT_JSON)}
    jsons["narrow"] = model_json(text=NARROW_JSON)
    jsons["narrow"]["image_encoder"]["vision_projector"]["hidden_size"] = NARROW_JSON["hidden_size"]
    hf["narrow"] = job_model_dir(hf["untied"], load_model_config(jsons["narrow"]), root / "narrow")
    source = {**hf, "narrow": hf["untied"]}  # hf2mg cuts the full checkpoint itself
    tp1 = {
        key: {"json": jsons[key], "mm_dir": str(convert(source[key], root / f"mm_tp1_{key}", jsons[key], 1))}
        for key in hf
    }
    parallel = {}
    for name, (tp, pp, cp, tied, kwargs) in CASES.items():
        key = "tied" if tied else "untied"
        data = model_json(tied=tied, **kwargs)
        parallel[name] = {
            "tp": tp,
            "pp": pp,
            "cp": cp,
            "hf": key,
            "json": data,
            "frozen_rerun": name in FROZEN_RERUN,
            "padded_rerun": name in PADDED_RERUN,
            "selected_rerun": name in SELECTED_RERUN,
            "mm_dir": str(convert(hf[key], root / f"mm_{name}", data, tp)),
        }
    batches = make_micro_batches()
    reference = {key: hf_reference(path, batches) for key, path in hf.items()}
    torch.save({"batches": batches, "reference": reference}, root / "inputs.pt")
    prepared = time.perf_counter()
    out = root / "tp1"
    out.mkdir()
    spawn(_tp1_worker, 1, tp1, str(root), str(out))
    print(f"\nset-up {prepared - started:.1f}s, TP1 run {time.perf_counter() - prepared:.1f}s")
    return {"root": root, "cases": parallel, "tp1": load_rank_results(out, 1)[0]}


def _report(name: str, values: dict[str, float]) -> None:
    print(f"{name}: " + ", ".join(f"{key} {value:.2e}" for key, value in values.items()))


def test_tp1_matches_transformers(setup: dict[str, Any]) -> None:
    result = setup["tp1"]
    for key in ("untied", "tied", "variant", "narrow"):
        _report(f"tp1 {key}", result[key])
        assert max(result[key].values()) <= LOGIT_TOL, (key, result[key])
    for key in ("untied", "tied"):
        grads = result[f"{key}_grads_vs_hf"]
        _report(f"tp1 {key} grads vs transformers", grads)
        assert len(grads) == len(HF_GRAD_NAMES) - (key == "tied")  # tied: no separate lm_head
        assert max(grads.values()) <= GRAD_TOL, grads
        assert not result[f"{key}_zero_grads"]
    bf16 = result["bf16"]
    _report("tp1 bf16 vs fp32", {k: v for k, v in bf16.items() if k != "not_bf16"})
    assert not bf16["not_bf16"]
    assert bf16["log_probs_mean"] <= BF16_MEAN_TOL and bf16["log_probs_max"] <= BF16_MAX_TOL, bf16
    _report("tp1 packed vs padded", result["packed_vs_padded"])
    assert max(result["packed_vs_padded"].values()) <= GRAD_TOL
    for rows in ("packed", "padded"):
        _report(f"tp1 {rows}: wanted positions only vs all", result[f"selected_vs_full_{rows}"])
        assert max(result[f"selected_vs_full_{rows}"].values()) <= GRAD_TOL
    shared = dict(result["shared_vs_separate"])
    _report("tp1 shared prompts computed once vs every row whole", shared)
    assert shared.pop("tokens") < 0.6  # the prompts were shared: about half the positions
    assert max(shared.values()) <= GRAD_TOL


def test_freeze_switches(setup: dict[str, Any]) -> None:
    failed = [name for name, ok in setup["tp1"]["freeze"].items() if not ok]
    assert not failed, failed


def test_model_json_switches_build_and_run(setup: dict[str, Any]) -> None:
    failed = [name for name, ok in setup["tp1"]["switches"].items() if not ok]
    assert not failed, failed


@pytest.mark.parametrize("name", sorted(CASES))
def test_parallel_matches_transformers_and_tp1(setup: dict[str, Any], name: str, tmp_path: Path) -> None:
    case = setup["cases"][name]
    world = case["tp"] * case["pp"] * case["cp"]
    started = time.perf_counter()
    spawn(_parallel_worker, world, case, str(setup["root"]), str(tmp_path))
    results = load_rank_results(tmp_path, world)
    outputs = [r["outputs"] for r in results if r["outputs"]]
    grads = {name: diff for r in results for name, diff in r["grads"].items()}
    reference_names = torch.load(setup["root"] / f"grads_{case['hf']}.pt", weights_only=True).keys()
    worst = max(grads, key=grads.__getitem__)
    print(f"\n{name}: {time.perf_counter() - started:.1f}s; max grad diff {grads[worst]:.2e} ({worst})")
    vs_tp1 = [r["outputs_vs_tp1"] for r in results if r["outputs"]]
    for output, output_tp1 in zip(outputs, vs_tp1, strict=True):
        _report(f"{name} vs transformers", output)
        _report(f"{name} vs TP1", output_tp1)
    assert len(outputs) == case["tp"] * case["cp"]  # every last-stage rank checked its outputs
    assert set(grads) == set(reference_names)  # every TP1 parameter's gradient was compared
    assert max(max(o.values()) for o in outputs) <= LOGIT_TOL
    assert max(max(o.values()) for o in vs_tp1) <= GRAD_TOL  # same code path as TP1: 1e-5 (CP2 vs CP1)
    assert grads[worst] <= GRAD_TOL
    if case["padded_rerun"]:
        padded = [r["packed_vs_padded"] for r in results if "packed_vs_padded" in r]
        _report(f"{name} packed vs padded", {key: max(o[key] for o in padded) for key in padded[0]})
        assert len(padded) == world and max(max(o.values()) for o in padded) <= GRAD_TOL  # grads on every rank
    if case["selected_rerun"]:
        selected = [r["selected_vs_full"] for r in results]
        _report(f"{name} wanted positions only vs all", {key: max(o[key] for o in selected) for key in selected[0]})
        assert max(max(o.values()) for o in selected) <= GRAD_TOL  # grads on every rank
        shared = [dict(r["shared_vs_separate"]) for r in results]
        _report(f"{name} shared prompts once vs whole rows", {key: max(o[key] for o in shared) for key in shared[0]})
        assert all(o.pop("tokens") < 0.6 for o in shared)
        assert max(max(o.values()) for o in shared) <= GRAD_TOL
    if case["frozen_rerun"]:
        frozen = [r["outputs_frozen"] for r in results if "outputs_frozen" in r]
        _report(f"{name} frozen ViT", frozen[0])
        assert len(frozen) == case["tp"] * case["cp"] and max(max(o.values()) for o in frozen) <= LOGIT_TOL


# ------------------------------------------------------------------ log-probs / entropy (single process)
@pytest.mark.parametrize(("vocab_size", "temperature"), [(None, 1.0), (37, 0.7)])
def test_log_probs_and_entropy_match_autograd_reference(vocab_size: int | None, temperature: float) -> None:
    """Values and the analytic backward vs plain torch, with padded vocab rows masked and a temperature."""
    from mm_rl.models.qwen_vl.logprobs import log_probs_and_entropy

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 40, generator=g, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, vocab_size or 40, (2, 5), generator=g)
    weights = torch.randn(2, 2, 5, generator=g, dtype=torch.float64)
    log_probs, entropy = log_probs_and_entropy(
        logits, labels, vocab_size=vocab_size, temperature=temperature, group=None
    )
    ((log_probs * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    ours = logits.grad.clone()

    logits.grad = None
    real = logits[..., : vocab_size or 40] / temperature
    log_softmax = torch.log_softmax(real, dim=-1)
    ref_lp = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    ((ref_lp * weights[0]).sum() + (ref_entropy * weights[1]).sum()).backward()
    assert torch.allclose(log_probs.double(), ref_lp, atol=1e-5)
    assert torch.allclose(entropy.double(), ref_entropy, atol=1e-5)
    assert torch.allclose(ours, logits.grad, atol=1e-5)
    assert log_probs.dtype == torch.float32 and ours.dtype == torch.float64


def test_log_probs_upcast_before_the_temperature() -> None:
    """bf16 logits are divided by the temperature in fp32, as the sampler does: dividing in bf16 first rounds every
    scaled logit to bf16 again (the values differ from the fp32 division by up to ~1e-2 here)."""
    from mm_rl.models.qwen_vl.logprobs import log_probs_and_entropy

    g = torch.Generator().manual_seed(1)
    logits = (8 * torch.randn(3, 7, 64, generator=g)).to(torch.bfloat16)
    labels = torch.randint(0, 64, (3, 7), generator=g)
    log_probs, _ = log_probs_and_entropy(logits, labels, temperature=0.7, group=None)
    exact = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    rounded = torch.log_softmax((logits / 0.7).float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert (exact - rounded).abs().max() > 1e-3  # the case distinguishes the two orders
    assert torch.allclose(log_probs, exact, atol=1e-5)
