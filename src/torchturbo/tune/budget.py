"""The tuner's time budget, on an injectable clock, and what its steps are expected to cost.

Estimates are made from step times measured in this run, so a slow model or a busy machine makes
every candidate proportionally dearer: the tuner then measures fewer of them, the most promising
first, and says how long the others would have needed. The clock is a parameter so that tests can
run the planning as if each step took seconds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from torchturbo.measure.system import usable_cores
from torchturbo.techniques.framework.facts import Facts
from torchturbo.tune.decide import MIN_ROUNDS

#: torch.compile's cost on a 2-core CPU, fitted to the built-in workloads and Hugging Face
#: encoders (torch 2.13): about 15 s to start inductor plus ~0.3 s per leaf module traced.
COMPILE_BASE_S = 15.0
COMPILE_PER_MODULE_S = 0.3
#: Rounds of the confirmation held back in the budget: enough to confirm a clear gain.
CONFIRM_ROUNDS = MIN_ROUNDS + 2


class Budget:
    """Seconds allowed for a run, counted on ``clock`` from when the budget was made."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds = seconds
        self.clock = clock
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        """Seconds left; negative once overrun."""
        return self.seconds - self.elapsed()


def candidate_seconds(
    fixed_s: float, steps_per_round: int, rounds: int, best_step_s: float, step_s: float
) -> float:
    """A candidate's cost: one-time work (build, first steps, compile) plus paired rounds."""
    return fixed_s + rounds * steps_per_round * (best_step_s + step_s)


def confirm_seconds(
    baseline_step_s: float, best_step_s: float, steps_per_round: Callable[[float], int]
) -> float:
    """The confirmation's cost: ``CONFIRM_ROUNDS`` paired rounds of baseline and best."""
    per_round = steps_per_round(min(baseline_step_s, best_step_s))
    return CONFIRM_ROUNDS * per_round * (baseline_step_s + best_step_s)


def compile_seconds(facts: Facts, *, regional: bool = False) -> float:
    """The expected one-time cost of compiling the model (see ``COMPILE_BASE_S``); with
    ``regional``, of compiling its repeated blocks, which traces one block of each kind.

    Varying batch shapes compile twice (the first graph is specialised, the second dynamic); a
    machine busier than it has cores compiles proportionally slower (compiling runs on the CPU
    even when training runs on a GPU). A compile cannot be stopped half-way, so the estimate errs
    high: starting one that overruns would break the budget.
    """
    traced = facts.leaf_modules
    if regional and facts.block_leaf_modules is not None:
        traced = facts.block_leaf_modules
    seconds = COMPILE_BASE_S + COMPILE_PER_MODULE_S * traced
    if facts.shapes_vary:
        seconds *= 2
    return seconds * machine_load()


def machine_load() -> float:
    """How many times over its cores the machine is busy (1 when idle or unknown, at most 4)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return min(4.0, max(1.0, load / usable_cores()))
