"""The fused bias+GELU custom op: registered, equal to the eager composite, differentiable,
compilable, and really running the C++ kernel on CPU."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchturbo.kernels import LinearGELU, bias_gelu, bias_gelu_reference, load_cpu_kernels

# Tolerances. float32: the kernel's erf (glibc libmvec) and PyTorch's vectorized erf are both
# accurate to a few ulp, but for negative inputs 0.5 * v * (1 + erf(v / sqrt 2)) cancels, so the
# error is absolute, about |v| * 2**-24 (~1e-6 at |v| = 16); atol 4e-6 covers it and is still 100x
# tighter than the tanh-approximate GELU (the negative control). bfloat16: the fused kernel rounds
# once, the composite rounds x + bias first and then gelu, so they can differ by one bf16 ulp
# (2**-8 relative).
FP32 = {"rtol": 1e-5, "atol": 4e-6}
BF16 = {"rtol": 2**-7, "atol": 2**-7}


@pytest.fixture(scope="session", autouse=True)
def _cpu_kernels() -> None:
    # Build (cold: ~25 s) or load (warm: < 1 s) once for the whole session.
    load_cpu_kernels()


def _inputs(dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = (4, 6, 40)):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    bias = torch.randn(shape[-1], dtype=dtype, requires_grad=True)
    return x, bias


def test_ops_are_registered() -> None:
    assert hasattr(torch.ops.torchturbo, "bias_gelu")
    assert hasattr(torch.ops.torchturbo, "bias_gelu_backward")
    assert hasattr(torch.ops.torchturbo_cpu, "bias_gelu_forward")


def test_cpu_path_runs_the_cpp_kernel_not_the_composite() -> None:
    x, bias = _inputs()
    # acc_events: torch 2.11 warns on entering profile() without it (its first cycle too).
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True
    ) as prof:
        bias_gelu(x, bias).sum().backward()
    names = {event.name for event in prof.events()}
    assert "torchturbo_cpu::bias_gelu_forward" in names
    assert "torchturbo_cpu::bias_gelu_backward" in names
    assert "aten::gelu" not in names and "aten::gelu_backward" not in names


def test_without_the_cpp_build_cpu_runs_the_composite_and_says_so(monkeypatch) -> None:
    # The package attribute `bias_gelu` is the op, so fetch the module itself.
    module = importlib.import_module("torchturbo.kernels.bias_gelu")
    monkeypatch.setattr(module, "cpu_kernel_error", lambda: "RuntimeError: no g++ here")
    module._warn_fallback.cache_clear()
    x, bias = _inputs()
    with pytest.warns(RuntimeWarning, match="could not be built"):
        out = bias_gelu(x, bias)
    assert torch.equal(out, bias_gelu_reference(x, bias))  # the same composite, bit for bit
    module._warn_fallback.cache_clear()


def test_without_ninja_the_build_is_not_tried_and_says_how_to_get_it(monkeypatch) -> None:
    # ninja is an extra now; this machine may have a system one, so its absence is arranged
    # where torch looks for it. The cached result of the real build is left alone.
    import torch.utils.cpp_extension as cpp_extension

    from torchturbo.kernels import _build

    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    monkeypatch.setattr(cpp_extension, "load", lambda **_: pytest.fail("tried to build"))
    error = _build.cpu_kernel_error.__wrapped__()
    how = "pip install 'torchturbo[kernels]' (or pip install ninja)"
    assert error == f"ninja is not installed; {how} builds the C++ op"


def test_forward_matches_reference_float32_and_not_tanh_gelu() -> None:
    x, bias = _inputs(shape=(64, 333))
    x = x.detach() * 4  # cover the tails where erf saturates
    out = bias_gelu(x, bias.detach())
    torch.testing.assert_close(out, bias_gelu_reference(x, bias.detach()), **FP32)
    # Negative control: the tanh approximation differs by up to ~5e-4, far beyond the tolerance.
    tanh_gelu = F.gelu(x + bias.detach(), approximate="tanh")
    assert not torch.allclose(out, tanh_gelu, **FP32)


def test_forward_float64_is_exact_to_rounding() -> None:
    x, bias = _inputs(torch.float64)
    out = bias_gelu(x.detach(), bias.detach())
    torch.testing.assert_close(
        out, bias_gelu_reference(x.detach(), bias.detach()), rtol=1e-14, atol=1e-15
    )


def test_bfloat16_within_one_ulp() -> None:
    x, bias = _inputs(torch.bfloat16, shape=(32, 64))
    out = bias_gelu(x, bias)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, bias_gelu_reference(x, bias), **BF16)


def test_gradcheck_float64() -> None:
    x, bias = _inputs(torch.float64, shape=(3, 5, 7))
    assert torch.autograd.gradcheck(bias_gelu, (x, bias))


def test_gradients_match_reference_float32() -> None:
    x, bias = _inputs(shape=(8, 16, 48))
    grad_out = torch.randn(8, 16, 48)
    gx, gb = torch.autograd.grad(bias_gelu(x, bias), (x, bias), grad_out)
    rx, rb = torch.autograd.grad(bias_gelu_reference(x, bias), (x, bias), grad_out)
    torch.testing.assert_close(gx, rx, **FP32)
    # The bias gradient sums 128 rows: allow the summation-order difference.
    torch.testing.assert_close(gb, rb, rtol=1e-5, atol=1e-5)
    # Negative control: forgetting the bias reduction (or the bias in the derivative) is caught.
    wrong = torch.autograd.grad(F.gelu(x), x, grad_out)[0]
    assert not torch.allclose(gx, wrong, **FP32)


def test_opcheck() -> None:
    x, bias = _inputs(shape=(3, 9))
    torch.library.opcheck(torch.ops.torchturbo.bias_gelu.default, (x, bias))
    grad = torch.randn(3, 9)
    torch.library.opcheck(
        torch.ops.torchturbo.bias_gelu_backward.default, (grad, x.detach(), bias.detach())
    )


@pytest.mark.parametrize(
    ("x_shape", "bias_shape"), [((4, 5), (6,)), ((4, 5), (1, 5)), ((4, 5), (5, 1))]
)
def test_bad_shapes_raise_value_error(x_shape, bias_shape) -> None:
    with pytest.raises(ValueError, match="bias"):
        bias_gelu(torch.randn(x_shape), torch.randn(bias_shape))


def test_linear_gelu_is_a_drop_in_for_linear_plus_gelu() -> None:
    reference = nn.Sequential(nn.Linear(24, 40), nn.GELU())
    fused = LinearGELU(24, 40)
    fused.load_state_dict(reference[0].state_dict())
    x = torch.randn(5, 24)
    torch.testing.assert_close(fused(x), reference(x), **FP32)


def test_linear_gelu_under_bf16_autocast() -> None:
    reference = nn.Sequential(nn.Linear(24, 40), nn.GELU())
    fused = LinearGELU(24, 40)
    fused.load_state_dict(reference[0].state_dict())
    x = torch.randn(5, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = fused(x), reference(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, **BF16)
    out.float().sum().backward()
    assert fused.bias.grad is not None and fused.bias.grad.dtype == torch.float32


@pytest.mark.slow
def test_torch_compile_fullgraph_with_backward() -> None:
    torch._dynamo.reset()
    model = nn.Sequential(LinearGELU(16, 32), nn.Linear(32, 4))
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break would raise
    x = torch.randn(8, 16)
    out = compiled(x)
    torch.testing.assert_close(out, model(x), **FP32)
    out.sum().backward()
    compiled_grad = model[0].bias.grad.clone()
    model.zero_grad()
    model(x).sum().backward()
    torch.testing.assert_close(compiled_grad, model[0].bias.grad, **FP32)
