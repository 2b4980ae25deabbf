"""Device mistakes without a device: real CPU computations on tensors that say they live on an accelerator.

A :class:`Labelled` tensor holds a real CPU tensor (``.value``) but reports ``cuda:0`` (or ``npu:0``). Inside
:func:`labelled_device` every aten op runs on the CPU values and its outputs are labelled again, and the harness
applies CUDA's device rule: an op that gets a labelled tensor and a plain CPU tensor of dim > 0 raises
:class:`DeviceMismatch` naming the op (0-dim CPU tensors, copies between devices and CPU indices of an
indexing op are allowed, as on CUDA). What never reaches aten is handled one level up: ``.to("cuda")`` /
``.cuda()``, ``new_tensor`` of a labelled tensor and factories with ``device="cuda"`` give labelled tensors,
``pin_memory()`` is a no-op, ``.cpu()`` / ``.to("cpu")`` give plain CPU tensors, ``.numpy()`` of a labelled tensor
raises.

The context also points this process's device at the label: ``mm_rl.platform.device.current_device`` (in every
mm_rl module that imported it) and, through megatron's CPU bridge, ``torch.cuda.current_device()`` and the
bridge's tensor factories of the bridged megatron modules, so what megatron allocates (TP weights, rotary
tables, DDP grad buffers, optimizer scalars) is labelled as on a GPU. Build a model inside the context to get
what a GPU build gives (a rank's ``build`` then moves the rest, as ``model.cuda()`` does).

A CPU build has no CUDA device guard, which torch's bindings take for some methods of a device tensor
(indexing, ``copy_``) and autograd for every device tensor: under the ``cuda`` label the context registers the
CPU's no-op guard for CUDA (:func:`cuda_device_guard`). Backward still cannot run on CUDA-typed tensors there
(the engine asks ``at::getAccelerator()`` for their streams and finds none) and raises
:class:`LabelledAutogradError`; what needs backward uses the ``npu`` label after :func:`register_npu_label`
(torch's PrivateUse1 backend named ``npu`` with no-op hooks, as torch_npu registers it; process-wide and
irreversible, so only in a child process).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
CPU = torch.device("cpu")

# Ops that may take a labelled and a CPU tensor of any size together (CUDA allows them too).
_CROSS_DEVICE = {
    aten._to_copy.default,
    aten.copy_.default,
    aten.copy.default,
    aten._copy_from.default,
    aten._copy_from_and_resize.default,
    aten.lift_fresh.default,
    aten.lift_fresh_copy.default,
}
# Indexing ops whose indices (argument 1) may stay on the CPU for a device tensor.
_CPU_INDICES = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
    aten._unsafe_index.Tensor,
    aten._unsafe_index_put.default,
}


class DeviceMismatch(RuntimeError):
    """A labelled (device) tensor met a plain CPU tensor of dim > 0 in one op: CUDA would raise here too."""


class LabelledAutogradError(RuntimeError):
    """Backward through cuda-labelled tensors, which a CPU build cannot run (use the npu label)."""


class Labelled(torch.Tensor):
    """A real CPU tensor (``value``) that reports an accelerator device; see the module docstring."""

    value: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, value: torch.Tensor, device: torch.device, requires_grad: bool | None = None) -> Labelled:
        wrapper = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            value.size(),
            strides=value.stride(),
            storage_offset=value.storage_offset(),
            dtype=value.dtype,
            layout=value.layout,
            device=device,
            requires_grad=value.requires_grad if requires_grad is None else requires_grad,
        )
        wrapper.value = value.detach() if value.requires_grad else value
        return wrapper

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"Labelled({self.device}, {self.value!r})"

    def tolist(self) -> Any:
        """The values, as a device-to-host read gives them (torch refuses tolist() of wrapper subclasses)."""
        return self.value.tolist()

    def numpy(self, *, force: bool = False) -> Any:
        raise DeviceMismatch(f"numpy() of a tensor on {self.device}: numpy needs a CPU tensor (call .cpu() first)")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Outside labelled_device (labelling, checks, a rank's results): same rules, the label of the inputs.
        return _run(func, args, kwargs or {}, None)


def label(tensor: torch.Tensor, device: str | torch.device = "cuda:0") -> Labelled:
    """``tensor`` (a plain CPU tensor) as a labelled tensor on ``device``, sharing its values."""
    if isinstance(tensor, Labelled):
        return tensor
    if tensor.device.type != "cpu":
        raise ValueError(f"only CPU tensors can be labelled, got {tensor.device}")
    return Labelled(tensor, torch.device(device))


def _unwrap(value: Any) -> Any:
    return value.value if isinstance(value, Labelled) else value


def _is_accelerator(device: Any, label: torch.device | None) -> bool:
    """A device spec naming the accelerator: cuda (megatron's spelling), an int index, or the label's type."""
    if isinstance(device, bool) or device is None:
        return False
    if isinstance(device, int):
        return True
    kind = torch.device(device).type if isinstance(device, str | torch.device) else None
    return kind == "cuda" or (label is not None and kind == label.type)


def _describe(tensor: torch.Tensor) -> str:
    return f"CPU tensor {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _check_devices(func: Any, args: Any, kwargs: Any, device: torch.device) -> None:
    """CUDA's rule: a device tensor may meet CPU tensors of dim 0 only (copies and CPU indices aside)."""
    if func in _CROSS_DEVICE:
        return
    checked = (args[:1] + args[2:]) if func in _CPU_INDICES else args
    plain = [
        t
        for t in tree_flatten((checked, kwargs))[0]
        if isinstance(t, torch.Tensor) and not isinstance(t, Labelled) and t.dim() > 0 and t.device.type == "cpu"
    ]
    if plain:
        raise DeviceMismatch(
            f"{func}: a tensor on {device} meets a {_describe(plain[0])} in one op, called from "
            f"{_caller()} (on a GPU: 'Expected all tensors to be on the same device')"
        )


def _caller() -> str:
    """The innermost Python frame outside torch and this harness: where the mixing op was called."""
    skip = (os.path.dirname(torch.__file__), __file__)
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def _run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mode_label: torch.device | None) -> Any:
    """One aten op on the CPU values; outputs labelled as described in the module docstring."""
    flat = tree_flatten((args, kwargs))[0]
    inputs = [t for t in flat if isinstance(t, Labelled)]
    device = inputs[0].device if inputs else mode_label
    target = kwargs.get("device")
    if target is not None:  # an explicit device (factories, _to_copy): the output goes there
        labelled_out = _is_accelerator(target, device)
        kwargs = {**kwargs, "device": CPU}
        if labelled_out:
            kwargs.pop("pin_memory", None)
        device = device or (torch.device("cuda", 0) if labelled_out else None)
    else:
        labelled_out = bool(inputs)
    if inputs and func not in _CROSS_DEVICE:
        _check_devices(func, args, kwargs, inputs[0].device)
    if func is aten.copy_.default:  # in place into the destination, whichever side is labelled
        func(_unwrap(args[0]), _unwrap(args[1]), *args[2:], **kwargs)
        return args[0]
    values = {id(t.value): t for t in inputs}
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))

    def relabel(result: Any) -> Any:
        if not isinstance(result, torch.Tensor):
            return result
        if id(result) in values:  # in place / out=: the caller's own (labelled) tensor
            owner = values[id(result)]
            if owner.shape != result.shape:
                raise NotImplementedError(f"{func} changed the shape of a labelled tensor in place (unsupported)")
            return owner
        return Labelled(result, device) if labelled_out else result  # type: ignore[arg-type]

    return tree_map(relabel, out)


class _LabelDispatch(TorchDispatchMode):
    """Every aten op of the process: run on CPU values, relabel, raise on a device mismatch."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "namespace", None) == "c10d":
            _check_collective(func, args, kwargs or {}, self.device)
        return _run(func, args, kwargs or {}, self.device)


_OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"}


def _check_collective(func: Any, args: Any, kwargs: Any, device: torch.device) -> None:
    """NCCL's (and HCCL's) rule: a collective takes device tensors only, whatever their size. torch's object
    collectives are exempt: they put their byte tensors on the device the group's backend wants (the CPU for the
    gloo group the harness runs on, the GPU for nccl)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _OBJECT_COLLECTIVES:
            return
        frame = frame.f_back  # type: ignore[assignment]
    plain = [
        t
        for t in tree_flatten((args, kwargs))[0]
        if isinstance(t, torch.Tensor) and not isinstance(t, Labelled) and t.device.type == "cpu"
    ]
    if plain:
        raise DeviceMismatch(
            f"{func}: a collective of a rank on {device} gets a {_describe(plain[0])}, called from "
            f"{_caller()} (nccl / hccl take device tensors only)"
        )


def _split_to_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``Tensor.to``'s device (None if not given) and its other arguments by name."""
    rest, kw = list(args), dict(kwargs)
    device = kw.pop("device", None)
    if rest and isinstance(rest[0], torch.Tensor):  # to(other, non_blocking, copy)
        other = rest.pop(0)
        device, kw["dtype"] = other.device, other.dtype
        names: tuple[str, ...] = ("non_blocking", "copy")
    elif rest and isinstance(rest[0], torch.dtype):  # to(dtype, non_blocking, copy)
        names = ("dtype", "non_blocking", "copy")
    else:  # to(device, dtype, non_blocking, copy)
        if rest:
            device = rest.pop(0)
        names = ("dtype", "non_blocking", "copy")
    kw.update(zip(names, rest, strict=False))
    return device, kw


_BACKWARD = {torch.autograd.backward, torch.autograd.grad, torch.Tensor.backward}
_SET_DATA = torch.Tensor.data.__set__  # a fresh method-wrapper on each access: compare with ==


def _set_data(target: torch.Tensor, new: torch.Tensor) -> None:
    """``target.data = new`` when either is labelled: ``target`` (the same object) takes ``new``'s values and
    device. torch would copy only the wrapper's metadata and keep the old values (megatron's
    ``make_viewless_tensor`` does ``out.data = inp.data``)."""
    if isinstance(target, Labelled) and isinstance(new, Labelled):
        torch._C.TensorBase.data.__set__(target, new)
        target.value = new.value
        return
    if isinstance(new, Labelled):
        replacement: torch.Tensor = Labelled(new.value, new.device, requires_grad=target.requires_grad)
    else:
        replacement = new.detach().requires_grad_(target.requires_grad)
    if isinstance(target, torch.nn.Parameter):
        replacement = torch.nn.Parameter(replacement, requires_grad=target.requires_grad)
    replacement.__dict__.update({k: v for k, v in target.__dict__.items() if k != "value"})
    torch.utils.swap_tensors(target, replacement)


class _LabelFunctions(TorchFunctionMode):
    """What never reaches aten: moves to the accelerator, factories on it, pinning, ``param.data = ...``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if self.device.type == "cuda" and func in _BACKWARD:
            raise LabelledAutogradError(
                "backward through cuda-labelled tensors needs torch's CUDA hooks, which a "
                "CPU build lacks: use the npu label (register_npu_label)"
            )
        if func is torch.Tensor.to:
            device, kw = _split_to_args(args[1:], kwargs)
            if _is_accelerator(device, self.device):
                dtype = kw.get("dtype")
                return self._move(args[0] if dtype is None else args[0].to(dtype), copy=bool(kw.get("copy")))
            return func(*args, **kwargs)
        if func is torch.Tensor.cuda or func is getattr(torch.Tensor, self.device.type, None):
            return self._move(args[0])
        if func == _SET_DATA and (isinstance(args[0], Labelled) or isinstance(args[1], Labelled)):
            return _set_data(args[0], args[1])
        if func is torch.Tensor.new_tensor and isinstance(args[0], Labelled):
            # torch builds it on self's device directly (no aten op to relabel): on the CPU values, labelled
            dtype = kwargs.get("dtype") or args[0].dtype
            return Labelled(torch.tensor(tree_map(_unwrap, args[1]), dtype=dtype), args[0].device)
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.is_pinned:
            return False
        if func is torch._has_compatible_shallow_copy_type and any(isinstance(t, Labelled) for t in args):
            return True  # module.to(device) then assigns param.data (handled above): the same Parameter objects
        if (
            func in (torch.tensor, torch.as_tensor)
            and args
            and not isinstance(args[0], torch.Tensor)
            and any(isinstance(t, Labelled) for t in tree_flatten(args[0])[0])
        ):
            # a list of device scalars: torch reads them with the Python key off, so read the values here (a host
            # tensor unless a device is named, as on a GPU)
            args = (tree_map(_unwrap, args[0]), *args[1:])
        if "device" in kwargs and _is_accelerator(kwargs["device"], self.device):
            kwargs["device"] = CPU
            kwargs.pop("pin_memory", None)
            return tree_map(self._wrap_new, func(*args, **kwargs))
        return func(*args, **kwargs)

    def _move(self, tensor: torch.Tensor, copy: bool = False) -> torch.Tensor:
        if isinstance(tensor, Labelled):
            return tensor.clone() if copy else tensor
        return aten._to_copy.default(tensor, device=self.device)  # through autograd, like a real copy

    def _wrap_new(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or isinstance(value, Labelled):
            return value
        return Labelled(value, self.device)


# ------------------------------------------------------------------------------------------- the process
def _mm_rl_current_device_sites() -> list[tuple[Any, str]]:
    """Every loaded mm_rl module (and mm_rl.platform.device itself) holding ``current_device``."""
    from mm_rl.platform import device as device_module

    original = device_module.current_device
    return [
        (module, "current_device")
        for name, module in list(sys.modules.items())
        if module is not None and name.startswith("mm_rl") and vars(module).get("current_device") is original
    ]


def _megatron_torch_view() -> Any:
    """The torch stand-in megatron_cpu gave the bridged megatron modules (None before ``install``)."""
    layers = sys.modules.get("megatron.core.tensor_parallel.layers")
    view = getattr(layers, "torch", None)
    return None if view is None or view is torch else view


_GUARD_REGISTRY = "_ZN3c104impl26device_guard_impl_registryE"  # c10::impl::device_guard_impl_registry
_CPU_SLOT, _CUDA_SLOT = 0, 1  # c10::DeviceType::CPU, ::CUDA


@contextlib.contextmanager
def cuda_device_guard() -> Iterator[None]:
    """A no-op CUDA device guard while the context lasts (a CPU build has none).

    torch's bindings take a device guard for some methods of a device tensor (indexing, ``copy_``, scalar reads)
    and autograd asks the guard of each tensor's device for its stream; without one they raise "PyTorch is not
    linked with support for cuda devices" (inside autograd: the process aborts). The CPU's no-op guard is
    registered for CUDA in c10's guard registry, and removed again afterwards. Nothing on a CUDA build."""
    registry = (ctypes.c_void_p * (_CUDA_SLOT + 1)).in_dll(ctypes.CDLL(_libc10()), _GUARD_REGISTRY)
    if registry[_CUDA_SLOT] or not registry[_CPU_SLOT]:  # a real CUDA guard (or an unknown layout): leave it
        yield
        return
    registry[_CUDA_SLOT] = registry[_CPU_SLOT]
    try:
        yield
    finally:
        registry[_CUDA_SLOT] = None


def _libc10() -> str:
    return os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")


def clear_megatron_buffers() -> None:
    """Empty megatron's global memory buffer: it keeps tensors of earlier runs (on the other "device")."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if buffer is not None:
        buffer.buffer.clear()


@contextlib.contextmanager
def labelled_device(device: str | torch.device = "cuda:0") -> Iterator[torch.device]:
    """This process behaves as if its device were ``device`` (see the module docstring); yields the device."""
    label_device = torch.device(device)
    if label_device.index is None:
        label_device = torch.device(label_device.type, 0)
    if label_device.type not in ("cuda", torch._C._get_privateuse1_backend_name()):
        raise ValueError(f"label {label_device}: only cuda, or npu after register_npu_label()")
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, vars(owner)[name]))
        setattr(owner, name, value)

    for module, name in _mm_rl_current_device_sites():
        patch(module, name, lambda: label_device)
    view = _megatron_torch_view()
    if view is not None:  # megatron sees the device as its current CUDA device; its factories reach the mode
        patch(view.cuda, "current_device", lambda: label_device)
        for factory in ("tensor", "zeros", "ones", "empty", "full"):
            patch(view, factory, getattr(torch, factory))
    clear_megatron_buffers()
    try:
        guard = cuda_device_guard() if label_device.type == "cuda" else contextlib.nullcontext()
        with (
            guard,
            _LabelFunctions(label_device),
            _LabelDispatch(label_device),
            torch.autograd.set_multithreading_enabled(False),
        ):
            yield label_device
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
        clear_megatron_buffers()


def plain_tensors(module: torch.nn.Module) -> list[str]:
    """Names of ``module``'s parameters and buffers that are plain CPU tensors (not on the labelled device)."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return [name for name, t in named if not isinstance(t, Labelled)]


def assert_on_host(value: Any, path: str = "result") -> None:
    """Every tensor in ``value`` (lists, tuples, dicts, dataclasses) is a plain CPU tensor; AssertionError naming
    the first that is not."""
    if isinstance(value, torch.Tensor):
        assert not isinstance(value, Labelled) and value.device.type == "cpu", f"{path} is on {value.device}"
    elif isinstance(value, Mapping):
        for key, item in value.items():
            assert_on_host(item, f"{path}[{key!r}]")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            assert_on_host(item, f"{path}[{i}]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            assert_on_host(getattr(value, field.name), f"{path}.{field.name}")


def register_npu_label() -> None:
    """Register torch's PrivateUse1 backend as ``npu`` with Python no-op hooks and device guard, so the autograd
    engine accepts ``npu``-labelled tensors (what torch_npu registers on an Ascend machine). Process-wide and
    irreversible: call it in a child process only. Idempotent."""
    if torch._C._get_privateuse1_backend_name() == "npu":
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend("npu")
