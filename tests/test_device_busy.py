"""The GPU's regime: the device's busy share of a step, the regime it puts the step in, the levers
the tuner proposes for a launch-bound step and the doctor's line about it. The share itself needs
a GPU (``measure_device_busy`` is None on a CPU, and the CUDA test measures it); everything it
decides is tested here from given shares."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import cpu_stage_context

from torchturbo import TurboConfig
from torchturbo.measure.device_busy import (
    busy_fraction,
    device_intervals,
    measure_device_busy,
    regime,
    regime_words,
)
from torchturbo.techniques.compile import CUDA_GRAPH_SHAPES, compile_stage, cuda_graphs_gain
from torchturbo.workloads import get_workload


def test_the_busy_share_counts_overlapping_kernels_once():
    # Two streams overlapping in 2-3, a gap 5-8: busy 0-5 and 8-10 of a 20 us window.
    assert busy_fraction([(0, 3), (2, 5), (8, 10), (8, 9)], 20) == pytest.approx(0.35)
    assert busy_fraction([], 5) == 0.0
    assert busy_fraction([(0, 30)], 20) == 1.0  # a kernel running past the window
    with pytest.raises(ValueError, match="positive wall time"):
        busy_fraction([(0, 1)], 0)


def test_the_regimes_and_their_lever_lines():
    assert regime(None) is None
    assert regime(0.12) == "launch-bound"
    assert regime(0.65) == "partly launch-bound"
    assert regime(0.93) == "compute-bound"
    line = regime_words(0.12, 0.011)
    assert line.startswith("the device computed 12% of a 11.0 ms step: launch-bound")
    assert "CUDA graphs" in line and "[data] max_shapes" in line and "--find-batch max" in line
    assert "not fewer launches" in regime_words(0.93, 0.2)
    assert "not measured" in regime_words(None, 0.2)


def test_on_a_cpu_there_is_no_busy_share_and_no_step_is_taken():
    steps = []
    assert measure_device_busy(lambda: steps.append(1), torch.device("cpu")) is None
    assert steps == []


def test_only_the_devices_events_are_its_intervals():
    with torch.profiler.profile(acc_events=True) as traced:
        torch.ones(64, 64) @ torch.ones(64, 64)
    assert traced.events() and device_intervals(traced.events()) == []  # CPU ops only


def _facts(busy, **more):
    return cpu_stage_context(None, facts={"device_busy": busy, **more}).facts


def test_cuda_graphs_expect_most_of_the_idle_time_back_and_nothing_without_a_share():
    launch_bound = cuda_graphs_gain(_facts(0.2))
    compute_bound = cuda_graphs_gain(_facts(0.95))
    assert launch_bound.gain > 1.5 > compute_bound.gain > 1
    assert "computes 20% of a step" in launch_bound.evidence
    assert cuda_graphs_gain(_facts(None)).gain is None


def test_on_a_gpu_the_compile_stage_proposes_cuda_graphs_over_a_few_shapes():
    recipe = get_workload("text", num_samples=64)
    gpu = torch.device("cuda")  # a device object: no GPU is needed to ask the stage
    facts = {"device_busy": 0.15, "shapes_vary": True}
    buckets = TurboConfig(device="cpu").replace(data__batches="buckets")
    for best, shapes in (
        (buckets, CUDA_GRAPH_SHAPES),
        (buckets.replace(data__batches="packed"), 1),
    ):
        context = cpu_stage_context(recipe, facts=facts, device=gpu, best=best)
        graphs = {c.name: c for c in compile_stage(context)}["compile:reduce-overhead"]
        assert graphs.config.compile.mode == "reduce-overhead"
        assert graphs.config.data.max_shapes == shapes
        # One compile for every shape (a graph recorded per shape), one shape compiled for.
        assert graphs.config.compile.dynamic is (shapes > 1)
        assert graphs.expected_gain > 2
    # Rows the user's collate pads: no plan of ours to bound, a graph per shape.
    rows = cpu_stage_context(recipe, facts=facts, device=gpu)
    plain = {c.name: c for c in compile_stage(rows)}["compile:reduce-overhead"]
    assert plain.config.data.max_shapes is None
    # On a CPU there are no CUDA graphs to propose.
    on_cpu = cpu_stage_context(recipe, facts=facts)
    assert "compile:reduce-overhead" not in {c.name for c in compile_stage(on_cpu)}


def test_the_doctor_calls_a_launch_bound_step_so_and_names_its_levers(capsys):
    from torchturbo.doctor import diagnose
    from torchturbo.doctor.render import render

    diagnosis = diagnose(get_workload("text", num_samples=64), device="cpu", profile_steps=2)
    assert diagnosis.device_busy is None and diagnosis.bound != "launch-bound"
    gpu_like = dataclasses.replace(diagnosis, device_busy=0.12, bound="launch-bound")
    render(gpu_like)
    out = capsys.readouterr().out
    assert "verdict launch-bound" in out
    assert "device the device computed 12%" in " ".join(out.split())


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@needs_cuda
def test_a_tiny_step_is_launch_bound_and_a_large_product_compute_bound():
    device = torch.device("cuda")
    tiny = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(32)]).to(device)
    x = torch.randn(4, 16, device=device)
    small = measure_device_busy(lambda: tiny(x).sum().backward(), device)
    a = torch.randn(8192, 8192, device=device)
    large = measure_device_busy(lambda: a @ a, device)
    assert small is not None and large is not None
    assert regime(small) == "launch-bound", small
    assert regime(large) == "compute-bound", large


def test_a_cuda_graph_model_begins_a_step_per_call_and_hands_out_its_own_losses(monkeypatch):
    """On a CPU, reduce-overhead compiles without CUDA graphs; what the engine needs of them
    (a new step each call, losses that survive the next replay) is the wrapper's, checked here
    with dynamo's eager backend standing in for inductor."""
    from torchturbo.config import CompileConfig
    from torchturbo.techniques.compile import apply_compile, compile_options

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    monkeypatch.setattr(
        "torchturbo.techniques.compile.compile_options",
        lambda config: {**compile_options(config), "mode": None, "backend": "eager"},
    )

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            out = self.linear(x)
            return {"loss": out.square().mean(), "logits": out}

    model = WithLoss()
    assert apply_compile(model, CompileConfig(mode="reduce-overhead")).applied
    x = torch.randn(2, 4)
    first, second = model(x), model(x)
    assert len(marks) == 2
    assert first["loss"] is not second["loss"] and torch.equal(first["loss"], second["loss"])
    # Negative control: another mode leaves the calls alone.
    marks.clear()
    plain = WithLoss()
    apply_compile(plain, CompileConfig(mode="default"))
    plain(x)
    assert marks == []


@pytest.mark.cuda
@needs_cuda
def test_an_engine_with_cuda_graphs_keeps_every_loss_it_reports():
    """A Llama whose forward computes its loss inside the graph, on packed rows of one shape:
    every loss reported stays readable after later replays."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "recipes"))
    import hf_causal_lm

    from torchturbo import Turbo

    documents = hf_causal_lm.documents()
    model = hf_causal_lm.model()
    model.config.use_cache = False
    config = TurboConfig(device="cuda").replace(
        compile__mode="reduce-overhead",
        compile__dynamic=False,
        data__batches="packed",
        data__max_shapes=1,
    )
    turbo = Turbo(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lengths = [len(d["input_ids"]) for d in documents]
    _, _, loader = turbo.setup(model, optimizer, documents, lengths=lengths, batch_size=4)
    losses = []
    for _, batch in zip(range(8), loader, strict=False):
        losses.append(turbo.step(lambda m, b: m(**b).loss, batch).loss)
    assert all(torch.isfinite(loss) for loss in losses)  # read after later replays
