"""Fused bias + GELU as a real PyTorch operator: ``torch.ops.torchturbo.bias_gelu(x, bias)``.

``F.gelu(x + bias)`` runs in eager PyTorch as two kernels with a full-size temporary (add, then
gelu) and backward as two more (gelu_backward, then the bias reduction); a Linear followed by GELU
(every Transformer MLP) pays this on every step. The fused op does each direction in one pass.

Registration goes through ``torch.library.custom_op`` so that the op is a first-class citizen:
callable from Python as ``torch.ops.torchturbo.bias_gelu``, differentiable (``register_autograd``,
whose backward is itself a custom op), and traceable by ``torch.compile``/``torch.export``
(``register_fake`` gives output shapes without running the kernel). The default implementation is
the PyTorch composite, which runs on every other device; on CPU the C++ kernel
(``bias_gelu.cpp``, compiled on first use) replaces it, on CUDA the Triton kernel
(``bias_gelu_triton.py``, where triton is installed; else the composite, with a warning).

This is what the article's CUDA kernel lacked: a ``__global__`` function has no Python binding and
cannot be launched with grid/block keywords from Python; an op registered with ``torch.library``
is dispatched by device, works with autograd and compile, and is checked by ``opcheck``.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchturbo.kernels._build import cpu_kernel_error


def bias_gelu_reference(x: Tensor, bias: Tensor) -> Tensor:
    """The eager composite the fused op must equal: exact (erf) GELU of ``x + bias``."""
    return F.gelu(x + bias)


def _bias_gelu_backward_reference(grad: Tensor, x: Tensor, bias: Tensor) -> Tensor:
    return torch.ops.aten.gelu_backward(grad, x + bias)


def _cpp_ready() -> bool:
    """True when the C++ kernels are loaded; otherwise warn (once) that CPU runs the composite."""
    error = cpu_kernel_error()
    if error is not None:
        _warn_fallback("CPU", f"the C++ kernel could not be built ({error})")
    return error is None


def _triton_kernels() -> ModuleType | None:
    """The Triton kernels, or None (warning once) where triton cannot be imported."""
    kernels, error = _import_triton_kernels()
    if kernels is None:
        _warn_fallback(
            "CUDA", f"triton is not installed ({error}): pip install 'torchturbo[triton]'"
        )
    return kernels


@functools.cache
def _import_triton_kernels() -> tuple[ModuleType | None, str]:
    # Cached: a failing import searches the whole path again on every call.
    try:
        return importlib.import_module("torchturbo.kernels.bias_gelu_triton"), ""
    except ImportError as error:
        return None, str(error)


@functools.cache
def _warn_fallback(device: str, why: str) -> None:
    warnings.warn(
        f"torchturbo::bias_gelu runs the eager composite on {device}: {why}",
        RuntimeWarning,
        stacklevel=2,
    )


def _check(x: Tensor, bias: Tensor) -> None:
    if bias.dim() != 1 or x.dim() < 1 or x.shape[-1] != bias.shape[0]:
        raise ValueError(
            f"bias_gelu(x, bias): bias must be 1-D with x.shape[-1] elements, got "
            f"x.shape={tuple(x.shape)} and bias.shape={tuple(bias.shape)}"
        )
    if x.dtype != bias.dtype or x.device != bias.device:
        raise ValueError(
            f"bias_gelu(x, bias): x and bias must share dtype and device, got "
            f"{x.dtype}/{x.device} and {bias.dtype}/{bias.device}"
        )


@torch.library.custom_op("torchturbo::bias_gelu", mutates_args=())
def bias_gelu(x: Tensor, bias: Tensor) -> Tensor:
    """``gelu(x + bias)`` with ``bias`` broadcast over the last dimension of ``x``; fused on CPU."""
    _check(x, bias)
    # Contiguous like the C++ kernel and the fake, so strides do not depend on the device.
    return bias_gelu_reference(x, bias).contiguous()


@bias_gelu.register_kernel("cpu")
def _bias_gelu_cpu(x: Tensor, bias: Tensor) -> Tensor:
    _check(x, bias)
    if not _cpp_ready():
        return bias_gelu_reference(x, bias).contiguous()
    return torch.ops.torchturbo_cpu.bias_gelu_forward(x, bias)


@bias_gelu.register_kernel("cuda")
def _bias_gelu_cuda(x: Tensor, bias: Tensor) -> Tensor:
    _check(x, bias)
    kernels = _triton_kernels()
    if kernels is None:
        return bias_gelu_reference(x, bias).contiguous()
    return kernels.forward(x, bias)


@bias_gelu.register_fake
def _bias_gelu_fake(x: Tensor, bias: Tensor) -> Tensor:
    _check(x, bias)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("torchturbo::bias_gelu_backward", mutates_args=())
def bias_gelu_backward(grad: Tensor, x: Tensor, bias: Tensor) -> Tensor:
    """Gradient of :func:`bias_gelu` with respect to ``x`` (first order only)."""
    return _bias_gelu_backward_reference(grad, x, bias).contiguous()


@bias_gelu_backward.register_kernel("cpu")
def _bias_gelu_backward_cpu(grad: Tensor, x: Tensor, bias: Tensor) -> Tensor:
    if not _cpp_ready():
        return _bias_gelu_backward_reference(grad, x, bias).contiguous()
    return torch.ops.torchturbo_cpu.bias_gelu_backward(grad, x, bias)


@bias_gelu_backward.register_kernel("cuda")
def _bias_gelu_backward_cuda(grad: Tensor, x: Tensor, bias: Tensor) -> Tensor:
    kernels = _triton_kernels()
    if kernels is None:
        return _bias_gelu_backward_reference(grad, x, bias).contiguous()
    return kernels.backward(grad, x, bias)


@bias_gelu_backward.register_fake
def _bias_gelu_backward_fake(grad: Tensor, x: Tensor, bias: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ctx is Any, as torch.autograd.Function's own signatures type it: the stub of its class types
# saved_tensors and needs_input_grad as one-element tuples.
def _setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
    x, bias = inputs
    ctx.save_for_backward(x, bias)


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
    x, bias = ctx.saved_tensors
    grad_x = bias_gelu_backward(grad.contiguous(), x, bias)
    # d(x + bias)/d bias sums the broadcast dimensions; the kernel already gave d/d(x + bias).
    grad_bias = grad_x.reshape(-1, bias.shape[0]).sum(0) if ctx.needs_input_grad[1] else None
    return grad_x if ctx.needs_input_grad[0] else None, grad_bias


bias_gelu.register_autograd(_backward, setup_context=_setup_context)


class LinearGELU(nn.Linear):
    """``gelu(linear(x))`` with the bias add fused into the GELU: a drop-in for Linear + GELU.

    Same parameters (and state dict) as ``nn.Linear``, so weights load either way.
    """

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None:
            return F.gelu(F.linear(x, self.weight))
        y = F.linear(x, self.weight)
        # Under autocast y is bf16/fp16 while the bias stays float32: the custom op is opaque to
        # autocast, so cast here (differentiably) as autocast would for an add.
        return bias_gelu(y, self.bias.to(y.dtype))
