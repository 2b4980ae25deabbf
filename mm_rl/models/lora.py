"""LoRA on megatron-core's tensor-parallel linears: frozen base, trained low-rank adapters, switchable.

An adapted linear keeps its weight W (frozen) and gains A [r, in] and B [out, r]:
``y = W x + scale * B A dropout(x)`` with ``scale = alpha / r``. The adapters are split over tensor parallelism
as their base is, so that neither the output nor any gradient depends on TP (Megatron-Bridge's
``ParallelLinearAdapter`` splits them the same way):

- column-parallel base (``linear_qkv``, ``linear_fc1``, ``in_proj``: W split by output rows): B split by rows
  like W (a rank's fused q / k / v or gate / up rows of B line up with W's), A whole on every rank. Under sequence
  parallelism the input is gathered over the sequence first, as the base linear gathers it.
- row-parallel base (``linear_proj``, ``linear_fc2``, ``out_proj``: W split by input columns): A split by columns
  like W, its partial product all-reduced, B whole on every rank; under sequence parallelism the result is split
  over the sequence as the base's reduce-scatter splits its own.

megatron's mappings give the replicated halves their whole gradient on every TP rank (``copy_to`` all-reduces
the gradient of A x; the row case's output gradient is already whole), and the split halves carry megatron's
tensor-parallel attributes, so the grad norm counts each shard once and replicated ones once.

The adapters are parameters of the base linear (``<linear>.lora_a``, ``<linear>.lora_b``): every other tensor
keeps its MindSpeed-MM name, and ``W + scale * B @ A`` is local to a rank (its B rows or A columns are the ones
its W shard needs), so the weight sync and mg2hf merge each rank's shard without communication.

Everything else in the stage is frozen (``requires_grad`` off before DDP and the optimizer are built: megatron
gives neither grads nor Adam state to those). :func:`adapters_enabled` switches the adapters off for a pass: the
reference model is the actor without them.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mm_rl.config.schema import LoRAConfig

LORA_A, LORA_B = "lora_a", "lora_b"
_ADAPTER_KEY = re.compile(rf"\.({LORA_A}|{LORA_B})$")
_LAYER_INDEX = re.compile(r"^(text_decoder\.decoder\.layers|image_encoder\.encoder\.blocks\.layers)\.(\d+)\.")
_EXPERT_INDEX = re.compile(r"\.local_experts\.(\d+)\.")


class Switch:
    """The stage's adapters on (training, the actor's passes) or off (the reference's passes)."""

    enabled = True


def is_adapter_key(name: str) -> bool:
    """Whether a state-dict key is an adapter matrix (``...<linear>.lora_a`` / ``.lora_b``)."""
    return _ADAPTER_KEY.search(name) is not None


def targeted(name: str, cfg: LoRAConfig) -> bool:
    """Whether the module ``name`` (its path in the stage) gets an adapter: its leaf is a target; an expert's only
    with ``experts``; the ViT's and the merger's only with ``vision``."""
    if name.rsplit(".", 1)[-1] not in cfg.target_modules:
        return False
    if name.startswith("image_encoder."):
        return cfg.vision
    if ".local_experts." in name:
        return cfg.experts
    return name.startswith("text_decoder.")


def add_adapters(model: torch.nn.Module, cfg: LoRAConfig, seed: int) -> list[str]:
    """Freeze the whole stage, then give every targeted linear its adapter (B zero: the model is unchanged);
    returns the adapted linears' names. ``seed`` draws A, the same for a linear at any TP / PP / EP layout."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    for param in model.parameters():
        param.requires_grad_(False)
    switch, local_experts = Switch(), _local_expert_count(model)  # megatron's contiguous blocks of experts
    model.lora_switch = switch  # type: ignore[assignment]
    adapted = []
    for name, module in model.named_modules():
        kind = (
            "column"
            if isinstance(module, ColumnParallelLinear)
            else "row"
            if isinstance(module, RowParallelLinear)
            else None
        )
        if kind is None or not targeted(name, cfg):
            continue
        _attach(module, kind, cfg, _draw_seed(seed, global_name(model, name, local_experts)), switch)
        adapted.append(name)
    return adapted


def global_name(model: torch.nn.Module, name: str, local_experts: int) -> str:
    """``name`` with its layer index as in the whole model (PP stages count their layers from 0) and its expert
    index as among all experts (EP ranks count theirs from 0, ``local_experts`` each)."""
    layout = getattr(model, "layout", None)
    match = _LAYER_INDEX.match(name)
    if match and layout is not None:
        start = layout.llm_layers.start if match.group(1).startswith("text") else layout.vit_layers.start
        name = f"{match.group(1)}.{int(match.group(2)) + start}." + name[match.end() :]
    expert = _EXPERT_INDEX.search(name)
    if expert:
        from megatron.core import parallel_state

        index = parallel_state.get_expert_model_parallel_rank() * local_experts + int(expert.group(1))
        name = name[: expert.start()] + f".local_experts.{index}." + name[expert.end() :]
    return name


def _local_expert_count(model: torch.nn.Module) -> int:
    """Routed experts per EP rank, from the stage's model.json (0 for a dense model)."""
    from megatron.core import parallel_state

    model_cfg = getattr(model, "model_cfg", None)
    experts = (model_cfg.text_decoder.num_moe_experts or 0) if model_cfg is not None else 0
    return experts // parallel_state.get_expert_model_parallel_world_size()


def _draw_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def _attach(module: Any, kind: str, cfg: LoRAConfig, seed: int, switch: Switch) -> None:
    """Give ``module`` its adapter parameters (this rank's shares) and the forward hook that adds their output."""
    import torch
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if getattr(module, "explicit_expert_comm", False) and torch.distributed.get_world_size(module.tp_group) > 1:
        raise NotImplementedError("adapters on experts split over tensor parallelism (expert TP > 1)")
    weight = module.weight
    tp, rank = torch.distributed.get_world_size(module.tp_group), torch.distributed.get_rank(module.tp_group)
    out_local, in_local = weight.shape
    in_full = in_local * tp if kind == "row" else in_local
    generator = torch.Generator().manual_seed(seed)
    a = torch.empty(cfg.rank, in_full)
    bound = 1.0 / math.sqrt(in_full)  # kaiming-uniform with a = sqrt(5), as torch's Linear (and PEFT) draw A
    a.uniform_(-bound, bound, generator=generator)
    if kind == "row":
        a = a[:, rank * in_local : (rank + 1) * in_local]
    b = torch.zeros(out_local, cfg.rank)
    lora_a = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
    lora_b = torch.nn.Parameter(b.to(device=weight.device, dtype=weight.dtype))
    split = (lora_b, 0) if kind == "column" else (lora_a, 1)
    set_tensor_model_parallel_attributes(split[0], True, split[1], 1)
    for param in (lora_a, lora_b):
        if hasattr(weight, "allreduce"):  # an expert's: reduced over the expert-data-parallel group, as its weight
            param.allreduce = weight.allreduce  # type: ignore[attr-defined]
    module.register_parameter(LORA_A, lora_a)
    module.register_parameter(LORA_B, lora_b)
    module.lora_kind, module.lora_scale, module.lora_dropout = kind, cfg.scale, cfg.dropout
    module.register_forward_hook(_adapter_hook(switch), with_kwargs=True)


def _adapter_hook(switch: Switch) -> Any:
    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not switch.enabled:
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + adapter_delta(module, x), bias

    return hook


def adapter_delta(module: Any, x: torch.Tensor) -> torch.Tensor:
    """``scale * B A dropout(x)`` of this rank, shaped as the base linear's output here (see the module docstring
    for the splits)."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
        reduce_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    group, sp = module.tp_group, module.sequence_parallel and not module.explicit_expert_comm
    x = F.dropout(x, module.lora_dropout, module.training) if module.lora_dropout else x
    if module.lora_kind == "column":
        if sp:  # the rank's sequence share -> the whole sequence; the gradient goes back to each share unsummed
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=group)
        hidden = copy_to_tensor_model_parallel_region(F.linear(x, module.lora_a), group=group)
        return F.linear(hidden, module.lora_b) * module.lora_scale
    hidden = reduce_from_tensor_model_parallel_region(F.linear(x, module.lora_a), group=group)
    delta = F.linear(hidden, module.lora_b) * module.lora_scale
    return scatter_to_sequence_parallel_region(delta, group=group) if sp else delta


@contextlib.contextmanager
def adapters_enabled(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Within: the stage's adapters on or off (a model without adapters: nothing changes)."""
    switch = getattr(model, "lora_switch", None)
    if switch is None:
        yield
        return
    before, switch.enabled = switch.enabled, enabled
    try:
        yield
    finally:
        switch.enabled = before


def has_adapters(model: torch.nn.Module) -> bool:
    return getattr(model, "lora_switch", None) is not None


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The stage's adapter matrices by state-dict key (what a LoRA checkpoint holds of the model)."""
    return {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}


def merged(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B @ A`` of one rank's shard (computed in fp32, in W's dtype)."""
    return (weight.float() + scale * (lora_b.float() @ lora_a.float())).to(weight.dtype)


class MergedState(Mapping[str, "torch.Tensor"]):
    """A stage's tensors by MindSpeed-MM name with the adapters merged into their linears' weights (no adapter
    keys), each merged weight computed when it is read: what the engine and an HF checkpoint take."""

    def __init__(self, state: Mapping[str, torch.Tensor], scale: float) -> None:
        self.state, self.scale = state, scale
        self._keys = [k for k in state if not is_adapter_key(k)]

    def __getitem__(self, key: str) -> torch.Tensor:
        tensor = self.state[key]
        base = key.removesuffix(".weight")
        if key.endswith(".weight") and f"{base}.{LORA_A}" in self.state:
            return merged(tensor, self.state[f"{base}.{LORA_A}"], self.state[f"{base}.{LORA_B}"], self.scale)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def is_adapted(state: Mapping[str, torch.Tensor], key: str) -> bool:
    """Whether ``key`` of an :func:`export_state` belongs to an adapted linear: its (merged) weight or its bias, the
    tensors an engine must receive together (vLLM rebuilds a linear whole: half of it would be garbage)."""
    return isinstance(state, MergedState) and f"{key.rpartition('.')[0]}.{LORA_A}" in state.state


def export_state(model: torch.nn.Module) -> Mapping[str, torch.Tensor]:
    """The stage's ``state_dict`` as HF and the engine see the model: adapters merged (a model without: as is)."""
    state = model.state_dict()
    if not has_adapters(model):
        return state
    scales = {m.lora_scale for m in model.modules() if hasattr(m, "lora_scale")}
    return MergedState(state, scales.pop() if scales else 1.0)


def load_stage(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load ``state`` into a stage: all of it, or with adapters either the base's tensors (a converted file: the
    adapters keep their initial values) or the adapters (a LoRA checkpoint: the base stays); whichever part is
    given must be whole, and nothing else may be in it."""
    if not has_adapters(model):
        model.load_state_dict(state)
        return
    own = [k for k in model.state_dict(keep_vars=True) if not k.endswith("._extra_state")]
    adapters = [k for k in own if is_adapter_key(k)]
    part = adapters if any(k in state for k in adapters) else [k for k in own if not is_adapter_key(k)]
    result = model.load_state_dict(state, strict=False)
    missing = sorted(set(result.missing_keys) & set(part))
    if missing or result.unexpected_keys:
        raise RuntimeError(f"loading the stage: missing {missing[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}")
