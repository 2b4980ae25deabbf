"""One ViT pass per distinct image: the samples of a prompt share its image, and a rank encodes it once per micro-batch.

A micro-batch of two prompts x 3 samples (images of two sizes, the larger spanning two attention windows) goes
through megatron's schedule on the tiny model (transformers checkpoint through hf2mg) twice: the way the driver
sends it (rows name their prompt by ``image_index``; the rank puts the step's images together at its device
boundary) and the way it was sent before (a copy of the prompt's pixel values per sample). Log-probs and entropy are
equal (1e-6), so are the gradients of a log-prob + entropy loss with the ViT unfrozen (1e-6 relative, in norm: fp32
sums in another order; the ViT's gradient is summed from the three slots of each encoding), and a forward hook on
the image encoder counts 2 images encoded instead of 6. Layouts: one rank (ViT unfrozen, then frozen as by default);
PP2 with the ViT split over both stages (the merger and the LLM on the second), and with the ViT on a stage of its
own that sends the encoded images' embeddings on; CP2 (every CP rank encodes the whole micro-batch).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from mp_utils import load_rank_results, save_rank_result, shutdown, spawn
from test_model_parity import (
    PAD,
    PATCH_DIM,
    _build_and_load,
    _image,
    _init,
    _text,
    build_hf_checkpoint,
    convert,
    model_json,
)

TOL, GRAD_RTOL = 1e-6, 1e-6
GRIDS = {0: (1, 4, 4), 1: (1, 4, 12)}  # prompt 0: one window; prompt 1: two windows
SAMPLES = 3
ENTROPY_COEF = 0.1
LAYOUTS = {  # name: (world, pp, cp, {variant: model.json pipeline split})
    "pp1": (1, 1, 1, {"unfrozen": {}, "frozen": {}}),
    "pp2": (
        2,
        2,
        1,
        {"vit_split": {"vit_pp": [1, 1], "llm_pp": [0, 4]}, "vit_stage": {"vit_pp": [2, 0], "llm_pp": [0, 4]}},
    ),
    "cp2": (2, 1, 2, {"unfrozen": {}}),
}


def driver_inputs() -> tuple[dict[str, torch.Tensor], dict[int, Any], dict[str, torch.Tensor]]:
    """The driver's micro-batch of the six samples (group by group, as the trainer orders them), the step's images,
    and the same micro-batch with a copy of its prompt's pixel values per sample."""
    from mm_rl.trainer.batch import Sample, micro_batches, step_images

    g = torch.Generator().manual_seed(5)
    items, prompts = {}, {}
    for index, grid in GRIDS.items():
        t, h, w = grid
        items[index] = SimpleNamespace(
            pixel_values=torch.randn(t * h * w, PATCH_DIM, generator=g),
            image_grid_thw=torch.tensor([grid]),
            mrope_time_steps=None,
        )
        prompts[index] = _text(g, 3) + _image(grid) + _text(g, 2 + index)
    samples = [
        Sample(index, index, prompts[index], _text(g, 2 + 2 * k + index), "stop")
        for index in GRIDS
        for k in range(SAMPLES)
    ]
    (batch,) = micro_batches([samples], items, PAD)
    per_sample = {key: value for key, value in batch.items() if key != "image_index"}
    per_sample["pixel_values"] = torch.cat([items[s.index].pixel_values for s in samples])
    return batch, step_images(samples, items), per_sample


def _loss(
    captured: list[dict[str, torch.Tensor]], batch: dict[str, torch.Tensor], out: dict[str, torch.Tensor]
) -> torch.Tensor:
    captured.append({key: out[key].detach().clone() for key in ("log_probs", "entropy")})
    mask = batch["response_mask"]
    return -((out["log_probs"] + ENTROPY_COEF * out["entropy"]) * mask).sum() / mask.sum()


def _pass(model: Any, batch: dict[str, torch.Tensor], images: Any) -> dict[str, Any]:
    """Forward + backward of one micro-batch through megatron's schedule and the rank's device boundary: the last
    stage's log-probs / entropy, every gradient, and the images the encoder received."""
    from mm_rl.workers.megatron_worker import run_schedule

    encoded: list[int] = []
    hook = (
        model.image_encoder.register_forward_hook(lambda module, args, out: encoded.append(len(args[1])))
        if model.layout.has_patch_embed
        else None
    )
    model.zero_grad(set_to_none=True)
    captured: list[dict[str, torch.Tensor]] = []
    run_schedule(model, [batch], functools.partial(_loss, captured), 1.0, forward_only=False, images=images)
    if hook is not None:
        hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"outputs": captured[0] if captured else None, "grads": grads, "encoded": sum(encoded)}


def _compare(
    model: Any, batch: dict[str, torch.Tensor], images: Any, per_sample: dict[str, torch.Tensor]
) -> dict[str, Any]:
    once, copies = _pass(model, batch, images), _pass(model, per_sample, None)
    result: dict[str, Any] = {"encoded": (once["encoded"], copies["encoded"])}
    if once["outputs"] is not None:
        valid = batch["attention_mask"].bool()
        result["outputs"] = {
            key: (once["outputs"][key] - copies["outputs"][key])[valid].abs().max().item()
            for key in ("log_probs", "entropy")
        }
    assert once["grads"].keys() == copies["grads"].keys()
    result["grads"] = {
        name: ((once["grads"][name] - grad).norm() / grad.norm().clamp_min(1e-30)).item()
        for name, grad in copies["grads"].items()
    }
    result["vit_grads"] = [
        name
        for name, grad in copies["grads"].items()
        if name.startswith("image_encoder.encoder.") and grad.abs().max() > 0
    ]
    return result


def _rank(rank: int, world: int, port: int, name: str, checkpoints: dict[str, str], out_dir: str) -> None:
    from mm_rl.config.schema import ActorConfig

    _, pp, cp, variants = LAYOUTS[name]
    first = next(iter(variants.values()))
    _init(rank, world, port, model_json(**first), pp=pp, cp=cp)
    batch, images, per_sample = driver_inputs()
    result = {}
    for variant, split in variants.items():
        actor = ActorConfig(unfreeze_vision_encoder=variant != "frozen")
        model = _build_and_load(model_json(**split), checkpoints[_key(split)], actor)
        result[variant] = _compare(model, batch, images, per_sample)
    save_rank_result(out_dir, rank, result)
    shutdown()


def _key(split: dict[str, list[int]]) -> str:
    return "_".join(f"{part}{'-'.join(map(str, layers))}" for part, layers in sorted(split.items())) or "whole"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny transformers checkpoint converted for every pipeline split used here."""
    root = tmp_path_factory.mktemp("dedup")
    hf = build_hf_checkpoint(root, tied=False)
    splits = {_key(split): split for _, _, _, variants in LAYOUTS.values() for split in variants.values()}
    return {key: str(convert(hf, root / f"mm_{key}", model_json(**split), 1)) for key, split in splits.items()}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_each_distinct_image_is_encoded_once_and_the_outputs_and_gradients_stay(
    name: str, checkpoints: dict[str, str], tmp_path: Path
) -> None:
    world, pp, cp, variants = LAYOUTS[name]
    spawn(_rank, world, name, checkpoints, str(tmp_path))
    results = load_rank_results(tmp_path, world)
    for variant in variants:
        ranks = [r[variant] for r in results]
        outputs = [r["outputs"] for r in ranks if "outputs" in r]
        grads = {key: value for r in ranks for key, value in r["grads"].items()}
        worst = max(grads, key=grads.__getitem__)
        print(
            f"\n{name} {variant}: outputs {outputs}, worst grad {grads[worst]:.2e} ({worst}), "
            f"images encoded {[r['encoded'] for r in ranks]}"
        )
        assert len(outputs) == cp  # every last-stage rank compared its outputs
        assert max(max(o.values()) for o in outputs) <= TOL
        assert grads[worst] <= GRAD_RTOL
        assert ranks[0]["encoded"] == (len(GRIDS), len(GRIDS) * SAMPLES)  # 2 images through the ViT, not 6
        unfrozen = variant != "frozen"
        assert bool([n for r in ranks for n in r["vit_grads"]]) == unfrozen  # the shared encoding's gradient compared


def _cache_rank(rank: int, world: int, port: int, checkpoints: dict[str, str], out_dir: str) -> None:
    """The frozen ViT's per-step cache on one rank: the micro-batch cut in two so that prompt 1's group is split
    (prompt 0 x 3 and prompt 1 x 1, then prompt 1 x 2), each half through forward + backward without the cache and
    with it, then the first half again (a later pass of the step)."""
    _init(rank, world, port, model_json())
    batch, images, _ = driver_inputs()
    halves = [{key: value[rows] for key, value in batch.items()} for rows in (slice(0, 4), slice(4, None))]
    model = _build_and_load(model_json(), checkpoints["whole"])  # the default: ViT frozen, merger trained
    encoded: list[int] = []  # images (one frame each) that reach the ViT blocks: a cache hit does not
    model.image_encoder.encoder.register_forward_hook(
        lambda module, args, out: encoded.append(len(args[1].segments.cu_full_seqlens) - 1)
    )
    plain = [_pass(model, half, images) for half in halves]
    result: dict[str, Any] = {"plain_encoded": sum(encoded)}
    model.image_encoder.cache = {}
    encoded.clear()
    cached = [_pass(model, half, images) for half in halves]
    result["cached_encoded"] = sum(encoded)
    _pass(model, halves[0], images)
    result["again_encoded"] = sum(encoded)
    result["outputs"] = max(
        (a["outputs"][key] - b["outputs"][key]).abs().max().item()
        for a, b in zip(plain, cached, strict=True)
        for key in ("log_probs", "entropy")
    )
    result["grads"] = max(
        ((b["grads"][name] - grad).norm() / grad.norm().clamp_min(1e-30)).item()
        for a, b in zip(plain, cached, strict=True)
        for name, grad in a["grads"].items()
    )
    result["merger_trained"] = any(name.startswith("image_encoder.projector.") for name in plain[0]["grads"])
    result |= _handed_over(model, checkpoints["whole"], halves, images, plain, encoded)
    save_rank_result(out_dir, rank, result)
    shutdown()


def _handed_over(
    model: Any,
    checkpoint: str,
    halves: list[dict[str, torch.Tensor]],
    images: Any,
    plain: list[dict[str, Any]],
    encoded: list[int],
) -> dict[str, Any]:
    """Another model of the same checkpoint (the other role's rank) given ``model``'s cached ViT outputs of the step
    through the ranks' hand-over functions: it encodes nothing, and its outputs and gradients are those computed
    without any cache; given altered outputs, its log-probs move (the handed-over values are the ones used)."""
    from mm_rl.workers.megatron_worker import add_vision_outputs, vision_outputs

    outputs = vision_outputs(model)
    result: dict[str, Any] = {"handed": len(outputs or {})}
    for label, given in (("taken", outputs), ("altered", {k: v + 0.5 for k, v in (outputs or {}).items()})):
        other = _build_and_load(model_json(), checkpoint)
        other.image_encoder.cache = {}
        other.image_encoder.encoder.register_forward_hook(
            lambda module, args, out: encoded.append(len(args[1].segments.cu_full_seqlens) - 1)
        )
        add_vision_outputs(other, given)
        encoded.clear()
        runs = [_pass(other, half, images) for half in halves]
        result[f"{label}_encoded"] = sum(encoded)
        result[f"{label}_outputs"] = max(
            (a["outputs"]["log_probs"] - b["outputs"]["log_probs"]).abs().max().item()
            for a, b in zip(plain, runs, strict=True)
        )
        if label == "taken":
            result["taken_grads"] = max(
                ((b["grads"][name] - grad).norm() / grad.norm().clamp_min(1e-30)).item()
                for a, b in zip(plain, runs, strict=True)
                for name, grad in a["grads"].items()
            )
    return result


def test_a_frozen_vit_encodes_each_image_once_per_step(checkpoints: dict[str, str], tmp_path: Path) -> None:
    """With the rank's per-step cache a frozen ViT encodes each of the step's images once, across micro-batches
    (a group split over two) and passes; log-probs, entropy and every gradient (the merger's included) stay."""
    spawn(_cache_rank, 1, checkpoints, str(tmp_path))
    (result,) = load_rank_results(tmp_path, 1)
    print(f"\nper-step cache: {result}")
    assert (result["plain_encoded"], result["cached_encoded"], result["again_encoded"]) == (3, 2, 2)
    assert result["outputs"] <= TOL and result["grads"] <= GRAD_RTOL and result["merger_trained"]
    # handed to the other role's rank: nothing encoded again, the same outputs and gradients; altered, they move
    assert result["handed"] == 2 and result["taken_encoded"] == 0 and result["altered_encoded"] == 0
    assert result["taken_outputs"] <= TOL and result["taken_grads"] <= GRAD_RTOL
    assert result["altered_outputs"] > 1e-3
