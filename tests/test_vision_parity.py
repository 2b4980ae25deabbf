"""Qwen2.5-VL vision encoder + merger on megatron-core vs transformers' ``model.visual`` (fp32).

The main process builds the tiny checkpoint, redraws every ViT / merger weight (the builder's norms are ones and
its biases zeros, which would hide a mis-mapped norm or bias), runs HF on processor outputs for one image and
for two images of different sizes (several windows, partial windows, two full-attention segments) and records
its outputs and the gradients of a fixed scalar loss. Spawned gloo ranks then load the same weights into
``QwenVisionModel`` and compare: TP=1 (one process) and TP=2 (two processes), each also with the ViT split
over two pipeline stages (blocks 0 | block 1 + merger, hidden state handed over by hand), frozen and unfrozen
ViT; the TP=2 gradients must also match the TP=1 ones. Weights and gradients go through ``mm_rl.convert`` only:
each rank loads the ``image_encoder.*`` tensors of its rank file of an hf2mg conversion of the perturbed
checkpoint (TP=1 / TP=2, ViT in one stage / over two), HF's gradients are mapped with ``hf_to_megatron`` and
TP-sharded gradients are gathered with ``merge_tp_shards``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from datetime import timedelta
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from mp_utils import spawn

MODEL_JSON = Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny.json"
SEED = 1234
IMAGES: dict[str, list[tuple[int, int]]] = {"one": [(224, 168)], "two": [(224, 168), (112, 140)]}  # (w, h)
TOL_OUT = 1e-4  # vs HF, fp32
TOL_GRAD_HF = 1e-4
TOL_GRAD_TP = 1e-5  # TP=2 vs TP=1
PROJECTOR_GRADS = (
    "projector.layernorm.weight",
    "projector.encoder.linear_fc1.weight",
    "projector.encoder.linear_fc1.bias",
    "projector.encoder.linear_fc2.weight",
    "projector.encoder.linear_fc2.bias",
)
PREFIX = "image_encoder."  # our vision model's tensors in the Megatron checkpoint


def _model_config() -> Any:
    from mm_rl.config.loader import load_section
    from mm_rl.config.schema import ModelConfig

    return load_section(ModelConfig, json.loads(MODEL_JSON.read_text()))


def _splits(model: Any) -> dict[str, tuple[list[int], list[int]]]:
    """(vit_pp_layers, llm_pp_layers): the ViT in one stage, or blocks 0 | block 1 + merger (+ the LLM)."""
    vit, llm = model.image_encoder.vision_encoder.num_layers, model.text_decoder.num_layers
    return {"full": ([vit], [llm]), "pp2": ([1, vit - 1], [0, llm])}


def _strip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len(PREFIX) :]: v for k, v in state.items() if k.startswith(PREFIX)}


# ---------------------------------------------------------------------------- HF reference (main process)
def _images(sizes: list[tuple[int, int]], seed: int) -> list[Any]:
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    return [
        Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy()) for w, h in sizes
    ]


def _perturb(visual: torch.nn.Module) -> None:
    """Redraw every weight so norms and biases are not the builder's ones / zeros."""
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in visual.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() > 1:
                param.copy_(noise * 0.1)
            else:
                param.copy_(noise * 0.2 + (1.0 if "norm" in name or "ln_q" in name else 0.0))


def _convert(hf_dir: Path, root: Path, model: Any) -> dict[str, str]:
    """hf2mg of the perturbed checkpoint at TP=1 / TP=2, each split as ``_splits`` gives; key 'tp{n}/{split}'."""
    from mm_rl.config.schema import Hf2MgCfg, HfConfig, ParallelConfig
    from mm_rl.convert import hf2mg

    out = {}
    for tp in (1, 2):
        for split, (vit, llm) in _splits(model).items():
            parallel = ParallelConfig(tp_size=tp, llm_pp_layers=llm, vit_pp_layers=vit)
            cfg = Hf2MgCfg(
                mm_dir=str(root / f"tp{tp}_{split}"), hf_config=HfConfig(hf_dir=str(hf_dir)), parallel_config=parallel
            )
            out[f"tp{tp}/{split}"] = str(hf2mg(cfg, model))
    return out


def _hf_grads_as_ours(grads: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """HF ``model.visual`` gradients -> our TP=1 names and layouts (``hf_to_megatron`` of a ViT-only stage)."""
    from mm_rl.config.schema import ParallelConfig
    from mm_rl.convert.mapping import hf_to_megatron
    from mm_rl.convert.stages import plan_pipeline

    vit, llm = model.image_encoder.vision_encoder.num_layers, model.text_decoder.num_layers
    pipeline = plan_pipeline(model, ParallelConfig(tp_size=1, llm_pp_layers=[0, llm], vit_pp_layers=[vit, 0]))
    ours = hf_to_megatron({f"visual.{k}": v for k, v in grads.items()}, model, pipeline, pp_rank=0, tp_rank=0)
    assert all(k.startswith(PREFIX) for k in ours), sorted(ours)
    return _strip(ours)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    from mm_rl.platform import cpu_wheels

    cpu_wheels.install()  # transformers' image utilities import torchvision when it is installed
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    from mm_rl.demo.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("vision")
    ckpt = build_tiny_checkpoint(root / "tiny", seed=0)
    processor = AutoImageProcessor.from_pretrained(ckpt)
    hf_model = Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    visual = hf_model.model.visual
    _perturb(visual)
    hf_model.save_pretrained(root / "hf")
    model = _model_config()
    mm_dirs = _convert(root / "hf", root / "mm", model)

    cases = {}
    for index, (case, sizes) in enumerate(IMAGES.items()):
        inputs = processor(images=_images(sizes, SEED + index), return_tensors="pt")
        pixel_values, grid_thw = inputs["pixel_values"], inputs["image_grid_thw"]
        visual.zero_grad(set_to_none=True)
        out = visual(pixel_values, grid_thw).pooler_output
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(index)) / out.numel() ** 0.5
        (out * probe).sum().backward()
        grads = _hf_grads_as_ours({n: p.grad.detach().clone() for n, p in visual.named_parameters()}, model)
        cases[case] = {
            "pixel_values": pixel_values,
            "grid_thw": grid_thw,
            "out": out.detach(),
            "probe": probe,
            "grads": grads,
        }
    assert cases["two"]["grid_thw"].tolist() == [[1, 12, 16], [1, 10, 8]]  # 2x2 and 3x2 windows, partial ones

    path = root / "reference.pt"
    torch.save({"mm_dirs": mm_dirs, "cases": cases}, path)
    return str(path)


# ---------------------------------------------------------------------------- workers (spawned processes)
def _init(rank: int, world: int, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mm_rl.platform.device import dist_backend, setup_process

    setup_process(num_threads=1)
    torch.distributed.init_process_group(
        dist_backend(),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(SEED)


def _configs(**encoder_changes: Any) -> tuple[Any, Any]:
    image = _model_config().image_encoder
    projector_changes = {
        k[len("projector_") :]: encoder_changes.pop(k) for k in list(encoder_changes) if k.startswith("projector_")
    }
    return (
        dataclasses.replace(image.vision_encoder, **encoder_changes),
        dataclasses.replace(image.vision_projector, **projector_changes),
    )


def _build(
    layers: tuple[int, int] | None = None, freeze_encoder: bool = True, freeze_projector: bool = False, **changes: Any
) -> torch.nn.Module:
    """The vision model (all blocks), or the stage holding blocks layers[0] .. layers[1] - 1."""
    from mm_rl.models.qwen_vl.vision import QwenVisionModel

    encoder, projector = _configs(**changes)
    start, stop = layers or (0, encoder.num_layers)
    return QwenVisionModel(
        encoder,
        projector,
        projector.hidden_size,
        num_layers=stop - start,
        layer_offset=start,
        pre_process=start == 0,
        post_process=stop == encoder.num_layers,
        freeze_encoder=freeze_encoder,
        freeze_projector=freeze_projector,
    )


@cache
def _rank_state(mm_dir: str, tp_rank: int, pp_rank: int, pp: int) -> dict[str, torch.Tensor]:
    """The ``image_encoder.*`` tensors of one rank file of an hf2mg output, prefix stripped."""
    from mm_rl.convert.layout import RELEASE, rank_file

    return _strip(torch.load(rank_file(Path(mm_dir) / RELEASE, tp_rank, pp_rank, pp), weights_only=True)["model"])


def _load(model: torch.nn.Module, mm_dir: str, pp_rank: int = 0, pp: int = 1) -> None:
    """This TP rank's tensors of pipeline stage ``pp_rank`` (of ``pp``), exactly the model's (strict)."""
    from megatron.core import parallel_state

    model.load_state_dict(
        _rank_state(mm_dir, parallel_state.get_tensor_model_parallel_rank(), pp_rank, pp), strict=True
    )


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, TP-gathered into the TP=1 layout by ``merge_tp_shards``."""
    from megatron.core import parallel_state

    from mm_rl.convert.mapping import merge_tp_shards

    group = parallel_state.get_tensor_model_parallel_group()
    config = _model_config()
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        parts = [torch.empty_like(param.grad) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, param.grad.contiguous(), group=group)
        grads[name] = merge_tp_shards(PREFIX + name, parts, config)
    return grads


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _run(model: torch.nn.Module, case: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(case["pixel_values"], case["grid_thw"])
    (out * case["probe"]).sum().backward()
    return out


def _parity(ref: dict[str, Any], result: dict[str, Any], mm_dir: str) -> None:
    """Full model, frozen ViT (both cases) and unfrozen ViT ('two'): outputs and gradients vs HF."""
    diffs, checks, grads = result["diffs"], result["checks"], result["grads"]
    for name, case in ref["cases"].items():
        model = _build()
        _load(model, mm_dir)
        out = _run(model, case)
        diffs[f"{name}/out"] = _max_diff(out.detach(), case["out"])
        got = _full_grads(model)
        checks[f"{name}/frozen: only projector grads"] = sorted(got) == sorted(PROJECTOR_GRADS)
        checks[f"{name}/frozen: encoder requires_grad off"] = not any(
            p.requires_grad for p in model.encoder.parameters()
        )
        for key in PROJECTOR_GRADS:
            diffs[f"{name}/grad_hf:{key}"] = _max_diff(got[key], case["grads"][key])
            grads[f"{name}/frozen/{key}"] = got[key]

    case = ref["cases"]["two"]
    model = _build(freeze_encoder=False)
    _load(model, mm_dir)
    diffs["two/unfrozen/out"] = _max_diff(_run(model, case).detach(), case["out"])
    got = _full_grads(model)
    checks["two/unfrozen: every param has a grad"] = len(got) == len(list(model.parameters()))
    for key, grad in got.items():
        diffs[f"two/unfrozen/grad_hf:{key}"] = _max_diff(grad, case["grads"][key])
        grads[f"two/unfrozen/{key}"] = grad


def _pipeline_split(ref: dict[str, Any], result: dict[str, Any], mm_dir: str) -> None:
    """Stage 0 = patch embed + block 0, stage 1 = block 1 + merger, each loaded from its own pipeline rank's file
    of the ViT-split conversion; the hidden state is handed over by hand."""
    case, tag = ref["cases"]["two"], "pp2"
    stage0, stage1 = _build(layers=(0, 1)), _build(layers=(1, 2))
    _load(stage0, mm_dir, pp_rank=0, pp=2)
    _load(stage1, mm_dir, pp_rank=1, pp=2)
    hidden = stage0(case["pixel_values"], case["grid_thw"])
    result["checks"][f"{tag}: hidden [N, 1, vit_hidden], no grad when frozen"] = (
        tuple(hidden.shape) == (case["pixel_values"].size(0), 1, 64) and not hidden.requires_grad
    )
    stage1.set_input_tensor([hidden])
    out = stage1(None, case["grid_thw"])
    result["diffs"][f"{tag}/out"] = _max_diff(out.detach(), case["out"])
    (out * case["probe"]).sum().backward()
    got = _full_grads(stage1)
    for key in PROJECTOR_GRADS:
        result["diffs"][f"{tag}/grad_hf:{key}"] = _max_diff(got[key], case["grads"][key])


def _switches(ref: dict[str, Any], result: dict[str, Any]) -> None:
    """LayerNorm / GELU / quick-GELU / ReLU / plain-MLP variants build, run forward and backward (no parity)."""
    case = ref["cases"]["two"]
    variants = {
        "layernorm_gelu": {
            "normalization": "LayerNorm",
            "activation_func": "gelu",
            "projector_normalization": "LayerNorm",
            "projector_activation_func": "gelu",
        },
        "fusedlayernorm_quick_gelu": {
            "normalization": "FusedLayerNorm",
            "activation_func": "quick_gelu",
            "projector_activation_func": "relu",
        },
        "relu_no_swiglu": {"activation_func": "relu", "swiglu": False, "projector_activation_func": "silu"},
    }
    for name, changes in variants.items():
        model = _build(freeze_encoder=False, **changes)
        out = _run(model, case)
        grads = [p.grad for p in model.parameters()]
        norm_bias = "encoder.blocks.layers.0.input_layernorm.bias" in model.state_dict()
        result["checks"][f"switch {name}: runs"] = (
            out.shape == case["out"].shape
            and bool(torch.isfinite(out).all())
            and all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
            and norm_bias == ("LayerNorm" in changes.get("normalization", "RMSNorm"))
        )


def _worker(rank: int, world: int, port: int, ref_path: str, out_dir: str) -> None:
    _init(rank, world, port)
    ref = torch.load(ref_path, weights_only=True)
    result: dict[str, Any] = {"diffs": {}, "checks": {}, "grads": {}}
    _parity(ref, result, ref["mm_dirs"][f"tp{world}/full"])
    _pipeline_split(ref, result, ref["mm_dirs"][f"tp{world}/pp2"])
    model = _build(freeze_projector=True)
    result["checks"]["freeze_projector: nothing trains"] = not any(p.requires_grad for p in model.parameters())
    if world == 1:
        _switches(ref, result)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def _spawn(ref_path: str, out_dir: Path, world: int) -> list[dict[str, Any]]:
    spawn(_worker, world, ref_path, str(out_dir))
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(world)]


# ------------------------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def tp1(reference: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _spawn(reference, tmp_path_factory.mktemp("tp1"), world=1)[0]


@pytest.fixture(scope="module")
def tp2(reference: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(reference, tmp_path_factory.mktemp("tp2"), world=2)


def _assert_diffs(diffs: dict[str, float], prefix: str = "") -> None:
    selected = {k: v for k, v in diffs.items() if k.startswith(prefix)}
    assert selected, prefix
    for kind in ("out", "grad_hf"):
        keys = [k for k in selected if kind in k]
        if keys:
            worst = max(keys, key=selected.get)
            print(f"max {kind} diff vs HF {selected[worst]:.2e} ({worst})")
    tol = {k: TOL_OUT if k.endswith("/out") else TOL_GRAD_HF for k in selected}
    too_far = {k: v for k, v in selected.items() if not v <= tol[k]}
    assert not too_far, too_far


def _assert_checks(checks: dict[str, bool]) -> None:
    failed = [k for k, ok in checks.items() if not ok]
    assert not failed, failed


def test_tp1_matches_hf(tp1: dict[str, Any]) -> None:
    _assert_diffs(tp1["diffs"], "one/")
    _assert_diffs(tp1["diffs"], "two/")
    _assert_checks({k: v for k, v in tp1["checks"].items() if not k.startswith("switch")})


def test_tp1_pipeline_split_matches_hf(tp1: dict[str, Any]) -> None:
    _assert_diffs(tp1["diffs"], "pp2/")


def test_norm_and_activation_switches_build_and_run(tp1: dict[str, Any]) -> None:
    switches = {k: v for k, v in tp1["checks"].items() if k.startswith("switch")}
    assert len(switches) == 3
    _assert_checks(switches)


def test_tp2_matches_hf_and_tp1(tp1: dict[str, Any], tp2: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(tp2):
        _assert_diffs(result["diffs"], "one/")
        _assert_diffs(result["diffs"], "two/")
        _assert_diffs(result["diffs"], "pp2/")
        _assert_checks(result["checks"])
        assert result["grads"].keys() == tp1["grads"].keys()
        vs_tp1 = {k: _max_diff(g, tp1["grads"][k]) for k, g in result["grads"].items()}
        worst = max(vs_tp1, key=vs_tp1.get)
        print(f"rank {rank}: max grad diff TP2 vs TP1 {vs_tp1[worst]:.2e} ({worst})")
        assert all(v <= TOL_GRAD_TP for v in vs_tp1.values()), vs_tp1
