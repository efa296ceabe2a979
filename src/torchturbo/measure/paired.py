"""Paired rounds: a candidate timed against a reference, round by round, until decided.

Each round times one block of steps of each side, the side that goes first alternating from round
to round (A B, B A, ...) so that drift of the machine hits both alike. When the two sides train
the same batches in step, a round's ratio cancels how costly its batches were; when they train
different batches (length buckets against padded ones), the ratio is of throughputs, counting the
samples or tokens each block processed. After every round ``stop(rounds)`` is asked whether the
comparison is decided (the tuner's sequential rule, ``tune.decide.estimate``) or out of time, so
a large effect costs three rounds and a slow model is not measured longer than it can afford.

``measure_interleaved`` times a fixed number of repeats of any number of variants; this is its
two-variant, sequential form.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
    clock: Callable[[], float] = time.perf_counter,
) -> list[Round]:
    """Time rounds until ``stop(rounds)`` says so or ``max_rounds`` are done; return them all."""
    if steps_per_round < 1 or max_rounds < 1:
        raise ValueError(
            f"paired_rounds(steps_per_round={steps_per_round}, max_rounds={max_rounds}) needs "
            "both >= 1"
        )
    device = torch.device(device)
    rounds: list[Round] = []
    while len(rounds) < max_rounds:
        reference_first = len(rounds) % 2 == 0
        first, second = (reference, candidate) if reference_first else (candidate, reference)
        first_s = time_block(first.step, steps_per_round, device, clock)
        second_s = time_block(second.step, steps_per_round, device, clock)
        rounds.append(
            Round(
                reference_s=first_s if reference_first else second_s,
                candidate_s=second_s if reference_first else first_s,
                reference_count=reference.recent_count(steps_per_round) / steps_per_round,
                candidate_count=candidate.recent_count(steps_per_round) / steps_per_round,
            )
        )
        if stop(rounds):
            break
    return rounds


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
