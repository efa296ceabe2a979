"""``[compile] activation_memory_budget``: checked on load, applied while the compiled model
partitions and nowhere else, the eager arithmetic kept, and fewer activations saved.

The compiled test is one tiny model compiled twice (budgets 1.0 and 0.3), about 20 s on the
shared 2-core machine; the rest compiles nothing.
"""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch
from torch import nn

from torchturbo import TurboConfig
from torchturbo.config import CompileConfig, ConfigError
from torchturbo.measure.memory import activation_bytes
from torchturbo.techniques.compile import BudgetedInductor, CompileError, apply_compile


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-0.1, r"activation_memory_budget = -0\.1 is invalid: expected a finite number >= 0"),
        (1.5, r"and <= 1 \(a fraction of the activations\), or no key for torch's default"),
        (math.nan, r"activation_memory_budget = nan is invalid"),
        (True, r"activation_memory_budget = True is invalid: expected float or nothing"),
        ("0.5", r"activation_memory_budget = '0\.5' is invalid"),
    ],
)
def test_a_budget_outside_zero_to_one_is_refused_with_the_field_named(value, message):
    with pytest.raises(ConfigError, match=message):
        TurboConfig.from_dict({"compile": {"mode": "default", "activation_memory_budget": value}})


def test_a_budget_without_compile_is_refused_and_the_bounds_are_allowed():
    with pytest.raises(ConfigError, match=r"with mode = 'off' is invalid: the budget is the"):
        CompileConfig(activation_memory_budget=0.5)
    for value in (0, 0.0, 0.4, 1.0):
        assert CompileConfig(mode="default", activation_memory_budget=value)
    assert CompileConfig().activation_memory_budget is None


def test_a_torch_without_the_setting_is_a_clear_error(monkeypatch):
    import torch._functorch.config  # imported, so that there is a module to replace

    monkeypatch.setattr(torch._functorch, "config", types.SimpleNamespace())
    with pytest.raises(CompileError, match=r"needs torch\._functorch\.config\.activation_memory"):
        BudgetedInductor(None, None, 0.5)


def test_backends_are_equal_exactly_when_their_budgets_and_modes_are():
    """What dynamo's backend check compares: a graph is reused for an equal backend only."""
    assert BudgetedInductor(None, None, 0.5) == BudgetedInductor(None, None, 0.5)
    assert BudgetedInductor(None, None, 0.5) != BudgetedInductor(None, None, 0.4)
    assert BudgetedInductor(None, None, 0.5) != BudgetedInductor("max-autotune", None, 0.5)


class _Chain(nn.Module):
    """Linears with pointwise chains between them: activations worth recomputing."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)).sin())).cos())


def _step(model: nn.Module, x: torch.Tensor) -> tuple[float, list[torch.Tensor], int]:
    """Loss, gradients and the bytes the forward saved for backward (as the tuner counts a
    CPU step's footprint: ``Trial.memory_footprint``)."""
    saved = activation_bytes(lambda: model(x).square().mean(), model=model)
    loss = model(x).square().mean()
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()], saved


@pytest.mark.slow
def test_a_budget_keeps_the_eager_results_saves_less_and_leaves_torchs_value_alone():
    from torch._functorch import config as functorch_config

    torch.manual_seed(0)
    eager = _Chain()
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    before = functorch_config.activation_memory_budget
    runs = {}
    # 1.0 first: a second model of the same class must not reuse its graph.
    for budget in (1.0, 0.3):
        model = copy.deepcopy(eager)
        config = CompileConfig(mode="default", activation_memory_budget=budget)
        assert apply_compile(model, config).applied
        runs[budget] = _step(model, x)
        assert functorch_config.activation_memory_budget == before
    loss, grads, saved = _step(eager, x)
    for budget, (got_loss, got_grads, _) in runs.items():
        # Inductor fuses the float32 pointwise chains: sums in another order.
        assert got_loss == pytest.approx(loss, rel=1e-5), budget
        for got, want in zip(got_grads, grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # Eager saves every activation; 1.0 what the fastest partition keeps; 0.3 less again.
    assert runs[0.3][2] < runs[1.0][2] <= saved, {b: r[2] for b, r in runs.items()}
