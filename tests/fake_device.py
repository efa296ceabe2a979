"""A second device on a CPU-only machine, for proving that every tensor follows the model's.

``install()`` registers a device called ``fakegpu`` (torch's Python PrivateUse1 backend): a tensor
moved there is a wrapper that says ``device='fakegpu:0'`` and keeps its data in a CPU tensor, and
every op on such tensors runs on the CPU data. An op that mixes them with CPU tensors raises what
CUDA raises ("Expected all tensors to be on the same device"), with the same exceptions CUDA
makes: a CPU scalar (a 0-dim tensor) mixes with anything, indexing takes CPU indices, and copies
cross devices. ``.numpy()`` of such a tensor is refused, as it is on CUDA, and a random factory
that draws on the device from a CPU generator too.

Why: on a machine with one device, a tensor made on the CPU beside a CUDA model goes unseen
(packing's isolation probe built its position ids on the CPU, and every tune of a Hugging Face
causal LM on an H200 stopped there); with this device it fails on a CPU as it fails on a GPU.
What it cannot show: CUDA's own kernels, streams and memory (``torch.cuda`` is still absent),
compiled code (inductor has no code generator for this device).

Process-wide and once per process (torch renames the PrivateUse1 backend once): tests call it
in a child process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.backend_registration import (
    _DummyBackendModule,
    _setup_privateuseone_for_python_backend,
)

NAME = "fakegpu"
aten = torch.ops.aten

#: Ops whose tensors may sit on two devices, as on CUDA: copies between devices, and indexing a
#: device tensor with CPU indices.
_CROSSING = {
    aten._to_copy.default,
    aten.copy_.default,
    aten._copy_from.default,
    aten._copy_from_and_resize.default,
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
_COPIES = {aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default}


class OnDevice(torch.Tensor):
    """A tensor on ``fakegpu:0``: its data is the CPU tensor ``data_on_cpu``."""

    data_on_cpu: torch.Tensor

    @staticmethod
    def __new__(cls, data_on_cpu: torch.Tensor) -> OnDevice:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            data_on_cpu.shape,
            strides=data_on_cpu.stride(),
            storage_offset=data_on_cpu.storage_offset(),
            dtype=data_on_cpu.dtype,
            layout=data_on_cpu.layout,
            device=torch.device(NAME, 0),
            requires_grad=data_on_cpu.requires_grad,
        )

    def __init__(self, data_on_cpu: torch.Tensor) -> None:
        self.data_on_cpu = data_on_cpu

    def __repr__(self) -> str:  # type: ignore[override]
        return f"OnDevice({self.data_on_cpu!r})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["data_on_cpu"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: None, size: Any, stride: Any) -> OnDevice:
        return OnDevice(inner["data_on_cpu"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        return run(func, args, kwargs or {})

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Saved as its data, as a CUDA tensor's storage is saved: torch.load(map_location="cpu")
        # gives a CPU tensor back.
        return self.data_on_cpu.__reduce_ex__(protocol)

    def untyped_storage(self) -> Any:  # a wrapper has none of its own; memory facts count it
        return self.data_on_cpu.untyped_storage()

    def tolist(self) -> Any:  # torch refuses tolist() for subclasses; CUDA tensors allow it
        return self.data_on_cpu.tolist()

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        raise TypeError(
            f"can't convert {NAME}:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
            "tensor to host memory first."
        )


def _on_cpu(value: Any) -> Any:
    return value.data_on_cpu if isinstance(value, OnDevice) else value


def _on_device(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, OnDevice):
        return OnDevice(value)
    return value


def _check_devices(func: Any, tensors: list[torch.Tensor], kwargs: dict) -> None:
    on_device = any(isinstance(t, OnDevice) for t in tensors)
    # A CPU scalar mixes with device tensors on CUDA too.
    on_cpu = [t for t in tensors if not isinstance(t, OnDevice) and t.dim() > 0]
    if on_device and on_cpu and func not in _CROSSING:
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"{NAME}:0 and cpu! (in {func}: a CPU tensor of shape {tuple(on_cpu[0].shape)})"
        )
    generator = kwargs.get("generator")
    target = kwargs.get("device")
    on_device = on_device or (target is not None and torch.device(target).type == NAME)
    if generator is not None and on_device and generator.device.type != NAME:
        raise RuntimeError(
            f"Expected a '{NAME}' device type for generator but found '{generator.device.type}'"
        )


#: Ops run on the device so far: a test asserts that its model really trained there.
OPS_RUN = [0]


def run(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on the CPU data of its tensors; the result on the device where CUDA puts it."""
    OPS_RUN[0] += 1
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    _check_devices(func, tensors, kwargs)
    if func in _COPIES:
        destination, source = (args[0], args[1]) if func is aten.copy_.default else args[1::-1]
        _on_cpu(destination).copy_(_on_cpu(source))
        return destination
    to_device = any(isinstance(t, OnDevice) for t in tensors)
    if kwargs.get("device") is not None:
        to_device = torch.device(kwargs["device"]).type == NAME
        kwargs = {**kwargs, "device": torch.device("cpu")}
    out = func(*tree_map(_on_cpu, args), **tree_map(_on_cpu, kwargs))
    if func._schema.is_mutable and args and isinstance(args[0], OnDevice):
        return args[0]  # an in-place op returns the tensor it changed
    return tree_map(_on_device, out) if to_device else out


class _Module(_DummyBackendModule):
    """``torch.fakegpu``: what autocast, GradScaler and device-generic code ask of a device."""

    def device_count(self) -> int:
        return 1

    def synchronize(self, device: Any = None) -> None:
        pass

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]


#: The ops a tensor reaches through the backend itself, not through the wrapper: torch.tensor(...,
#: device=...) builds its tensor with the Python dispatch turned off.
_BACKEND_OPS = (
    "empty.memory_format",
    "empty_strided",
    "_to_copy",
    "copy_",
    "_copy_from",
    "_copy_from_and_resize",
    "lift_fresh",
    "detach",
    "view",
    "alias",
    "resize_",
)
_LIBRARY: list[torch.library.Library] = []


def install() -> None:
    """Register ``fakegpu`` in this process (once; later calls do nothing)."""
    if _LIBRARY:
        return
    _setup_privateuseone_for_python_backend(rename=NAME, backend_module=_Module())
    library = torch.library.Library("aten", "IMPL")
    for name in _BACKEND_OPS:
        op_name, _, overload = name.partition(".")
        op = getattr(getattr(aten, op_name), overload or "default")
        library.impl(name, _kernel(op), "PrivateUse1")
    # Autocast on this device casts nothing (CUDA's cast lists are CUDA's): the ops fall through.
    everything = torch.library.Library("_", "IMPL")
    everything.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    _LIBRARY.extend((library, everything))
    # The device has no caching allocator to empty (accelerate empties it before training).
    torch.accelerator.empty_cache = lambda: None


def _kernel(op: Any) -> Any:
    return lambda *args, **kwargs: run(op, args, kwargs)
