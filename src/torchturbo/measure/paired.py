"""Paired rounds: a candidate timed against a reference, round by round, until decided.

Each round times ``steps_per_round`` steps of each side, the side that goes first alternating from
round to round (A B, B A, ...) so that drift of the machine hits both alike. A round longer than a
block (``steps_per_block``: a whole cycle of variable-length batches, say) is cut into blocks that
alternate A B A B within the round, so that a busy spell of a second or two lands on both sides
rather than on whichever side it met: on a loaded 2-core machine rounds of whole 8-step cycles
gave per-round ratios from 0.34x to 10.5x for length buckets that ran 1.9x. When the two sides train
the same batches in step, a round's ratio cancels how costly its batches were; when they train
different batches (length buckets against padded ones), the ratio is of throughputs, counting the
samples or tokens each block processed. After every round ``stop(rounds)`` is asked whether the
comparison is decided (the tuner's sequential rule, ``techniques.framework.decide.estimate``)
or out of time, so a large effect costs three rounds and a slow model is not measured longer
than it can afford.

``measure_interleaved`` times a fixed number of repeats of any number of variants; this is its
two-variant, sequential form.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchturbo.measure.timing import sync


@dataclass(frozen=True)
class Side:
    """One side of a comparison: its step, and the samples or tokens of its last ``n`` steps."""

    step: Callable[[], Any]
    recent_count: Callable[[int], float] = float


@dataclass(frozen=True)
class Round:
    """Seconds per step and samples (or tokens) per step of each side in one round."""

    reference_s: float
    candidate_s: float
    reference_count: float
    candidate_count: float

    @property
    def ratio(self) -> float:
        """The candidate's throughput over the reference's in this round."""
        return (self.candidate_count / self.candidate_s) / (self.reference_count / self.reference_s)


def paired_rounds(
    reference: Side,
    candidate: Side,
    *,
    device: torch.device | str,
    steps_per_round: int,
    max_rounds: int,
    stop: Callable[[list[Round]], bool],
    steps_per_block: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[Round]:
    """Time rounds until ``stop(rounds)`` says so or ``max_rounds`` are done; return them all.
    Each round is cut into alternating blocks of ``steps_per_block`` steps (default: one block
    of the whole round)."""
    if steps_per_round < 1 or max_rounds < 1:
        raise ValueError(
            f"paired_rounds(steps_per_round={steps_per_round}, max_rounds={max_rounds}) needs "
            "both >= 1"
        )
    device = torch.device(device)
    rounds: list[Round] = []
    while len(rounds) < max_rounds:
        reference_first = len(rounds) % 2 == 0
        order = (reference, candidate) if reference_first else (candidate, reference)
        seconds = interleaved_round(
            [side.step for side in order],
            steps_per_round,
            steps_per_block or steps_per_round,
            device,
            clock,
        )
        reference_s, candidate_s = seconds if reference_first else seconds[::-1]
        rounds.append(
            Round(
                reference_s=reference_s,
                candidate_s=candidate_s,
                reference_count=reference.recent_count(steps_per_round) / steps_per_round,
                candidate_count=candidate.recent_count(steps_per_round) / steps_per_round,
            )
        )
        if stop(rounds):
            break
    return rounds


def interleaved_round(
    steps: Sequence[Callable[[], Any]],
    steps_per_round: int,
    steps_per_block: int,
    device: torch.device,
    clock: Callable[[], float],
) -> list[float]:
    """Seconds per step of each of ``steps`` over ``steps_per_round`` calls, timed in blocks of
    ``steps_per_block`` that take turns in the given order (the last block may be shorter)."""
    if steps_per_block < 1:
        raise ValueError(f"interleaved_round(steps_per_block={steps_per_block}) needs >= 1")
    seconds = [0.0] * len(steps)
    done = 0
    while done < steps_per_round:
        block = min(steps_per_block, steps_per_round - done)
        for i, step in enumerate(steps):
            seconds[i] += time_block(step, block, device, clock) * block
        done += block
    return [s / steps_per_round for s in seconds]


def time_block(
    step: Callable[[], Any], steps: int, device: torch.device, clock: Callable[[], float]
) -> float:
    """Seconds per step of ``steps`` calls of ``step``, the device synchronized around them."""
    sync(device)
    begin = clock()
    for _ in range(steps):
        step()
    sync(device)
    return (clock() - begin) / steps
