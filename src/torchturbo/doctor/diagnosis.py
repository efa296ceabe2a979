"""The doctor's result: the article's 15-item checklist with a state and evidence per item, plus
the profile it was judged from (step breakdown, top operators, peak memory, verdict, trace)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torchturbo.measure.footprint import MemoryEstimate

#: The article's closing checklist: 5 groups of 3 items, in its order.
CHECKLIST: dict[str, tuple[str, ...]] = {
    "data flow": ("DataLoader configuration", "preprocessing on the device", "memory-mapped files"),
    "model": ("mixed precision", "operator fusion", "channels_last"),
    "training": ("gradient accumulation", "dynamic batching", "activation checkpointing"),
    "hardware": ("custom kernels", "TensorCore alignment", "distributed strategy"),
    "monitoring": ("profiler bottlenecks", "memory analysis", "communication efficiency"),
}

#: applied: in use. recommended: would help here (the evidence says why, the gain how much when
#: a quick measurement gave one; a measured gain is only recommended when it clears the tuner's
#: noise rule). within noise: measured, and the gain did not clear the noise. ok: checked,
#: nothing to change. not applicable: nothing for the technique to act on in this setup, or it
#: cannot be judged here (the evidence says which).
State = Literal["applied", "recommended", "within noise", "not applicable", "ok"]
STATES: tuple[str, ...] = ("applied", "recommended", "within noise", "not applicable", "ok")

#: input-bound: the step waits for its batches; launch-bound: the GPU is idle most of the step
#: (``measure.device_busy``); compute-bound: neither.
Bound = Literal["input-bound", "launch-bound", "compute-bound"]


@dataclass(frozen=True)
class Lever:
    """A lever as ranked for this model and machine (see ``Diagnosis.levers``)."""

    name: str
    #: The one figure shown and ranked by: the measured ratio where the doctor timed the lever
    #: (``measured``), else the expected gain (None: cannot help here).
    expected_gain: float | None
    evidence: str
    measured: bool = False


@dataclass(frozen=True)
class Item:
    """One checklist item as judged on the user's model and loader."""

    group: str
    name: str
    state: State
    evidence: str
    estimated_gain: str | None = None

    def __post_init__(self) -> None:
        if self.name not in CHECKLIST.get(self.group, ()):
            raise ValueError(
                f"Item(group={self.group!r}, name={self.name!r}) is not a checklist item; "
                f"expected one of {CHECKLIST}"
            )
        if self.state not in STATES:
            raise ValueError(f"Item(state={self.state!r}) is invalid: expected one of {STATES}")


@dataclass(frozen=True)
class Diagnosis:
    """Everything ``torchturbo doctor`` found. Times are seconds (breakdown) or ms per step."""

    workload: str
    device: str
    items: list[Item]
    #: Mean seconds per step of each phase: input_wait, forward, backward, optimizer.
    breakdown: dict[str, float]
    #: (operator, self time in ms per step, share of all operators' self time), largest first.
    top_operators: list[tuple[str, float, float]]
    peak_memory_bytes: int
    #: What the peak measures (see measure.memory.PeakMemory.kind).
    peak_memory_kind: str
    bound: Bound
    trace_path: Path | None
    #: Wall-clock seconds the whole diagnosis took.
    elapsed_s: float
    #: Processes under torchrun (1 without it); figures are rank 0's.
    processes: int = 1
    #: DDP gradient bytes all-reduced per step by this rank, and seconds with a reduction in
    #: flight per step (overlapping backward); None without DDP.
    comm_bytes_per_step: float | None = None
    comm_seconds_per_step: float | None = None
    #: The levers on this model and machine, by the gain measured here where the doctor timed
    #: one, else the expected gain (``techniques.framework.levers``, what the tuner orders its
    #: work by): ``doctor.levers``. Each: name, the figure (None: cannot help here), and the
    #: evidence.
    levers: list[Lever] = dataclasses.field(default_factory=list)
    #: The fp32 eager step's memory, estimated from one instrumented step on slices of a batch
    #: (``trials.memory_estimate``); None, and the reason in the note, where it failed.
    memory_estimate: MemoryEstimate | None = None
    memory_estimate_note: str = ""
    #: The GPU's busy share of a step (``measure.device_busy``); None on a CPU.
    device_busy: float | None = None

    def item(self, name: str) -> Item:
        """The item called ``name`` (a KeyError lists the names)."""
        for item in self.items:
            if item.name == name:
                return item
        raise KeyError(f"no item {name!r}; items: {[i.name for i in self.items]}")

    @property
    def step_seconds(self) -> float:
        return sum(self.breakdown.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: paths become strings, tuples lists."""
        out = dataclasses.asdict(self)
        out["memory_estimate"] = (
            None if self.memory_estimate is None else self.memory_estimate.to_dict()
        )
        out["trace_path"] = None if self.trace_path is None else str(self.trace_path)
        out["top_operators"] = [
            {"name": name, "self_ms_per_step": ms, "share": share}
            for name, ms, share in self.top_operators
        ]
        return out
