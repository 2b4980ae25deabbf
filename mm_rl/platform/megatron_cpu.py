"""Bridges that let megatron-core 0.16.1 train on CPU over gloo (no accelerator present), and its one NPU bridge.

megatron-core assumes CUDA in four ways; each is bridged at its known call sites only, so torch itself and
every other library in the process (vLLM, transformers, Ray) keep the real ``torch.cuda``:

1. ``torch.cuda.*`` calls inside megatron.core modules: ``current_device()`` (~110 sites: rotary embeddings,
   DDP buffers, p2p shape exchange, TP gathers), ``synchronize()`` (p2p, DDP, timers), ``empty_cache()``,
   ``set_device()``, ``device_count()`` and the RNG calls of the tracker (``get_rng_state`` /
   ``set_rng_state`` / ``manual_seed``). On a CPU build these raise "Torch not compiled with CUDA".
2. Tensor factories called with ``device="cuda"`` (pipeline schedules' token count, optimizer ``found_inf``
   and loss scale, clip_grads' norm buffers, DDP warm-up tensor, causal masks).
3. ``CudaRNGStatesTracker`` and ``model_parallel_cuda_manual_seed`` keep one CUDA RNG state per name and
   swap it in and out through ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``.
4. Tensor methods: ``.cuda()`` (tied-embedding sync, ``broadcast_data``, grad-scaler and optimizer state
   restore, DP-zero gather, param hash check) and ``param.type() == 'torch.cuda.FloatTensor'`` (mixed
   precision and distributed optimizer set-up, ``clip_grad_by_total_norm_fp32``).

How:

1+2. Each listed module's global name ``torch`` is replaced by a stand-in module that forwards every
     attribute to the real torch except ``cuda`` (a stand-in answering with the CPU) and five factories
     (``tensor``, ``zeros``, ``ones``, ``empty``, ``full``) that move a CUDA ``device`` argument to the CPU.
     The stand-in holds a copy of torch's attributes, so ``torch.X`` costs what it did; nothing runs per op.
3.   The two module-level helpers of ``megatron.core.tensor_parallel.random`` are replaced by versions
     that read / write the CPU generator (on CPU the "device" generator *is* the CPU one).
4.   The few functions holding such calls are wrapped so that, only while they run, a torch function mode
     makes ``.cuda()`` return the CPU tensor itself and ``.type()`` report ``torch.cuda.<Type>``. A mode
     costs a few microseconds per torch call, which is why it is scoped to these set-up / per-step helpers
     and never left on during forward and backward.

MoE: the router, the local experts and the all-to-all token dispatcher (which copies its split sizes to the host
on a side stream: on CPU the stream, its events and ``torch.cuda.stream`` are no-ops, the copies synchronous; under
TP x EP its uneven gathers over the TP group, which gloo refuses, are padded: :func:`_install_uneven_gloo_collectives`).
Process groups: megatron creates some twenty groups per rank, most of them of one rank when the layout is small
(a single-rank actor: all of them). Over gloo each group is a device whose event loop wakes every 10 ms while idle
(gloo/transport/tcp/loop.cc: ``epoll_wait(..., 10)``) plus two worker threads: ~1.2 ms of CPU a second per group,
and each wake-up preempts a compute thread of a rank whose two OpenMP threads then wait for each other. On CPU the
groups of one rank share one process group per rank (:func:`_install_shared_singleton_groups`); a group of one rank
has no peer, so its collectives are local whichever group object carries them.
Not bridged (not used on CPU): Transformer Engine, apex fusions, FSDP, other MoE token dispatchers, CUDA graphs
(their static inputs are the only CUDA calls in transformer.module / transformer_layer), activation
offloading, context parallelism, inference contexts, dist_checkpointing and ``enable_autocast`` (the
schedules call ``torch.autocast("cuda")``).
Keep off on CPU: ``gradient_accumulation_fusion`` and ``apply_rope_fusion`` (see
:func:`mm_rl.platform.device.cpu_safe_transformer_kwargs`). Sequence parallelism runs: its all-gathers and
reduce-scatters are the bridged ``tensor_parallel.mappings``.

:func:`install` imports the listed modules, patches them once, and does nothing when CUDA or an NPU is
present. On NPU without MindSpeed, :func:`install_npu_type_bridge` bridges the ``.type()`` checks alone.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# megatron.core modules (dense GPT training path) whose global ``torch`` gets the CPU stand-in, with the
# CUDA calls each holds (megatron-core 0.16.1).
_TORCH_VIEW_MODULES: tuple[str, ...] = (
    "megatron.core.parallel_state",  # synchronize() after group creation
    "megatron.core.utils",  # current_device() buffers, device="cuda" in the local l2-norm fallback
    "megatron.core.timers",  # synchronize(), current_device() for gathered timings
    "megatron.core.rerun_state_machine",  # cuda RNG state save/restore, current_device()
    "megatron.core.tensor_parallel.random",  # tracker: get/set_rng_state, manual_seed
    "megatron.core.tensor_parallel.layers",  # current_device() for weights and gather buffers
    "megatron.core.tensor_parallel.mappings",  # current_device() for all-gather / reduce-scatter outputs
    "megatron.core.tensor_parallel.utils",  # current_device() for split / gather buffers
    "megatron.core.tensor_parallel.data",  # device="cuda" sizes in broadcast_data
    "megatron.core.transformer.attention",  # current_device() for the static KV cache
    "megatron.core.transformer.dot_product_attention",  # current_device() for the softmax offset
    "megatron.core.transformer.mlp",  # empty_cache() on the sharded-state path
    "megatron.core.transformer.utils",  # device="cuda" causal masks
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # current_device() for inv_freq (RoPE, mRoPE)
    "megatron.core.models.common.language_module.language_module",  # .cuda() of tied embeddings (see below)
    "megatron.core.models.gpt.gpt_model",  # current_device() for the inference sequence offsets
    "megatron.core.pipeline_parallel.schedules",  # device="cuda" token counter
    "megatron.core.pipeline_parallel.p2p_communication",  # current_device() shape tensors, synchronize()
    "megatron.core.distributed.distributed_data_parallel",  # synchronize(), empty_cache()
    "megatron.core.distributed.param_and_grad_buffer",  # current_device() buffers, device="cuda" warm-up
    "megatron.core.optimizer.optimizer",  # device="cuda" found_inf / loss scale, empty_cache()
    "megatron.core.optimizer.distrib_optimizer",  # current_device() gather buffers
    "megatron.core.optimizer.clip_grads",  # device="cuda" norm buffers
    "megatron.core.optimizer.grad_scaler",  # device="cuda" scale tensors
    "megatron.core.transformer.moe.router",  # current_device() for the router weight and aux-loss buffers
    "megatron.core.transformer.moe.experts",  # current_device() for the grouped experts' weights
    "megatron.core.transformer.moe.moe_utils",  # device="cuda" aux-loss tracker, current_stream()
    "megatron.core.ssm.gated_delta_net",  # current_device() for the conv1d, dt_bias and A_log (Qwen3.5)
    "megatron.core.transformer.moe.token_dispatcher",  # the all-to-all dispatcher's device-to-host copy stream
)

# (module, qualified name) of the functions that call ``.cuda()`` or compare ``.type()`` with a CUDA type.
_TENSOR_METHOD_SITES: tuple[tuple[str, str], ...] = (
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
    ("megatron.core.optimizer.optimizer", "MegatronOptimizer.restore_from_cpu"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.get_parameter_state_dp_zero"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.optimizer.grad_scaler", "DynamicGradScaler.load_state_dict"),
    ("megatron.core.models.common.language_module.language_module", "LanguageModule.setup_embeddings_and_output_layer"),
    ("megatron.core.tensor_parallel.data", "broadcast_data"),
    ("megatron.core.utils", "check_param_hashes_across_dp_replicas"),
)

# The functions among them that compare ``.type()`` with a CUDA type name (bridged on NPU too).
TYPE_CHECK_SITES: tuple[tuple[str, str], ...] = (
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
)

_RNG_MODULE = "megatron.core.tensor_parallel.random"
_CPU = torch.device("cpu")
_installed = False
_npu_types_installed = False


def _on_cpu(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``, an int) to the CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _factory_on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap a tensor factory so that a CUDA ``device`` lands on the CPU (and is not pinned)."""

    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.get("device")
        if device is not None and _on_cpu(device) is _CPU:
            kwargs["device"] = _CPU
            kwargs.pop("pin_memory", None)  # pinning needs an accelerator
        return factory(*args, **kwargs)

    return wrapper


def _cpu_current_device() -> torch.device:
    # megatron passes the result as ``device=``; the CPU device keeps those tensors on the CPU.
    return _CPU


def _noop(*_args: Any, **_kwargs: Any) -> None:
    """synchronize / empty_cache / set_device: CPU ops are synchronous and there is one "device"."""


def _one_device() -> int:
    # Used as ``rank % device_count()``; the CPU is one device.
    return 1


class _CpuStream:
    """``torch.cuda.Stream`` on CPU: one in-order stream, so waiting and events have nothing to do."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def wait_stream(self, _other: Any) -> None:
        pass

    def record_event(self, *_args: Any) -> _CpuStream:
        return self  # an event whose synchronize() returns at once

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CpuStream()


def _cpu_current_stream(*_args: Any) -> _CpuStream:
    return _CPU_STREAM


def _cpu_get_rng_state(device: Any = None) -> torch.Tensor:
    # The tracker snapshots / restores the "device" generator around each fork(); on CPU that is this one.
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # On CPU the "device" generator is the CPU generator, so seeding one seeds the other.
    torch.manual_seed(seed)


def _cuda_on_cpu() -> ModuleType:
    """``torch.cuda`` as megatron.core sees it on CPU: device / sync / RNG calls answer for the CPU.

    Everything not overridden (``is_available``, ``amp``, ``Event``...) resolves to the real ``torch.cuda``
    through a module-level ``__getattr__`` (PEP 562); those calls are rare.
    """
    shim = ModuleType("torch.cuda", "torch.cuda for megatron.core on CPU (mm_rl.platform.megatron_cpu)")
    overrides: dict[str, Callable[..., Any]] = {
        "current_device": _cpu_current_device,
        "synchronize": _noop,
        "empty_cache": _noop,
        "set_device": _noop,
        "device_count": _one_device,
        "get_rng_state": _cpu_get_rng_state,
        "set_rng_state": _cpu_set_rng_state,
        "manual_seed": _cpu_manual_seed,
        "manual_seed_all": _cpu_manual_seed,
        "Stream": _CpuStream,
        "current_stream": _cpu_current_stream,
        "stream": lambda _stream=None: contextlib.nullcontext(),
        "__getattr__": functools.partial(getattr, torch.cuda),
    }
    vars(shim).update(overrides)
    return shim


def _torch_on_cpu() -> ModuleType:
    """``torch`` as the bridged megatron.core modules see it on CPU; everything else is the real torch.

    Bridged modules look up ``torch.X`` on every call, so the real torch's attributes are copied in: a hit
    costs what a lookup on torch costs (~30 ns, measured), where forwarding every lookup through a
    module ``__getattr__`` cost ~0.5 us. Names torch gains later (lazily imported submodules) still
    resolve through ``__getattr__``; a top-level torch attribute *rebound* after :func:`install` would not
    be seen by the bridged modules, which is one reason ``install`` runs at process start.
    """
    view = ModuleType("torch", "torch for megatron.core on CPU (mm_rl.platform.megatron_cpu)")
    namespace = vars(view)
    namespace.update({key: value for key, value in vars(torch).items() if not key.startswith("__")})
    namespace["__getattr__"] = functools.partial(getattr, torch)
    namespace["cuda"] = _cuda_on_cpu()
    for name in ("tensor", "zeros", "ones", "empty", "full"):
        namespace[name] = _factory_on_cpu(getattr(torch, name))
    return view


def as_cuda_type(name: str) -> str:
    """A tensor type name as megatron expects it: ``torch.FloatTensor`` (CPU) and ``torch.npu.FloatTensor`` (NPU)
    become ``torch.cuda.FloatTensor``."""
    if name.startswith("torch.cuda."):
        return name
    return "torch.cuda." + name.removeprefix("torch.").removeprefix("npu.")


class _TensorMethodsAsCuda(TorchFunctionMode):
    """While active: ``t.type()`` reports the ``torch.cuda.<Type>`` name; on CPU (``cpu``) ``t.cuda()`` also returns
    ``t`` (on NPU ``transfer_to_npu`` already points ``.cuda()`` at the NPU)."""

    def __init__(self, cpu: bool) -> None:
        super().__init__()
        self.cpu = cpu

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda and self.cpu:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return as_cuda_type(func(*args))
        return func(*args, **kwargs)


def _with_cuda_tensor_methods(fn: Callable[..., Any], cpu: bool = True) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _TensorMethodsAsCuda(cpu):
            return fn(*args, **kwargs)

    return wrapper


def _megatron_modules() -> list[ModuleType]:
    return [m for name, m in list(sys.modules.items()) if name.startswith("megatron.core") and m is not None]


def _rebind_everywhere(old: Any, new: Any) -> None:
    """Point every loaded megatron.core module global that holds ``old`` (``from x import f``) at ``new``."""
    for module in _megatron_modules():
        for key, value in list(vars(module).items()):
            if value is old:
                setattr(module, key, new)


def _install_torch_views() -> None:
    view = _torch_on_cpu()
    for name in _TORCH_VIEW_MODULES:
        module = importlib.import_module(name)
        if vars(module).get("torch") is not torch:
            raise RuntimeError(f"{name}: expected a module-level `import torch` to bridge (megatron-core changed?)")
        module.torch = view  # type: ignore[attr-defined]


def _wrap_site(module_name: str, qualname: str, cpu: bool = True) -> None:
    module = importlib.import_module(module_name)
    *owner_path, attr = qualname.split(".")
    owner: Any = module
    for part in owner_path:
        owner = getattr(owner, part)
    original = vars(owner)[attr]
    wrapped = _with_cuda_tensor_methods(original, cpu)
    setattr(owner, attr, wrapped)
    if not owner_path:
        _rebind_everywhere(original, wrapped)


def _install_tensor_method_bridges() -> None:
    for module_name, qualname in _TENSOR_METHOD_SITES:
        _wrap_site(module_name, qualname)


def _cpu_get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Stand-in for ``random._get_cuda_rng_state``: the CPU generator's state (graph-safe mode is CUDA-only)."""
    return torch.get_rng_state()


def _cpu_set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Stand-in for ``random._set_cuda_rng_state``: set the CPU generator (the real one defers to CUDA init)."""
    torch.set_rng_state(new_state)


class _DropSharedRngWarning(logging.Filter):
    """On CPU the tracker's "device" generator *is* the CPU generator, so every random op inside
    ``tracker.fork()`` trips megatron's "CPU RNG state changed within GPU RNG context" warning although
    the fork saves and restores that state correctly. Drop just that message."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _install_rng_bridge() -> None:
    module = importlib.import_module(_RNG_MODULE)
    module._get_cuda_rng_state = _cpu_get_cuda_rng_state  # type: ignore[attr-defined]
    module._set_cuda_rng_state = _cpu_set_cuda_rng_state  # type: ignore[attr-defined]
    logging.getLogger(_RNG_MODULE).addFilter(_DropSharedRngWarning())


def install_npu_type_bridge() -> None:
    """On NPU without MindSpeed: megatron's optimizer and grad clipping compare ``param.type()`` with
    ``'torch.cuda.*Tensor'`` strings, and torch_npu's parameters say ``'torch.npu.*Tensor'`` (``transfer_to_npu``
    re-points ``.cuda()`` and ``is_cuda`` but not ``type()``); the mixed-precision set-up would reject every bf16
    parameter. The functions holding those comparisons report CUDA names while they run (MindSpeed's adaptor, when
    installed, patches ``Tensor.type`` process-wide to the same effect). Idempotent."""
    global _npu_types_installed
    if _npu_types_installed:
        return
    for module_name, qualname in TYPE_CHECK_SITES:
        _wrap_site(module_name, qualname, cpu=False)
    _npu_types_installed = True


def _install_moe_host_copy() -> None:
    """The all-to-all dispatcher's ``maybe_move_tensor_to_cpu(x, as_numpy=True)`` turns a CUDA tensor of split
    sizes into a numpy array, which ``all_to_all_single`` takes as a sequence of ints; a CPU tensor it returns
    unchanged, which the binding rejects. On CPU, hand back the same numpy array a GPU run gets."""
    module = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    original = module.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _rebind_everywhere(original, host_copy)


def _install_uneven_gloo_collectives() -> None:
    """MoE under TP x EP: the all-to-all dispatcher gathers each TP rank's routed tokens over the TP group and
    scatters the experts' outputs back (``tensor_parallel.mappings._gather_along_first_dim`` /
    ``_reduce_scatter_along_first_dim`` with split sizes), and the ranks' token counts differ. NCCL and HCCL take
    uneven lists; gloo refuses them ("ProcessGroupGloo::allgather: invalid tensor size"). On CPU only: the gather
    pads every share to the largest and trims, the reduce-scatter all-reduces the whole and keeps this rank's rows
    (the same values; more bytes, which a CPU run does not mind)."""
    module = importlib.import_module("megatron.core.tensor_parallel.mappings")
    gather, scatter = module._gather_along_first_dim, module._reduce_scatter_along_first_dim

    @functools.wraps(gather)
    def padded_gather(input_: Any, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False) -> Any:
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        padded = input_.new_zeros((max(output_split_sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:count] for part, count in zip(parts, output_split_sizes, strict=True)])

    @functools.wraps(scatter)
    def reduced_share(input_: Any, group: Any, input_split_sizes: Any = None, use_global_buffer: bool = False) -> Any:
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start : start + input_split_sizes[group.rank()]].clone()

    _rebind_everywhere(gather, padded_gather)
    _rebind_everywhere(scatter, reduced_share)


def _install_shared_singleton_groups() -> None:
    """``parallel_state.create_group`` of a one-rank list returns the group made for that rank the first time in this
    world (see the module docstring: each gloo group's idle loop costs CPU). Every rank makes the same calls in the
    same order (megatron builds every group on every rank), so every rank skips the same ``new_group`` calls; a world
    destroyed and joined again starts over."""
    module = importlib.import_module("megatron.core.parallel_state")
    create = module.create_group
    made: dict[tuple[int, Any], Any] = {}  # (rank, backend) -> its group, in the world ``made_in``
    made_in: list[Any] = [None]

    @functools.wraps(create)
    def shared_singleton(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        if ranks is None or len(ranks) != 1:
            return create(ranks, *args, **kwargs)
        if made_in[0] is not torch.distributed.group.WORLD:  # another world: its groups, not the old ones
            made.clear()
            made_in[0] = torch.distributed.group.WORLD
        key = (int(ranks[0]), kwargs.get("backend"))
        if key not in made:
            made[key] = create(ranks, *args, **kwargs)
        return made[key]

    _rebind_everywhere(create, shared_singleton)


def define_missing_te_gemm() -> None:
    """megatron-core 0.16.1's ``moe_utils`` imports ``te_general_gemm`` inside a try block and later tests
    ``te_general_gemm is not None`` in the router's gating linear: without Transformer Engine the name is
    undefined and every MoE forward raises NameError. None is what that test expects (plain ``torch.mm``)."""
    module = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(module, "te_general_gemm"):
        module.te_general_gemm = None  # type: ignore[attr-defined]


def install() -> None:
    """Install every CPU bridge (idempotent). No-op when CUDA or an NPU is present (except the missing
    Transformer Engine name, which any device without TE lacks)."""
    global _installed
    if _installed:
        return
    from mm_rl.platform.device import device_kind

    define_missing_te_gemm()

    if device_kind() != "cpu":
        return
    _install_torch_views()
    _install_rng_bridge()
    _install_tensor_method_bridges()
    _install_moe_host_copy()
    _install_uneven_gloo_collectives()
    _install_shared_singleton_groups()
    _installed = True
