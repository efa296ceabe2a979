"""The tuner's budgets: time on an injectable clock, what its steps are expected to cost, and
the budgets no run can keep (:func:`one_decision_s`, :func:`memory_floor`).

Estimates are made from step times measured in this run, so a slow model or a busy machine makes
every candidate proportionally dearer: the tuner then measures fewer of them, the most promising
first, and says how long the others would have needed. The clock is a parameter so that tests can
run the planning as if each step took seconds.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

from torchturbo.measure.system import usable_cores
from torchturbo.output.tables import format_bytes
from torchturbo.techniques.framework.decide import MIN_ROUNDS
from torchturbo.techniques.framework.facts import Facts

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


class BudgetError(ValueError):
    """A budget no run can keep: the message gives the figure that makes it impossible and
    the smallest budget that could work (the command exits 2 with it)."""


def one_decision_s(
    *,
    spent_s: float,
    build_s: float,
    step_s: float,
    steps_per_round: int,
    warm_steps: int,
    report_s: float,
) -> float:
    """Seconds a run needs to decide one candidate, known once the baseline's first steps are
    timed: what it spent so far, then the cheapest candidate (one that compiles nothing and is
    as fast as the baseline: a build, its first and warm-up steps and the memory probe, and
    ``MIN_ROUNDS`` paired rounds), its confirmation against the baseline and the report.

    The one rule for "the budget cannot decide anything": ``tune`` refuses a budget under it
    (:func:`refuse_short_time_budget`), and a search that plans its rounds can ask it too.
    """
    fixed = build_s + (2 + warm_steps) * step_s
    candidate = candidate_seconds(fixed, steps_per_round, MIN_ROUNDS, step_s, step_s)
    confirmation = confirm_seconds(step_s, step_s, lambda _: steps_per_round)
    return spent_s + candidate + confirmation + report_s


def refuse_short_time_budget(budget_s: float, needed_s: float, step_s: float) -> None:
    """A :class:`BudgetError` when ``budget_s`` is under :func:`one_decision_s`'s ``needed_s``."""
    if budget_s >= needed_s:
        return
    raise BudgetError(
        f"--time-budget {budget_s:g} s cannot decide a single candidate: the fp32 eager step "
        f"takes {step_s:.3g} s here, and the baseline, one candidate in {MIN_ROUNDS} paired "
        f"rounds, its confirmation and the report need about {needed_s:.0f} s; give "
        f"--time-budget {readable_seconds(needed_s)} or more"
    )


def memory_floor(weights: int, gradients: int, optimizer_state: int) -> int:
    """Bytes every step of the recipe holds whatever the plan: its weights, their gradients
    and the optimizer's state. The tuner's memory techniques (checkpointing, micro-batches,
    bf16 activations, chunked losses) shrink what the forward saves, never these; a technique
    that shrinks them (low-bit optimizer state, sharding) changes this floor."""
    return weights + gradients + optimizer_state


def refuse_impossible_memory_budget(
    budget: int, *, weights: int, gradients: int, optimizer_state: int, step_bytes: int | None
) -> None:
    """A :class:`BudgetError` when ``budget`` is under :func:`memory_floor`."""
    floor = memory_floor(weights, gradients, optimizer_state)
    if budget >= floor:
        return
    step = f"; the fp32 eager step holds {format_bytes(step_bytes)}" if step_bytes else ""
    raise BudgetError(
        f"--memory-budget {format_bytes(budget)} is below what any step of this model holds: "
        f"weights {format_bytes(weights)} + gradients {format_bytes(gradients)} + optimizer "
        f"state {format_bytes(optimizer_state)} = {format_bytes(floor)}, which no plan "
        f"shrinks (plans shrink activations){step}; give --memory-budget "
        f"{readable_bytes(floor)} or more (activations come on top)"
    )


def readable_seconds(seconds: float) -> str:
    """A duration rounded up to what one would type: ``35s``, ``4m``, ``2h``."""
    if seconds <= 120:
        return f"{5 * math.ceil(seconds / 5):.0f}s"
    if seconds <= 7200:
        return f"{math.ceil(seconds / 60)}m"
    return f"{math.ceil(seconds / 3600)}h"


def readable_bytes(size: int) -> str:
    """A size rounded up to what one would type: ``48KiB``, ``1.6GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= 10 * scale:
            return f"{math.ceil(size / scale)}{unit}"
        if size >= scale:
            return f"{math.ceil(10 * size / scale) / 10:g}{unit}"
    return f"{size}B"
