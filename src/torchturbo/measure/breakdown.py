"""The split of a step into phases: input wait, forward, backward, optimizer.

The engine wraps each phase of its step in ``recorder.phase(name)``. By default it holds a
:class:`NullRecorder`, whose phases cost nothing; measurement code swaps in a
:class:`PhaseRecorder` (``with turbo.recording(PhaseRecorder(device)):``) for a breakdown run.

A PhaseRecorder synchronizes the device at the start and end of every phase, so that GPU work is
charged to the phase that queued it. On CUDA that removes the overlap between phases (the CPU can
no longer queue the optimizer while backward kernels run), which slows the step slightly: this
is why breakdown runs are separate from timing runs. On CPU the sync is a no-op and the split
costs only the clock reads. ``torch.profiler`` gives per-op detail, but not this coarse split,
and at a much higher overhead.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from torchturbo.measure.timing import sync

#: The phase names a step is split into.
#: DDP's gradient communication overlaps backward, so it is not a phase of its own: it is counted
#: apart, by the comm hook (torchturbo.distributed.comm).
PHASES = ("input_wait", "forward", "backward", "optimizer")


class Recorder(Protocol):
    """What the engine calls: one context manager per phase, plus readout."""

    def phase(self, name: str) -> AbstractContextManager[None]: ...

    def totals(self) -> dict[str, float]: ...

    def reset(self) -> None: ...


def _check_phase(name: str) -> None:
    if name not in PHASES:
        raise ValueError(f"phase(name={name!r}) is invalid: expected one of {', '.join(PHASES)}")


class PhaseRecorder:
    """Accumulates synchronized wall-clock seconds, and entry counts, per phase name."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._seconds: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._open: str | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` block as phase ``name``. Phases do not nest: time would count twice."""
        _check_phase(name)
        if self._open is not None:
            raise RuntimeError(f"phase {name!r} entered while phase {self._open!r} is open")
        self._open = name
        sync(self.device)
        begin = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - begin
            self._counts[name] = self._counts.get(name, 0) + 1
            self._open = None

    def totals(self) -> dict[str, float]:
        """Seconds per phase name since construction or the last :meth:`reset`."""
        return dict(self._seconds)

    def counts(self) -> dict[str, int]:
        """How many times each phase was entered: divide totals by it for per-step means."""
        return dict(self._counts)

    def reset(self) -> None:
        self._seconds.clear()
        self._counts.clear()


class NullRecorder:
    """The engine's default recorder: phases run as plain blocks, nothing is synced or timed."""

    _NULL = contextlib.nullcontext()

    def phase(self, name: str) -> AbstractContextManager[None]:
        _check_phase(name)  # a typo must fail here too, not only once a PhaseRecorder is in
        return self._NULL

    def totals(self) -> dict[str, float]:
        return {}

    def reset(self) -> None:
        pass
