"""The tuner's decision rules, as pure functions of measured numbers.

A candidate replaces the current best only when all of these hold:

* it is faster by more than the noise measured in the same run (a ratio of medians of interleaved
  repeats; the noise band is the repeats' relative spread, never below ``MIN_NOISE``);
* its loss over the first steps, from the same initial weights on the same batches, is finite and
  within ``loss_tolerance`` (relative) of the fp32 baseline's;
* its memory footprint fits the budget, when one is given;
* its one-time cost (compilation, autotuning) pays for itself within the planned run: the
  break-even step count ``one_time_s / (best_step_s - candidate_step_s)`` is at most
  ``planned_steps``.

Keeping these apart from the measuring lets the tests drive them with injected numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: Below this a measured spread is not trusted: 2% is the drift of a quiet machine between runs.
MIN_NOISE = 0.02


@dataclass(frozen=True)
class Parity:
    """Loss of a candidate against the fp32 baseline over the same first steps."""

    reference_loss: float
    loss: float
    relative_diff: float
    finite: bool
    ok: bool


def loss_parity(reference: Sequence[float], candidate: Sequence[float], tolerance: float) -> Parity:
    """Compare mean losses over the steps both curves have (at least one)."""
    steps = min(len(reference), len(candidate))
    if steps == 0:
        raise ValueError("loss parity needs at least one step of each curve")
    ref = sum(reference[:steps]) / steps
    got = sum(candidate[:steps]) / steps
    finite = all(math.isfinite(x) for x in candidate[:steps])
    diff = abs(got - ref) / abs(ref) if ref != 0 else abs(got)
    if not finite:
        diff = math.inf
    return Parity(ref, got, diff, finite, finite and diff <= tolerance)


def break_even_steps(one_time_s: float, best_step_s: float, candidate_step_s: float) -> float:
    """Steps after which a one-time cost is repaid by a faster step; inf if never."""
    saving = best_step_s - candidate_step_s
    if one_time_s <= 0:
        return 0.0
    return one_time_s / saving if saving > 0 else math.inf


@dataclass(frozen=True)
class Verdict:
    adopt: bool
    reason: str


def judge(
    *,
    ratio: float,
    noise: float,
    parity: Parity,
    memory_bytes: int | None,
    memory_budget: int | None,
    break_even: float,
    planned_steps: int,
    tolerance: float,
    must_be_faster: bool = True,
) -> Verdict:
    """Adopt or reject a measured candidate; the reason quotes the numbers that decided.

    ``must_be_faster=False`` is for memory candidates when the current best does not fit the
    budget: then fitting is the gain, and the slowdown is reported rather than disqualifying.
    """
    noise = max(noise, MIN_NOISE)
    if not parity.finite:
        return Verdict(False, "loss parity: the loss became non-finite")
    if not parity.ok:
        return Verdict(
            False,
            f"loss parity: {100 * parity.relative_diff:.1f}% from fp32 > "
            f"{100 * tolerance:.1f}% tolerance ({parity.loss:.4f} vs {parity.reference_loss:.4f})",
        )
    if memory_budget is not None and memory_bytes is not None and memory_bytes > memory_budget:
        return Verdict(
            False,
            f"memory: {memory_bytes / 2**20:.0f} MiB > budget {memory_budget / 2**20:.0f} MiB",
        )
    if not must_be_faster:
        return Verdict(
            True,
            f"fits the memory budget at {ratio:.2f}x the speed, loss within "
            f"{100 * parity.relative_diff:.1f}% of fp32",
        )
    if ratio <= 1 + noise:
        return Verdict(
            False,
            f"not faster: {ratio:.2f}x does not clear the noise band "
            f"(needs > {1 + noise:.2f}x, spread {100 * noise:.0f}%)",
        )
    if break_even > planned_steps:
        return Verdict(
            False,
            f"does not pay back: one-time cost needs {break_even:,.0f} steps, "
            f"{planned_steps:,} planned",
        )
    return Verdict(
        True,
        f"{ratio:.2f}x faster (noise {100 * noise:.0f}%), loss within "
        f"{100 * parity.relative_diff:.1f}% of fp32, pays back after {break_even:,.0f} steps",
    )
