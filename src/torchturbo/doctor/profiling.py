"""A short instrumented training run through the engine: the phase split of a step (input wait,
forward, backward, optimizer, communication), the operators that take the time, the peak memory,
and optionally a Chrome/Perfetto trace.

Two passes over the same engine and loader. The breakdown pass times phases with a
``PhaseRecorder`` and no profiler, so its times carry no profiler overhead. The profiler pass
(``torch.profiler`` with a wait/warm-up/active schedule) labels the same phases with
``record_function`` so the trace shows them, and yields the operators' self times.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, record_function
from torch.utils.data import DataLoader

from torchturbo.config import TurboConfig
from torchturbo.distributed.comm import CommStats
from torchturbo.distributed.launch import current_env
from torchturbo.doctor.data_facts import BatchShapes, batch_shapes
from torchturbo.engine import Turbo
from torchturbo.measure.breakdown import PHASES, PhaseRecorder
from torchturbo.measure.device_busy import measure_device_busy
from torchturbo.measure.memory import PeakMemory, track_peak_memory
from torchturbo.recipe import Recipe
from torchturbo.techniques.framework.result import TechniqueResult

#: How many operators the result lists.
TOP_OPERATORS = 10
_EMPTY = object()


@dataclass(frozen=True)
class ProfileResult:
    #: Mean seconds per step of each phase in PHASES.
    breakdown: dict[str, float]
    #: (operator, self ms per step, share of all operators' self time), largest first.
    top_operators: list[tuple[str, float, float]]
    peak: PeakMemory
    #: The tensor shapes of every batch the run drew, in order.
    shapes: list[BatchShapes]
    trace_path: Path | None
    #: ``Turbo.applied``: technique -> None when applied, else why not.
    applied: dict[str, str | None]
    checkpointed_blocks: list[str]
    #: Under torchrun with DDP: gradient bytes this rank all-reduced per step, and seconds per
    #: step with a bucket reduction in flight (it overlaps backward). None otherwise.
    comm_bytes_per_step: float | None = None
    comm_seconds_per_step: float | None = None
    #: The GPU's busy share of a step (``measure.device_busy``); None on a CPU.
    device_busy: float | None = None


def profile_training(
    recipe: Recipe,
    config: TurboConfig,
    loader: DataLoader,
    *,
    steps: int,
    trace_dir: Path | None,
) -> ProfileResult:
    """Train a fresh model of the recipe for ``2 * steps + 3`` steps and measure them (and four
    more on a GPU, for the device's busy share: ``measure.device_busy``)."""
    turbo = Turbo(config)
    model, optimizer = recipe.build()
    distributed = current_env().is_distributed
    comm = CommStats() if distributed and config.distributed.strategy == "ddp" else None
    model, _, epoch_loader = turbo.setup(model, optimizer, loader, comm_stats=comm)
    batches = _Batches(epoch_loader)
    try:
        # The first step pays one-time costs (lazy init, allocator growth, compilation).
        turbo.step(recipe.loss_fn, batches.next())
        if comm is not None:
            comm.reset()
        breakdown, peak = _breakdown(turbo, recipe, batches, steps)
        comm_totals = comm.as_dict() if comm is not None else None
        top, trace_path = _profile(turbo, recipe, batches, steps, trace_dir)
        busy = measure_device_busy(lambda: turbo.step(recipe.loss_fn, batches.next()), turbo.device)
    finally:
        batches.close()
        turbo.close()
    return ProfileResult(
        breakdown=breakdown,
        top_operators=top,
        peak=peak,
        shapes=batches.shapes,
        trace_path=trace_path,
        applied=dict(turbo.applied),
        checkpointed_blocks=_targets(turbo.results.get("checkpointing")),
        comm_bytes_per_step=comm_totals["bytes"] / steps if comm_totals else None,
        comm_seconds_per_step=(
            comm_totals["seconds"] / steps
            if comm_totals and comm is not None and comm.timed
            else None
        ),
        device_busy=busy,
    )


def _targets(result: TechniqueResult | None) -> list[str]:
    """The modules a technique acted on (checkpointing's blocks); none when it did not run."""
    return list(result.targets) if result is not None else []


def _breakdown(
    turbo: Turbo, recipe: Recipe, batches: _Batches, steps: int
) -> tuple[dict[str, float], PeakMemory]:
    recorder = PhaseRecorder(turbo.device)
    with turbo.recording(recorder), track_peak_memory(turbo.device) as peak:
        for _ in range(steps):
            with recorder.phase("input_wait"):
                batch = batches.next()
            turbo.step(recipe.loss_fn, batch)
    totals = recorder.totals()
    return {phase: totals.get(phase, 0.0) / steps for phase in PHASES}, peak


def _profile(
    turbo: Turbo, recipe: Recipe, batches: _Batches, steps: int, trace_dir: Path | None
) -> tuple[list[tuple[str, float, float]], Path | None]:
    activities = [ProfilerActivity.CPU]
    if turbo.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    trace_path = None
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        # "*.pt.trace.json" is the name TensorBoard's profiler plugin and Perfetto both open.
        env = current_env()  # under torchrun every rank writes its own trace
        rank = f".rank{env.rank}" if env.is_distributed else ""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        trace_path = trace_dir / f"{recipe.name}.{stamp}{rank}.pt.trace.json"
    export = (lambda p: p.export_chrome_trace(str(trace_path))) if trace_path else None
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=steps)
    quiet_kineto()
    with (
        turbo.recording(_TraceLabels()),
        torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=export,
            # One cycle either way; torch 2.11 warns on its first cycle without it.
            acc_events=True,
        ) as prof,
    ):
        for _ in range(steps + 2):
            with record_function("torchturbo.input_wait"):
                batch = batches.next()
            turbo.step(recipe.loss_fn, batch)
            prof.step()
    return _top_operators(prof.key_averages(), steps, on_device=turbo.device.type == "cuda"), (
        trace_path
    )


#: Kineto (torch.profiler's C++ side) writes "USDT: ... profiler_start" and "STAGE: ..."
#: lines to descriptor 2 at every profile, below its highest level: 6, the count of its levels
#: (VERBOSE 0 ... USDT 5), prints none of them.
_KINETO_SILENT = "6"


def quiet_kineto() -> None:
    """Keep kineto's own log lines off the terminal and out of a piped log, unless the user
    asked for them with ``KINETO_LOG_LEVEL``. Kineto reads the variable when it starts its
    first profile, so setting it here, before the profiler starts, is in time; profiler errors
    still raise in Python."""
    os.environ.setdefault("KINETO_LOG_LEVEL", _KINETO_SILENT)


def _top_operators(events: Any, steps: int, *, on_device: bool) -> list[tuple[str, float, float]]:
    """Operators by self time (device time on CUDA, CPU time otherwise); labels are skipped."""
    self_us = {}
    for event in events:
        if event.is_user_annotation or event.key.startswith("ProfilerStep#"):
            continue
        value = event.self_device_time_total if on_device else event.self_cpu_time_total
        if value > 0:
            self_us[event.key] = value
    total = sum(self_us.values())
    ranked = sorted(self_us.items(), key=lambda kv: -kv[1])[:TOP_OPERATORS]
    return [(name, us / 1e3 / steps, us / total) for name, us in ranked]


class _TraceLabels:
    """A recorder that marks each phase in the profiler trace instead of timing it."""

    def phase(self, name: str) -> record_function:
        return record_function(f"torchturbo.{name}")

    def totals(self) -> dict[str, float]:
        return {}

    def reset(self) -> None:
        pass


class _Batches:
    """An endless stream over a loader (a new epoch when one ends) that notes batch shapes."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self._iterator = iter(loader)
        self.shapes: list[BatchShapes] = []

    def next(self) -> Any:
        try:
            batch = next(self._iterator)
        except StopIteration:
            self.close()
            self._iterator = iter(self._loader)
            batch = next(self._iterator, _EMPTY)
            if batch is _EMPTY:
                raise ValueError(
                    "the loader yields no batches: check the dataset and batch size"
                ) from None
        self.shapes.append(batch_shapes(batch))
        return batch

    def close(self) -> None:
        close = getattr(self._iterator, "close", None)  # ends the epoch generator and workers
        if close is not None:
            close()
