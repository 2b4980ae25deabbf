"""LoRA on the megatron actor (``mm_rl.models.lora``) and its conversions (``mm_rl.convert.lora``), on the tiny
Qwen2.5-VL with its biases and norms redrawn (``test_model_parity``'s checkpoint and inputs), adapters on the LLM,
the ViT and the merger.

At TP1 and TP2 (sequence parallelism on): with B = 0 the adapted model's outputs equal the base model's exactly;
with random adapters (drawn in HF layout and split by the tensor table, the same at both layouts) the adapters
switched off give the base model's outputs (the reference pass), merging W + scale * B @ A into a plain model
gives the adapted outputs (<= 1e-5), only adapters get gradients, and TP2's outputs and adapter gradients (merged
into HF layout) equal TP1's. Then mg2hf of a LoRA checkpoint (TP2 adapter files naming their base): the merged HF
checkpoint reproduces the megatron model's outputs in transformers, and PEFT loads the adapter directory onto the
base checkpoint with the merged checkpoint's logits.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from mp_utils import gather_cat, gather_list, load_rank_results, save_rank_result, shutdown, spawn
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
ADAPTERS = {"rank": RANK, "alpha": ALPHA, "vision": True}
ITERATION = 1


def _lora_actor() -> Any:
    from mm_rl.config.schema import ActorConfig, LoRAConfig

    return ActorConfig(lora=LoRAConfig(**ADAPTERS))


def _adapted_bounds(model: Any, tp: int) -> list[Any]:
    from megatron.core import parallel_state

    from mm_rl.convert.mapping import stage_tensors
    from mm_rl.sync.sender import stage_pipeline

    pipeline = stage_pipeline(model.model_cfg, tp, parallel_state.get_pipeline_model_parallel_world_size())
    stage = pipeline.stages[parallel_state.get_pipeline_model_parallel_rank()]
    names = {name for name, _ in model.named_parameters()}
    return [b for b in stage_tensors(model.model_cfg, stage) if b.mg.removesuffix(".weight") + ".lora_a" in names]


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
            _draw(b_name + ".B", (rows, RANK), 0.3 / RANK**0.5),
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


def _hf_grads(model: Any, tp: int) -> dict[str, torch.Tensor]:
    """Every adapter's gradient in HF layout (``<hf weight>.A`` / ``.B``), gathered over TP."""
    from megatron.core import parallel_state

    from mm_rl.convert.lora import hf_adapters
    from mm_rl.convert.mapping import model_dims

    group, out = parallel_state.get_tensor_model_parallel_group(), {}
    for bound in _adapted_bounds(model, tp):
        key = bound.mg.removesuffix(".weight")
        grads = [gather_list(model.get_parameter(f"{key}.lora_{m}").grad, group) for m in "ab"]
        for name, a, b in hf_adapters(bound, model_dims(model.model_cfg), *grads):
            out[name + ".A"], out[name + ".B"] = a.clone(), b.clone()
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
    _init(rank, world, port, case["json"], tp=world)
    from mm_rl.models.lora import adapter_state, adapters_enabled, export_state, is_adapter_key

    batches = torch.load(Path(shared) / "inputs.pt", weights_only=False)["batches"]
    base = _full(run_schedule(_build_and_load(case["json"], case["mm_dir"]), batches), batches)
    model = _build_and_load(case["json"], case["mm_dir"], _lora_actor())
    result: dict[str, Any] = {"zero_b": _max_diff(_full(run_schedule(model, batches), batches), base)}
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    result["only_adapters_train"] = with_grad == {n for n, _ in model.named_parameters() if is_adapter_key(n)}
    result["adapters"] = len(with_grad) // 2
    result["adapter_numel"] = sum(p.numel() for n, p in model.named_parameters() if is_adapter_key(n))
    _clear_grads(model)
    _set_random_adapters(model, world)
    adapted = _full(run_schedule(model, batches), batches)
    result["grads"] = _hf_grads(model, world)
    result["adapted_vs_base"] = _max_diff(adapted, base)
    with adapters_enabled(model, False):
        result["off_vs_base"] = _max_diff(_full(run_schedule(model, batches), batches), base)
    plain = _build_and_load(case["json"], None)
    plain.load_state_dict(dict(export_state(model)))
    result["merged_vs_adapted"] = _max_diff(_full(run_schedule(plain, batches), batches), adapted)
    result["outputs"] = adapted
    if case.get("save"):  # a LoRA checkpoint's rank file: adapters + the base they belong to
        path = Path(case["save"]) / f"iter_{ITERATION:07d}" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        lora = {"base": str(Path(case["mm_dir"]) / "release"), "rank": RANK, "alpha": ALPHA, "scale": ALPHA / RANK}
        torch.save({"model": adapter_state(model), "lora": lora, "checkpoint_version": 3.0}, path)
    save_rank_result(out_dir, rank, result)
    shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora")
    hf = build_hf_checkpoint(root / "untied", tied=False)
    data = model_json()
    torch.save({"batches": make_micro_batches()}, root / "inputs.pt")
    out: dict[str, Any] = {"root": root, "hf": hf, "json": data}
    for tp in (1, 2):
        case = {"json": data, "mm_dir": str(convert(hf, root / f"mm_tp{tp}", data, tp))}
        if tp == 2:
            case["save"] = str(root / "ckpt")
        (root / f"out{tp}").mkdir()
        spawn(_worker, tp, case, str(root), str(root / f"out{tp}"))
        out[tp] = load_rank_results(root / f"out{tp}", tp)[0]
    (root / "ckpt" / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    return out


def _planned_adapters(data: dict[str, Any], tp: int) -> float:
    from mm_rl.config.plan import adapter_parameters

    model = load_model_config(data)
    llm, block, merger = adapter_parameters(model, _lora_actor().lora, tp)
    return model.text_decoder.num_layers * llm + model.image_encoder.vision_encoder.num_layers * block + merger


@pytest.mark.parametrize("tp", [1, 2])
def test_adapters_on_off_merged(runs: dict[str, Any], tp: int) -> None:
    run = runs[tp]
    print(
        f"\nTP{tp}: {run['adapters']} adapted linears, "
        + ", ".join(f"{k} {run[k]:.2e}" for k in ("zero_b", "adapted_vs_base", "off_vs_base", "merged_vs_adapted"))
    )
    assert run["adapters"] == 4 * 4 + 4 * 2 + 2  # LLM: qkv, proj, fc1, fc2 x 4 layers; ViT: 4 x 2 blocks; merger 2
    assert run["adapter_numel"] == _planned_adapters(runs["json"], tp)  # what the memory plan counts per rank
    assert run["zero_b"] == 0.0  # B = 0 at the start: exactly the base model
    assert run["only_adapters_train"]
    assert run["adapted_vs_base"] > 0.5  # the random adapters change the model: the checks below can fail
    assert run["off_vs_base"] <= 1e-6  # the reference pass: the actor without adapters is the base model
    assert run["merged_vs_adapted"] <= 1e-5


def test_tp2_matches_tp1(runs: dict[str, Any]) -> None:
    """The adapters split with their base: TP2's outputs and adapter gradients are TP1's."""
    outputs = _max_diff(runs[2]["outputs"], runs[1]["outputs"])
    grads = {name: (g - runs[1]["grads"][name]).abs().max().item() for name, g in runs[2]["grads"].items()}
    worst = max(grads, key=grads.__getitem__)
    print(f"\nTP2 vs TP1: logits {outputs:.2e}, adapter grads max {grads[worst]:.2e} ({worst})")
    assert set(grads) == set(runs[1]["grads"]) and len(grads) == 2 * (4 * 7 + 2 * 5 + 2)  # per HF linear: A, B
    assert min(g.abs().max().item() for g in runs[1]["grads"].values()) > 0  # every adapter matrix gets a gradient
    assert outputs <= LOGIT_TOL
    assert grads[worst] <= GRAD_TOL


def test_mg2hf_merges_and_writes_a_peft_adapter(runs: dict[str, Any], tmp_path: Path) -> None:
    """mg2hf of TP2 adapter files: transformers' merged model gives the megatron model's logits, and PEFT's
    adapter directory on the base checkpoint gives the merged model's."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from mm_rl.config.schema import Mg2HfCfg, ParallelConfig
    from mm_rl.convert.lora import ADAPTER_DIR
    from mm_rl.convert.mg2hf import mg2hf

    model_cfg = load_model_config(runs["json"])
    parallel = ParallelConfig(tp_size=2, llm_pp_layers=[4], vit_pp_layers=[2])
    cfg = Mg2HfCfg(load_dir=str(runs["root"] / "ckpt"), save_hf_dir=str(tmp_path / "hf"), parallel_config=parallel)
    out = mg2hf(cfg, model_cfg, runs["hf"])
    adapter = json.loads((out / ADAPTER_DIR / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (RANK, ALPHA)
    batches = make_micro_batches()

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
    base = AutoModelForImageTextToText.from_pretrained(runs["hf"], dtype=torch.float32).eval()
    peft = logits(PeftModel.from_pretrained(base, out / ADAPTER_DIR).eval())
    vs_megatron, vs_peft = _max_diff(merged, runs[2]["outputs"]), _max_diff(peft, merged)
    print(f"\nmerged HF vs megatron TP2 {vs_megatron:.2e}, PEFT on the base vs merged {vs_peft:.2e}")
    assert vs_megatron <= LOGIT_TOL
    assert vs_peft <= 1e-5
