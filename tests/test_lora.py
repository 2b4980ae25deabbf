"""LoRA on the megatron actor (``mm_rl.models.lora``) and its conversions (``mm_rl.convert.lora``), per family on
sharp random checkpoints (``test_model_parity``'s tiny Qwen2.5-VL with adapters on the LLM, the ViT and the merger;
``test_family_parity``'s tiny Qwen3.5, adapters on its attention and Gated DeltaNet linears; its Qwen3-VL-MoE, with
adapters on the routed experts too).

At one rank and at TP2 (EP2 for the MoE, each rank holding two of the four experts): with B = 0 the adapted model's
outputs equal the base model's exactly; with random adapters (drawn in HF layout and split by the tensor table, the
same at every layout) the adapters switched off give the base model's outputs (the reference pass), merging
W + scale * B @ A into a plain model gives the adapted outputs (<= 1e-5), only adapters get gradients, the memory
plan counts the adapters the model holds, and the parallel layout's outputs and adapter gradients (merged into HF
layout) equal the single rank's. Then mg2hf of the parallel layout's adapter files (naming their base): the merged HF
checkpoint reproduces the megatron model's outputs in transformers, and PEFT loads the adapter directory onto the
base checkpoint with the merged checkpoint's logits (adapters on experts: no PEFT directory).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from mp_utils import gather_cat, gather_list, load_rank_results, save_rank_result, shutdown, spawn
from test_family_parity import SCALE as parity_scale
from test_family_parity import build_checkpoint
from test_family_parity import model_json as family_json
from test_model_parity import (
    GRAD_TOL,
    IMAGE,
    LOGIT_TOL,
    _build_and_load,
    _init,
    build_hf_checkpoint,
    convert,
    load_model_config,
    make_micro_batches,
    model_json,
    run_schedule,
)

RANK, ALPHA = 4, 8.0
ITERATION = 1
MERGED_TOL = 1e-5  # merged vs adapted forward, fp32
# The random Qwen3.5 amplifies fp32 rounding through its recurrent layers: merging moves its logits (std 2.0) by
# 4.8e-5 - 8.0e-5 (its TP2 vs one rank by 3.2e-5, its parity with transformers 9.2e-5), and the MoE's routing its
# logits (std 1.5) by 1.6e-5: their bound is their parity's. The Qwen3.5 is drawn at scale 1.0 (test_family_parity
# draws it at 1.5, where transformers' merged model came 1.02e-4 from megatron's), as that test draws its
# Qwen3.5-MoE; its logits stay sharp.
NOISY = {"qwen3_5": LOGIT_TOL, "qwen3_vl_moe": LOGIT_TOL}
SCALE = {"qwen3_5": 1.0}
# family: (ViT patch size, adapter settings beside rank and alpha, the parallel layout (TP, EP))
FAMILIES = {
    "qwen2_5_vl": (14, {"vision": True}, (2, 1)),
    "qwen3_5": (16, {}, (2, 1)),
    "qwen3_vl_moe": (16, {"experts": True}, (1, 2)),
}


def _lora_actor(family: str) -> Any:
    from mm_rl.config.schema import ActorConfig, LoRAConfig

    return ActorConfig(lora=LoRAConfig(rank=RANK, alpha=ALPHA, **FAMILIES[family][1]))


def _adapted_bounds(model: Any, tp: int) -> list[Any]:
    from megatron.core import parallel_state

    from mm_rl.convert.mapping import stage_tensors
    from mm_rl.sync.sender import stage_pipeline

    ep = parallel_state.get_expert_model_parallel_world_size()
    pipeline = stage_pipeline(model.model_cfg, tp, parallel_state.get_pipeline_model_parallel_world_size(), ep)
    stage = pipeline.stages[parallel_state.get_pipeline_model_parallel_rank()]
    names = {name for name, _ in model.named_parameters()}
    bounds = stage_tensors(model.model_cfg, stage, parallel_state.get_expert_model_parallel_rank(), ep)
    return [b for b in bounds if b.mg.removesuffix(".weight") + ".lora_a" in names]


def _draw(name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * std


def _hf_adapters(bound: Any, dims: dict[str, int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random (A, B) per HF part of ``bound``'s linear, the whole half shared by a fused linear's parts."""
    from mm_rl.convert.mapping import hf_shape

    shapes = [hf_shape(bound.entry, part, dims) for part in range(len(bound.hf))]
    out = {}
    for name, (rows, cols) in zip(bound.hf, shapes, strict=True):
        a_name = bound.hf[0] if bound.entry.split == 0 else name  # A shared by the parts of a column linear
        b_name = name if bound.entry.split == 0 else bound.hf[0]
        out[name] = (
            _draw(a_name + ".A", (RANK, cols), cols**-0.5),
            _draw(b_name + ".B", (rows, RANK), 0.1 / RANK**0.5),
        )
    return out


def _set_random_adapters(model: Any, tp: int) -> None:
    from megatron.core import parallel_state

    from mm_rl.convert.lora import shard_adapters
    from mm_rl.convert.mapping import model_dims

    dims, rank = model_dims(model.model_cfg), parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for bound in _adapted_bounds(model, tp):
            a, b = shard_adapters(bound, dims, rank, tp, _hf_adapters(bound, dims))
            key = bound.mg.removesuffix(".weight")
            model.get_parameter(key + ".lora_a").copy_(a)
            model.get_parameter(key + ".lora_b").copy_(b)


def _hf_adapters_of(model: Any, tp: int, grads: bool) -> dict[str, torch.Tensor]:
    """Every adapter's values (or gradients) in HF layout (``<hf weight>.A`` / ``.B``), gathered over TP."""
    from megatron.core import parallel_state

    from mm_rl.convert.lora import hf_adapters
    from mm_rl.convert.mapping import model_dims

    group, out = parallel_state.get_tensor_model_parallel_group(), {}
    dp = parallel_state.get_data_parallel_world_size()
    for bound in _adapted_bounds(model, tp):
        key = bound.mg.removesuffix(".weight")
        params = [model.get_parameter(f"{key}.lora_{m}") for m in "ab"]
        shards = [gather_list(p.grad if grads else p.detach(), group) for p in params]
        # an expert's gradient saw every DP rank's tokens (each rank ran the same batches): megatron's DP averaging
        share = dp if grads and bound.entry.expert else 1
        for name, a, b in hf_adapters(bound, model_dims(model.model_cfg), *shards):
            out[name + ".A"], out[name + ".B"] = a / share, b / share
    return out


def _full(captured: list[dict[str, torch.Tensor]], batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Each micro-batch's logits of its real tokens, gathered over TP."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    return [
        gather_cat(out["logits"], group, dim=-1)[batch["attention_mask"].bool()]
        for out, batch in zip(captured, batches, strict=True)
    ]


def _max_diff(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))


def _clear_grads(model: Any) -> None:
    for param in model.parameters():
        param.grad = None


def _worker(rank: int, world: int, port: int, case: dict[str, Any], shared: str, out_dir: str) -> None:
    tp, ep = case["layout"]
    _init(rank, world, port, case["json"], tp=tp, ep=ep)
    from mm_rl.models.lora import adapter_state, adapters_enabled, export_state, is_adapter_key

    batches = torch.load(Path(shared) / "inputs.pt", weights_only=False)["batches"]
    base = _full(run_schedule(_build_and_load(case["json"], case["mm_dir"]), batches), batches)
    model = _build_and_load(case["json"], case["mm_dir"], _lora_actor(case["family"]))
    result: dict[str, Any] = {"zero_b": _max_diff(_full(run_schedule(model, batches), batches), base)}
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    result["only_adapters_train"] = with_grad == {n for n, _ in model.named_parameters() if is_adapter_key(n)}
    result["adapters"] = len(with_grad) // 2
    result["adapter_numel"] = sum(p.numel() for n, p in model.named_parameters() if is_adapter_key(n))
    _clear_grads(model)
    result["initial"] = _hf_adapters_of(model, tp, grads=False)
    _set_random_adapters(model, tp)
    adapted = _full(run_schedule(model, batches), batches)
    result["grads"] = _hf_adapters_of(model, tp, grads=True)
    result["adapted_vs_base"] = _max_diff(adapted, base)
    with adapters_enabled(model, False):
        result["off_vs_base"] = _max_diff(_full(run_schedule(model, batches), batches), base)
    plain = _build_and_load(case["json"], None)
    plain.load_state_dict(dict(export_state(model)))
    result["merged_vs_adapted"] = _max_diff(_full(run_schedule(plain, batches), batches), adapted)
    result["outputs"] = adapted
    result["logit_std"] = torch.cat(adapted).std().item()
    if case.get("save"):  # a LoRA checkpoint's rank file: adapters + the base they belong to
        from megatron.core import parallel_state

        from mm_rl.convert.layout import rank_file

        path = rank_file(
            Path(case["save"]) / f"iter_{ITERATION:07d}",
            parallel_state.get_tensor_model_parallel_rank(),
            0,
            1,
            parallel_state.get_expert_model_parallel_rank(),
            ep,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        lora = {"base": str(Path(case["mm_dir"]) / "release"), "rank": RANK, "alpha": ALPHA, "scale": ALPHA / RANK}
        torch.save({"model": adapter_state(model), "lora": lora, "checkpoint_version": 3.0}, path)
    save_rank_result(out_dir, rank, result)
    shutdown()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    family = request.param
    patch, _, parallel = FAMILIES[family]
    root = tmp_path_factory.mktemp(f"lora_{family}")
    if family == "qwen2_5_vl":
        hf, data = build_hf_checkpoint(root / "untied", tied=False), model_json()
    else:
        with pytest.MonkeyPatch.context() as patch_scale:
            for name, scale in SCALE.items():
                patch_scale.setitem(parity_scale, name, scale)
            hf = build_checkpoint(root, family)
        data = family_json(hf)
    # the image micro-batches: the adapters do not depend on the inputs' kind (videos: test_model_parity's)
    torch.save({"batches": make_micro_batches(3 * 2 * patch**2, videos=False)}, root / "inputs.pt")
    out: dict[str, Any] = {"root": root, "hf": hf, "json": data, "family": family, "layout": parallel}
    for name, (tp, ep) in (("single", (1, 1)), ("parallel", parallel)):
        case = {
            "json": data,
            "family": family,
            "layout": (tp, ep),
            "mm_dir": str(convert(hf, root / name, data, tp, ep)),
        }
        if name == "parallel":
            case["save"] = str(root / "ckpt")
        (root / f"out_{name}").mkdir()
        spawn(_worker, tp * ep, case, str(root), str(root / f"out_{name}"))
        results = load_rank_results(root / f"out_{name}", tp * ep)
        out[name] = {
            **results[0],
            **{key: {k: v for r in results for k, v in r[key].items()} for key in ("grads", "initial")},
        }
    (root / "ckpt" / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    return out


def _planned_adapters(runs: dict[str, Any], layout: str) -> float:
    from mm_rl.config.plan import adapter_parameters

    model = load_model_config(runs["json"])
    tp, ep = runs["layout"] if layout == "parallel" else (1, 1)
    llm, block, merger = adapter_parameters(model, _lora_actor(runs["family"]).lora, tp, ep)
    vit = model.image_encoder.vision_encoder.num_layers
    return model.text_decoder.num_layers * llm + vit * block + (merger if block else 0.0)


@pytest.mark.parametrize("layout", ["single", "parallel"])
def test_adapters_on_off_merged(runs: dict[str, Any], layout: str) -> None:
    run = runs[layout]
    print(
        f"\n{runs['family']} {layout}: {run['adapters']} adapted linears, "
        + ", ".join(
            f"{k} {run[k]:.2e}" for k in ("logit_std", "zero_b", "adapted_vs_base", "off_vs_base", "merged_vs_adapted")
        )
    )
    if runs["family"] == "qwen2_5_vl":  # LLM: qkv, proj, fc1, fc2 x 4 layers; ViT: 4 x 2 blocks; the merger's 2
        assert run["adapters"] == 4 * 4 + 4 * 2 + 2
    assert run["adapter_numel"] == _planned_adapters(runs, layout)  # what the memory plan counts per rank
    assert run["zero_b"] == 0.0  # B = 0 at the start: exactly the base model
    assert run["only_adapters_train"]
    assert run["adapted_vs_base"] > 0.1  # the random adapters change the model: the checks below can fail
    assert run["off_vs_base"] <= 1e-6  # the reference pass: the actor without adapters is the base model
    assert run["merged_vs_adapted"] <= NOISY.get(runs["family"], MERGED_TOL)


def test_parallel_layout_matches_one_rank(runs: dict[str, Any]) -> None:
    """The adapters split with their base (TP), and experts' adapters live with their experts (EP): the parallel
    layout's outputs and adapter gradients are one rank's."""
    single, parallel = runs["single"], runs["parallel"]
    outputs = _max_diff(parallel["outputs"], single["outputs"])
    grads = {name: (g - single["grads"][name]).abs().max().item() for name, g in parallel["grads"].items()}
    worst = max(grads, key=grads.__getitem__)
    print(
        f"\n{runs['family']} {runs['layout']} vs one rank: logits {outputs:.2e}, adapter grads max {grads[worst]:.2e}"
    )
    assert set(grads) == set(single["grads"])
    # the adapters start alike at any layout: A drawn whole per linear (by its global name), B zero
    assert all(torch.equal(a, single["initial"][name]) for name, a in parallel["initial"].items())
    assert all(a.abs().sum() > 0 for name, a in single["initial"].items() if name.endswith(".A"))
    assert min(g.abs().max().item() for g in single["grads"].values()) > 0  # every adapter matrix gets a gradient
    assert outputs <= LOGIT_TOL
    assert grads[worst] <= GRAD_TOL


def test_mg2hf_merges_and_writes_a_peft_adapter(runs: dict[str, Any], tmp_path: Path) -> None:
    """mg2hf of the parallel layout's adapter files: transformers' merged model gives the megatron model's logits,
    and PEFT's adapter directory on the base checkpoint gives the merged model's."""
    from transformers import AutoModelForImageTextToText

    from mm_rl.config.schema import Mg2HfCfg, ParallelConfig
    from mm_rl.convert.lora import ADAPTER_DIR
    from mm_rl.convert.mg2hf import mg2hf

    model_cfg = load_model_config(runs["json"])
    tp, ep = runs["layout"]
    layers = [model_cfg.text_decoder.num_layers], [model_cfg.image_encoder.vision_encoder.num_layers]
    parallel = ParallelConfig(tp_size=tp, ep_size=ep, llm_pp_layers=layers[0], vit_pp_layers=layers[1])
    cfg = Mg2HfCfg(load_dir=str(runs["root"] / "ckpt"), save_hf_dir=str(tmp_path / "hf"), parallel_config=parallel)
    out = mg2hf(cfg, model_cfg, runs["hf"])
    patch = FAMILIES[runs["family"]][0]
    batches = make_micro_batches(3 * 2 * patch**2, videos=False)

    def logits(model: Any) -> list[torch.Tensor]:
        with torch.no_grad():
            return [
                model(
                    input_ids=b["input_ids"],
                    attention_mask=b["attention_mask"],
                    mm_token_type_ids=(b["input_ids"] == IMAGE).int(),
                    **{k: b[k] for k in ("pixel_values", "image_grid_thw") if k in b},
                ).logits[b["attention_mask"].bool()]
                for b in batches
            ]

    merged = logits(AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval())
    vs_megatron = _max_diff(merged, runs["parallel"]["outputs"])
    print(f"\n{runs['family']}: merged HF vs megatron {vs_megatron:.2e}", end="")
    assert vs_megatron <= LOGIT_TOL
    if runs["family"] == "qwen3_vl_moe":  # adapters on experts: transformers fuses a layer's experts
        assert not (out / ADAPTER_DIR).exists()
        return
    from peft import PeftModel

    adapter = json.loads((out / ADAPTER_DIR / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (RANK, ALPHA)
    base = AutoModelForImageTextToText.from_pretrained(runs["hf"], dtype=torch.float32).eval()
    vs_peft = _max_diff(logits(PeftModel.from_pretrained(base, out / ADAPTER_DIR).eval()), merged)
    print(f", PEFT on the base vs merged {vs_peft:.2e}")
    assert vs_peft <= NOISY.get(runs["family"], MERGED_TOL)
