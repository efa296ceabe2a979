"""The Triton kernels of torchturbo::bias_gelu: checked on CPU by Triton's interpreter, on CUDA
for real when a GPU is present; skipped cleanly without triton (``torchturbo[triton]``)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

bias_gelu_module = importlib.import_module("torchturbo.kernels.bias_gelu")
from torchturbo.kernels import bias_gelu, bias_gelu_reference  # noqa: E402

# Tolerances as for the C++ kernel (tests/test_kernels.py): float32 errors are absolute near
# |v| * 2**-24 where 0.5 * v * (1 + erf) cancels; bfloat16 may differ by one ulp (2**-8 relative)
# because the kernel rounds once and the composite rounds x + bias first.
FP32 = {"rtol": 1e-5, "atol": 4e-6}
BF16 = {"rtol": 2**-7, "atol": 2**-7}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def interpreted(monkeypatch):
    """The Triton module imported under TRITON_INTERPRET=1, so its kernels run on CPU tensors.

    triton.jit decides at decoration time, so the module is reloaded with the variable set, and
    reloaded again without it afterwards so that a later CUDA test compiles the real kernels.
    """
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = importlib.reload(importlib.import_module("torchturbo.kernels.bias_gelu_triton"))
    yield module
    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(module)


def _inputs(dtype=torch.float32, shape=(64, 333)):
    x = torch.randn(shape, dtype=dtype) * 4  # reach the tails where erf saturates
    return x, torch.randn(shape[-1], dtype=dtype), torch.randn(shape, dtype=dtype)


def test_interpreted_forward_matches_reference_and_not_tanh_gelu(interpreted) -> None:
    x, bias, _ = _inputs()
    out = interpreted.forward(x, bias)
    torch.testing.assert_close(out, bias_gelu_reference(x, bias), **FP32)
    # Negative control: the tanh approximation is ~5e-4 away, far beyond the tolerance.
    assert not torch.allclose(out, F.gelu(x + bias, approximate="tanh"), **FP32)


def test_interpreted_backward_matches_autograd_of_the_reference(interpreted) -> None:
    x, bias, grad = _inputs(shape=(8, 16, 48))
    out = interpreted.backward(grad, x, bias)
    leaf = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(bias_gelu_reference(leaf, bias), leaf, grad)
    torch.testing.assert_close(out, expected, **FP32)
    # Negative control: a derivative that forgets the bias is caught.
    (no_bias,) = torch.autograd.grad(F.gelu(leaf), leaf, grad)
    assert not torch.allclose(out, no_bias, **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_interpreted_half_precision_within_one_ulp(interpreted, dtype) -> None:
    x, bias, grad = _inputs(dtype, shape=(32, 64))
    out = interpreted.forward(x, bias)
    assert out.dtype == dtype
    torch.testing.assert_close(out, bias_gelu_reference(x, bias), **BF16)
    reference = torch.ops.aten.gelu_backward(grad.float(), (x + bias).float()).to(dtype)
    torch.testing.assert_close(interpreted.backward(grad, x, bias), reference, **BF16)


def test_interpreted_float64_computes_in_float64(interpreted) -> None:
    x, bias, grad = _inputs(torch.float64, shape=(5, 7))
    torch.testing.assert_close(
        interpreted.forward(x, bias), bias_gelu_reference(x, bias), rtol=1e-14, atol=1e-15
    )
    expected = torch.ops.aten.gelu_backward(grad, x + bias)
    torch.testing.assert_close(interpreted.backward(grad, x, bias), expected, rtol=1e-13, atol=0)


def test_interpreted_odd_sizes_and_empty_tensors(interpreted) -> None:
    # 3 * 1025 elements: the last program is partly masked; a 1-column bias broadcasts.
    for shape in [(3, 1025), (2047, 1)]:
        x, bias, _ = _inputs(shape=shape)
        torch.testing.assert_close(interpreted.forward(x, bias), bias_gelu_reference(x, bias))
    assert interpreted.forward(torch.empty(0, 5), torch.zeros(5)).shape == (0, 5)


def test_the_op_dispatches_cuda_to_the_triton_launchers(interpreted) -> None:
    # Both ops have a CUDA kernel of their own (not only the composite default) ...
    for op in ("torchturbo::bias_gelu", "torchturbo::bias_gelu_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    # ... and the registered functions run Triton: with CPU tensors under the interpreter they
    # return the kernel's bits, which differ from eager's in the last place somewhere.
    x, bias, grad = _inputs()
    assert not torch.equal(interpreted.forward(x, bias), bias_gelu_reference(x, bias))
    assert torch.equal(bias_gelu_module._bias_gelu_cuda(x, bias), interpreted.forward(x, bias))
    assert torch.equal(
        bias_gelu_module._bias_gelu_backward_cuda(grad, x, bias),
        interpreted.backward(grad, x, bias),
    )


def test_without_triton_cuda_runs_the_composite_and_says_so(monkeypatch) -> None:
    monkeypatch.setattr(bias_gelu_module, "_import_triton_kernels", lambda: (None, "no triton"))
    bias_gelu_module._warn_fallback.cache_clear()
    x, bias, _ = _inputs()
    with pytest.warns(RuntimeWarning, match="composite on CUDA: triton is not installed"):
        out = bias_gelu_module._bias_gelu_cuda(x, bias)
    assert torch.equal(out, bias_gelu_reference(x, bias).contiguous())
    bias_gelu_module._warn_fallback.cache_clear()


@pytest.mark.cuda
@needs_cuda
def test_cuda_op_runs_triton_and_equals_the_reference() -> None:
    x, bias, grad = (t.cuda().requires_grad_(i < 2) for i, t in enumerate(_inputs()))
    # acc_events: torch 2.11 warns on entering profile() without it (its first cycle too).
    with torch.profiler.profile(acc_events=True) as profile:
        out = bias_gelu(x, bias)
        out.backward(grad)
    names = " ".join(event.name for event in profile.events())
    assert "_forward_kernel" in names and "_backward_kernel" in names
    assert "gelu" not in names.replace("bias_gelu", "")  # no eager gelu kernel ran
    leaf_x, leaf_b = x.detach().requires_grad_(), bias.detach().requires_grad_()
    expected = bias_gelu_reference(leaf_x, leaf_b)
    expected.backward(grad)
    torch.testing.assert_close(out, expected, **FP32)
    torch.testing.assert_close(x.grad, leaf_x.grad, **FP32)
    torch.testing.assert_close(bias.grad, leaf_b.grad, rtol=1e-5, atol=1e-4)  # sums 64 rows


@pytest.mark.cuda
@needs_cuda
def test_cuda_opcheck() -> None:
    x, bias, grad = (t.cuda() for t in _inputs(shape=(3, 48)))
    torch.library.opcheck(torch.ops.torchturbo.bias_gelu.default, (x, bias))
    torch.library.opcheck(torch.ops.torchturbo.bias_gelu_backward.default, (grad, x, bias))
