"""How busy the device is during a training step: launch- or host-bound against compute-bound.

A GPU step of milliseconds is often bound by the host, not the GPU: Python, the dispatcher and one
kernel launch per op cost microseconds each, and a small model's kernels finish before the host
has queued the next (the first H200 run: every built-in workload's step took ~11 ms with the GPU
mostly idle). Such a step is not sped up by faster maths (bf16 measured 0.91x there) but by fewer
launches: CUDA graphs (compile mode reduce-overhead) over a few fixed batch shapes, a fused
optimizer step, more tokens per step. The figure that tells the two regimes apart is the share of
the step's wall time in which the device runs a kernel or a copy: the union of the device's
intervals in a ``torch.profiler`` trace of a few synced steps, over their wall time. Only the
device's activity is traced, so the host is barely slowed by the tracing; the little it is
makes the figure, if anything, an underestimate.

On a CPU the host is the device: there is no such figure (None). Hand-written: the profiler gives
the intervals, nothing in torch sums their union.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from torchturbo.measure.timing import sync

#: Below this share of the step the device is idle more than busy: launch- or host-bound.
LAUNCH_BOUND = 0.5
#: From this share up the step is compute-bound: launch overhead is hidden behind the kernels.
COMPUTE_BOUND = 0.8
#: Steps traced (after one untraced step, which may pay one-time costs).
STEPS = 3

Regime = Literal["launch-bound", "partly launch-bound", "compute-bound"]


def busy_fraction(intervals: Iterable[tuple[float, float]], wall: float) -> float:
    """The share of ``wall`` covered by the union of ``intervals`` ((start, end) in the same
    unit), at most 1: overlapping kernels (two streams) count once."""
    if wall <= 0:
        raise ValueError(f"busy_fraction needs a positive wall time, got {wall}")
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return min(1.0, covered / wall)


def regime(busy: float | None) -> Regime | None:
    """The regime a busy share puts a step in; None where it was not measured."""
    if busy is None:
        return None
    if busy < LAUNCH_BOUND:
        return "launch-bound"
    return "partly launch-bound" if busy < COMPUTE_BOUND else "compute-bound"


def device_intervals(events: Iterable[Any]) -> list[tuple[float, float]]:
    """(start, end) in microseconds of the device's events in a profiler's ``events()``."""
    device = torch.autograd.DeviceType.CUDA
    return [
        (float(event.time_range.start), float(event.time_range.end))
        for event in events
        if event.device_type == device
    ]


def measure_device_busy(
    step: Callable[[], Any], device: torch.device, steps: int = STEPS
) -> float | None:
    """The device's busy share over ``steps`` calls of ``step()`` (a training step), after one
    untraced call; None on a CPU, or where the profiler saw no device activity."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    step()
    sync(device)
    # acc_events: one cycle either way; torch 2.11 warns on its first cycle without it.
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as traced:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        wall_us = (time.perf_counter() - start) * 1e6
    intervals = device_intervals(traced.events())
    return busy_fraction(intervals, wall_us) if intervals else None


def regime_words(busy: float | None, step_s: float) -> str:
    """One line: how busy the device was, the regime, and the levers for it."""
    found = regime(busy)
    if found is None or busy is None:
        return "the device's busy share was not measured (on a CPU the host is the device)"
    head = f"the device computed {busy:.0%} of a {step_s * 1e3:.1f} ms step: {found}"
    if found == "compute-bound":
        return f"{head}; faster maths (bf16, fused kernels) is the lever, not fewer launches"
    return (
        f"{head}; levers: CUDA graphs over a few batch shapes (compile mode reduce-overhead, "
        "[data] max_shapes), a fused optimizer step, more tokens per step (tune --find-batch "
        "max: a larger batch, which you must allow)"
    )
