"""float8 training: not applicable on this CPU (with the reason), and where torchao is present,
a conversion that really runs fp8 matmuls, keeps the parameters, and passes loss parity."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from conftest import classification_loss, cpu_stage_context
from torch import nn

from torchturbo.config import TurboConfig
from torchturbo.engine import Turbo
from torchturbo.recipe import Recipe
from torchturbo.techniques.float8 import (
    apply_float8_training,
    convert_linears,
    convertible_linears,
    float8_stage,
    float8_unavailable,
)
from torchturbo.techniques.framework.decide import loss_parity
from torchturbo.trials.trial import Trial, fixed_batches
from torchturbo.tune.search.run import TuneOptions, tune
from torchturbo.tune.search.state import PARITY_STEPS

float8_module = importlib.import_module("torchturbo.techniques.float8")
needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="needs torchao (torchturbo[float8])"
)


def mlp() -> nn.Module:
    # 64 -> 128 -> 32 convert; the 32 -> 10 head does not (10 is not a multiple of 16).
    return nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32), nn.GELU(), nn.Linear(32, 10)
    )


def mlp_recipe() -> Recipe:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=generator)
    y = (x[:, :10].argmax(dim=1)).long()  # learnable: the largest of the first ten features
    return Recipe(
        name="mlp",
        model=mlp,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        loss_fn=classification_loss,
        dataset=torch.utils.data.TensorDataset(x, y),
        batch_size=32,
    )


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach().float(), expected.detach().float()
    return float((got - expected).norm() / expected.norm())


def test_on_a_cpu_float8_is_not_applicable_and_the_model_is_untouched() -> None:
    model = mlp()
    result = apply_float8_training(model, "cpu")
    assert not result.applied and "compute capability >= 8.9" in result.reason
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


def test_the_tuner_stage_says_why_float8_does_not_apply_here() -> None:
    # The stage's string is its "not applicable" fact: the tuner reports it and trains nothing.
    assert float8_stage(cpu_stage_context(mlp_recipe())) == float8_unavailable("cpu")


def test_on_capable_hardware_without_torchao_the_reason_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(float8_module, "emulated", lambda device, fmt: None)  # "a Hopper GPU"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "pip install 'torchturbo[float8]'" in float8_unavailable("cpu")


def test_the_engine_reports_float8_not_applied_and_trains_exactly_as_without_it() -> None:
    def losses(config: TurboConfig) -> list[float]:
        torch.manual_seed(0)
        recipe = mlp_recipe()
        model, optimizer = recipe.build()
        turbo = Turbo(config)
        turbo.setup(model, optimizer)
        batch = next(iter(torch.utils.data.DataLoader(recipe.dataset, batch_size=32)))
        try:
            return [float(turbo.step(recipe.loss_fn, batch).loss) for _ in range(3)], turbo.applied
        finally:
            turbo.close()

    plain, _ = losses(TurboConfig(device="cpu"))
    asked, applied = losses(TurboConfig(device="cpu").replace(precision__float8=True))
    assert "compute capability" in applied["float8"]
    assert asked == plain  # nothing changed silently


@needs_torchao
def test_conversion_swaps_only_aligned_linears_and_keeps_their_parameters() -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = mlp()
    before = {name: id(p) for name, p in model.named_parameters()}
    assert convertible_linears(model) == ["0", "2"]
    assert convert_linears(model) is None
    assert [type(m) for m in model] == [Float8Linear, nn.GELU, Float8Linear, nn.GELU, nn.Linear]
    # The same Parameter objects: an optimizer built before the swap still updates the model.
    assert {name: id(p) for name, p in model.named_parameters()} == before


@needs_torchao
def test_converted_linears_run_fp8_matmuls_within_fp8_rounding_of_fp32() -> None:
    reference = mlp()
    converted = copy.deepcopy(reference)
    convert_linears(converted)
    x = torch.randn(64, 64)
    # acc_events: torch 2.11 warns on entering profile() without it (its first cycle too).
    with torch.profiler.profile(acc_events=True) as profile:
        out = converted(x)
    assert "aten::_scaled_mm" in {event.name for event in profile.events()}
    expected = reference(x)
    # e4m3 keeps 3 mantissa bits: each operand element is off by up to 2**-4 relative, about
    # 3.6% RMS, so a product of two rounded operands is ~5% off in norm (measured 5.6%). bf16
    # (8 bits) is ~0.4%: the lower bound is the negative control that fp8 really ran.
    error = _relative_error(out, expected)
    assert 0.01 < error < 0.10, error
    out.sum().backward()
    expected.sum().backward()
    for got, want in zip(converted.parameters(), reference.parameters(), strict=True):
        # Gradients go through the e5m2 gradient cast too (2 mantissa bits): up to ~2x the error.
        assert _relative_error(got.grad, want.grad) < 0.15


@needs_torchao
def test_float8_training_keeps_loss_parity_with_fp32(monkeypatch) -> None:
    # Pretend the hardware has fp8 units so that the engine converts for real here (slowly).
    monkeypatch.setattr(float8_module, "emulated", lambda device, fmt: None)
    recipe = mlp_recipe()
    batches = fixed_batches(recipe, 4)
    curves = {}
    for name, config in {
        "fp32": TurboConfig(device="cpu"),
        "float8": TurboConfig(device="cpu").replace(precision__float8=True),
    }.items():
        trial = Trial(recipe, config, batches)
        try:
            for _ in range(PARITY_STEPS):
                trial.step()
            curves[name] = trial.loss_curve()
            assert trial.turbo.applied.get("float8") is None  # converted, not skipped
        finally:
            trial.close()
    parity = loss_parity(curves["fp32"], curves["float8"], tolerance=0.05)
    # The tuner's rule (mean loss over the first steps within 5% of fp32) holds, and the curves
    # are not identical: the fp8 matmuls did change the numbers.
    assert parity.ok and parity.finite, parity
    assert curves["float8"] != curves["fp32"]


@pytest.mark.slow
@needs_torchao
def test_the_tuner_measures_a_float8_candidate_and_gives_a_verdict(monkeypatch) -> None:
    monkeypatch.setattr(float8_module, "emulated", lambda device, fmt: None)
    options = TuneOptions(time_budget_s=60, device="cpu", only=("float8",))
    _, result = tune(mlp_recipe(), options)
    (row,) = [r for r in result.to_dict()["candidates"] if r["name"] == "float8"]
    assert row["config"]["precision"]["float8"] is True
    # On a CPU, _scaled_mm has no fp8 units behind it: far slower, and rejected (by the speed
    # probe, which measures no ratio, or after paired rounds).
    assert row["verdict"] == "rejected", row["reason"]
    assert row["ratio"] is None or row["ratio"] < 1, row["reason"]
