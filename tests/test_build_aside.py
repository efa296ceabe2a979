"""torch.compile inside the run (``engine/build_aside.py``, ``engine/in_run.py``): built aside
while the job trains, found by the model's own compile, switched per window and measured, and
not built at all where the job's steps left cannot pay for it."""

from __future__ import annotations

import pytest
import torch
from conftest import _windows_faster_with
from torch import nn

from torchturbo import Turbo, TurboConfig
from torchturbo.engine.build_aside import Build, build_aside, copy_shortage
from torchturbo.engine.in_run import BUILD_WINDOWS, Comparison, InRunTuner
from torchturbo.techniques import compile as compile_technique
from torchturbo.techniques import registry
from torchturbo.techniques.compile import apply_compile
from torchturbo.techniques.framework.decide import MIN_ROUNDS

CPU = torch.device("cpu")
IN_RUN = TurboConfig(device="cpu").replace(tune__in_run=True)
COMPILED = IN_RUN.replace(compile__mode="default")


def _compile_comparison(gain: float = 1.15, cost_s: float = 10.0) -> Comparison:
    comparison = Comparison(
        "compile", {"compile__mode": "default"}, {"compile__mode": "off"}, started=False
    )
    comparison.built_aside, comparison.expected_gain, comparison.build_cost_s = True, gain, cost_s
    return comparison


def _bf16_comparison() -> Comparison:
    return Comparison("bf16", {"precision__dtype": "bf16"}, {"precision__dtype": "fp32"})


def _run_windows(tuner: InRunTuner, count: int, seconds: float = 1.0) -> None:
    for _ in range(count):
        side = tuner.side(lambda with_config, without: (1.0, 1.0))
        tuner.window_done(side, seconds, 100)
        tuner.windows_run += 1


def test_the_build_waits_for_the_other_comparisons_then_for_a_paying_horizon():
    compile_ = _compile_comparison(gain=1.15, cost_s=10.0)
    tuner = InRunTuner(IN_RUN, [], [_bf16_comparison(), compile_], planned_steps=1000, device=CPU)
    assert tuner.to_build() is None  # bf16 is measured first: a build would take its CPU
    _run_windows(tuner, 2 * MIN_ROUNDS + 4, seconds=1.0)  # equal sides: bf16 is dropped
    while tuner.comparisons[0].verdict in ("waiting", "measuring"):
        _run_windows(tuner, 4)
    # ~990 steps of 1 s at 1.15x save ~130 s, more than the build's 10 s: build it.
    assert tuner.to_build() is compile_ and compile_.verdict == "waiting"
    assert tuner.current is None  # measured only once built
    compile_.build = Build()
    _run_windows(tuner, 3)
    assert compile_.verdict == "waiting" and tuner.current is None


@pytest.mark.parametrize(
    ("planned", "cost_s", "why"),
    [(BUILD_WINDOWS - 1, 0.0, "too few"), (1000, 1e6, "less than")],
)
def test_a_build_the_steps_left_cannot_pay_for_is_not_started(planned, cost_s, why):
    compile_ = _compile_comparison(cost_s=cost_s)
    tuner = InRunTuner(IN_RUN, [], [compile_], planned_steps=planned, device=CPU)
    _run_windows(tuner, 1)
    assert tuner.to_build() is None
    assert compile_.verdict == "undecided" and why in compile_.evidence
    assert tuner.config.compile.mode == "off"


def test_a_failed_build_drops_the_choice_with_the_compile_error():
    compile_ = _compile_comparison()
    tuner = InRunTuner(IN_RUN, [], [compile_], planned_steps=1000, device=CPU)

    def warm(model: nn.Module) -> None:
        raise RuntimeError("inductor: no C++ compiler\nmore lines")

    def prepare(model: nn.Module) -> str:
        return apply_compile(model, COMPILED.compile).reason or ""

    compile_.build = build_aside(nn.Linear(4, 4), prepare, warm)
    assert compile_.build.done.wait(timeout=60)
    _run_windows(tuner, 1)
    assert compile_.verdict == "dropped"
    assert compile_.evidence == "building aside failed: RuntimeError: inductor: no C++ compiler"
    assert tuner.config.compile.mode == "off"


def test_a_copy_is_built_on_an_accelerator_only_where_its_memory_holds_one():
    gib = 2**30
    assert copy_shortage(gib, 4 * gib, "cuda:0") == ""
    assert copy_shortage(gib, 3 * gib, "cuda:0") == (
        "not built aside: cuda:0 has 3.0 GiB free, a copy of the model needs about 4.0 GiB "
        "beside the job"
    )


def test_the_compile_toggle_switches_a_model_between_compiled_and_eager_calls():
    model = nn.Sequential(nn.Linear(4, 4))
    wrapped = nn.ModuleDict({"inner": nn.Linear(4, 4)})
    for module in (model, wrapped):
        assert apply_compile(module, COMPILED.compile).applied
    compiled_forward = model.forward
    registry.set_toggles(model, IN_RUN)  # compile off: the class's forward again
    assert "forward" not in model.__dict__
    registry.set_toggles(model, COMPILED)
    assert model.forward is compiled_forward
    compiled_call = wrapped._compiled_call_impl
    registry.set_toggles(wrapped, IN_RUN)
    assert wrapped._compiled_call_impl is None
    registry.set_toggles(wrapped, COMPILED)
    assert wrapped._compiled_call_impl is compiled_call


class Pairs(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 16, generator=generator)
        self.y = self.x @ torch.randn(16, 4, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


def _mse(model: nn.Module, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def test_a_compile_built_aside_is_found_by_the_model_measured_and_computes_its_loss(
    monkeypatch,
):
    """The engine builds the compile on a copy in the background; the model's first compiled
    window then traces no new graph, its loss on the same batch matches eager's, and the
    job's steps (compiled windows timed at half here) adopt it."""
    _windows_faster_with(monkeypatch, lambda config: config.compile.mode != "off")
    monkeypatch.setattr(compile_technique, "SECONDS_PER_LEAF", 0.0)
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    turbo = Turbo(IN_RUN)
    _, _, loader = turbo.setup(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        Pairs(),
        batch_size=8,
        planned_steps=400,
    )
    (compile_,) = [c for c in turbo.in_run.comparisons if c.name == "compile"]
    graphs_after_build = None
    losses = []
    for _ in range(50):
        for batch in loader:
            losses.append(float(turbo.step(_mse, batch).loss))
            if compile_.build is not None and graphs_after_build is None:
                assert compile_.build.done.wait(timeout=300), "the build did not finish"
                graphs_after_build = counters["stats"]["unique_graphs"]
        if compile_.verdict not in ("waiting", "measuring"):
            break
    assert compile_.build.error == "" and compile_.built_seconds > 0
    assert compile_.verdict == "adopted", compile_.evidence
    assert counters["stats"]["unique_graphs"] == graphs_after_build  # the copy's graphs served
    assert turbo.config.compile.mode == "default" and turbo.applied["compile"] is None
    assert losses[-1] < losses[0]
    batch = next(iter(loader))
    with torch.no_grad():
        compiled = _mse(turbo.model, batch)
        registry.set_toggles(turbo.model, IN_RUN)
        eager = _mse(turbo.model, batch)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
