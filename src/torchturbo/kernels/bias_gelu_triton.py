"""Fused bias + GELU for CUDA in Triton: the GPU kernels behind ``torchturbo::bias_gelu``.

The C++ file is the CPU side of the same operator; ``bias_gelu.py`` registers these launchers as
its CUDA kernels, so users call one op on any device. Each direction is one pass over memory:
forward reads x and the bias and writes gelu(x + bias); backward reads the gradient, x and the
bias and writes the input gradient (the bias gradient is a reduction, left to PyTorch). The
maths runs in fp32 (fp64 for fp64 inputs) and rounds once on store, like the C++ kernel.

Importing this module needs triton (``pip install 'torchturbo[triton]'``), so ``bias_gelu.py``
imports it only on the first CUDA call. With ``TRITON_INTERPRET=1`` set before the import,
Triton's interpreter runs the same kernels on CPU tensors: that is how the tests check them
without a GPU (tests/test_kernels_triton.py).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

#: Elements per program: large enough to keep a memory-bound kernel streaming, small enough for
#: many programs per SM on every GPU.
BLOCK = 1024


# The kernels' parameters stay unannotated: Triton reads the annotations of a @triton.jit
# function as its signature (an ``int`` would compile as i32, and numel may exceed 2**31).
@triton.jit
def _forward_kernel(  # type: ignore[no-untyped-def]
    x_ptr, bias_ptr, y_ptr, numel, cols, BLOCK: tl.constexpr, ACC: tl.constexpr
):
    # int64 offsets: a tensor of more than 2**31 elements must not wrap around.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    x = tl.load(x_ptr + offsets, mask=mask).to(ACC)
    v = x + tl.load(bias_ptr + offsets % cols, mask=mask).to(ACC)
    y = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))  # 1 / sqrt(2)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(  # type: ignore[no-untyped-def]
    grad_ptr, x_ptr, bias_ptr, out_ptr, numel, cols, BLOCK: tl.constexpr, ACC: tl.constexpr
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    grad = tl.load(grad_ptr + offsets, mask=mask).to(ACC)
    x = tl.load(x_ptr + offsets, mask=mask).to(ACC)
    v = x + tl.load(bias_ptr + offsets % cols, mask=mask).to(ACC)
    # d/dv [v * Phi(v)] = Phi(v) + v * phi(v), as in PyTorch's gelu_backward.
    cdf = 0.5 * (1.0 + tl.math.erf(v * 0.7071067811865476))
    pdf = tl.exp(-0.5 * v * v) * 0.3989422804014327  # 1 / sqrt(2 pi)
    tl.store(out_ptr + offsets, (grad * (cdf + v * pdf)).to(out_ptr.dtype.element_ty), mask=mask)


def forward(x: Tensor, bias: Tensor) -> Tensor:
    """``gelu(x + bias)``, bias broadcast over the last dimension; inputs checked by the op."""
    x, bias = x.contiguous(), bias.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(_forward_kernel, x, bias, (x, bias, y))
    return y


def backward(grad: Tensor, x: Tensor, bias: Tensor) -> Tensor:
    """The gradient of :func:`forward` with respect to ``x``."""
    grad, x, bias = grad.contiguous(), x.contiguous(), bias.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(_backward_kernel, x, bias, (grad, x, bias, out))
    return out


def _launch(
    kernel: triton.JITFunction, x: Tensor, bias: Tensor, tensors: tuple[Tensor, ...]
) -> None:
    if x.numel() == 0:
        return
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    grid = (triton.cdiv(x.numel(), BLOCK),)
    # Triton launches on the current device: make it x's (a no-op for the interpreter's CPU).
    on_device = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
    with on_device:
        kernel[grid](*tensors, x.numel(), bias.numel(), BLOCK=BLOCK, ACC=acc)
