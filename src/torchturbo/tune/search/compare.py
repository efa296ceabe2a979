"""One paired comparison of two live trials, decided sequentially: what the tuner's candidates,
its confirmation and the doctor's quick gains all measure with, so that a figure means the same
wherever it is printed.

The reference is aligned to the candidate's next batch (when both cycle through the same batches)
rather than the other way round: the candidate then trains its batches in order from the first,
so its first steps are the ones its loss parity is judged on. Under torchrun every rank times its
own blocks; whether to stop is rank 0's call (``agree``), so the ranks' collectives stay paired.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchturbo.distributed.consensus import agree
from torchturbo.measure.paired import Round, Side, interleaved_round, paired_rounds
from torchturbo.recipe import Recipe
from torchturbo.techniques.framework.decide import MIN_ROUNDS, RatioEstimate, estimate
from torchturbo.trials.trial import Trial
from torchturbo.tune.search.outcome import Comparison

#: A timed block should last at least this long, so that timer and scheduler jitter (~1 ms)
#: stay small next to it; fast steps are therefore timed several to a block.
MIN_BLOCK_S = 0.05
MAX_STEPS_PER_ROUND = 8
#: A candidate this many times slower in its first two paired rounds is not measured further
#: (fp16 on a CPU without fp16 units ran ~50x slower); paired, so a busy spell cannot fake it.
HOPELESS_SLOWDOWN = 5.0
#: Rounds of a comparison without a cap (``max_rounds=None``): the budget and the decision rule
#: end it long before.
UNCAPPED = 1_000_000


def steps_per_round(step_s: float, cycle: int = 1) -> int:
    """Steps per timed block for a step of ``step_s`` seconds (see ``MIN_BLOCK_S``), rounded
    up to whole ``cycle``s of the trials' batches (see :func:`batch_cycle`)."""
    steps = MAX_STEPS_PER_ROUND
    if step_s > 0:
        steps = max(1, min(MAX_STEPS_PER_ROUND, math.ceil(MIN_BLOCK_S / step_s)))
    return cycle * math.ceil(steps / cycle)


def batch_cycle(recipe: Recipe, *batch_lists: Sequence[Any]) -> int:
    """Steps after which trials holding ``batch_lists`` have each taken every one of their
    batches once, when they train different variable-length batches; 1 otherwise.

    Variable-length batches differ in cost and in count (padded lengths, or length buckets
    holding many short samples or few long ones): a round of one batch per side would compare
    whichever two batches came up, and the ratio would swing from round to round far beyond
    the real difference. Rounds of whole cycles compare the same work every round. Trials on
    the same batches step the same batch on both sides in every round (``Trial.align_with``), so
    a round's ratio already cancels its batch's cost: one step per side is a round, which at
    seconds per step is what keeps a decision to about a minute.
    """
    if recipe.lengths is None or all(b is batch_lists[0] for b in batch_lists):
        return 1
    return math.lcm(*(len(b) for b in batch_lists))


@dataclass(frozen=True)
class Measured:
    """A comparison and whether it ended before being decided (time ran out)."""

    comparison: Comparison
    cut_short: bool
    #: The same rounds read the other way: the reference against the candidate (named
    #: ``reversed_against``), for a head-to-head whose loser may be either side.
    reversed: Comparison | None = None
    #: The rounds it was read from (``earlier`` ones included): a later measurement of the same
    #: pair may go on from them.
    rounds: tuple[Round, ...] = ()


def compare(
    reference: Trial,
    candidate: Trial,
    *,
    against: str,
    device: torch.device,
    max_rounds: int | None,
    may_continue: Callable[[float], bool],
    min_rounds: int = 1,
    settle_rounds: int = 1,
    cycle: int | None = None,
    decided: Callable[[Sequence[float]], bool] | None = None,
    reversed_against: str | None = None,
    clock: Callable[[], float] = time.perf_counter,
    earlier: Sequence[Round] = (),
) -> Measured:
    """Time ``candidate`` against ``reference`` until the ratio is decided, ``max_rounds`` are
    done (None: no cap), or ``may_continue(seconds of the next round)`` says no (asked only
    once ``min_rounds`` are done). A decided ratio is measured on up to ``settle_rounds``
    while ``may_continue`` allows, to narrow the interval a report quotes (the decision only
    needs it to clear 1).
    ``decided(per-round ratios)`` replaces "the estimate's decision is not undecided" (see
    ``decide.head_to_head_decided``). Rounds are whole ``cycle``s of steps (default:
    :func:`batch_cycle` of the two trials), timed in alternating blocks of about
    ``MIN_BLOCK_S`` each (``measure.paired``). Sets both trials' ``step_seconds`` to their
    median of this measurement. With ``reversed_against`` (the candidate's name), the result
    also reads the same rounds as the reference against the candidate. ``earlier``: rounds of
    an earlier measurement of the same pair on the same batches, which this one goes on from
    (they count towards every rule and figure)."""
    step_s = min(s for s in (reference.step_seconds, candidate.step_seconds, math.inf) if s)
    if cycle is None:
        cycle = batch_cycle(reference.recipe, reference.batches, candidate.batches)
    # Step times are this rank's: under torchrun every rank must run rank 0's count of steps,
    # or their DDP collectives stop pairing up (a busy machine made the ranks' counts differ).
    per_round, per_block = agree((steps_per_round(step_s, cycle), steps_per_round(step_s)))
    reference.align_with(candidate)
    cap = UNCAPPED if max_rounds is None else max_rounds
    cut_short = False

    def stop(new: list[Round]) -> bool:
        nonlocal cut_short
        rounds = [*earlier, *new]
        ratios = [r.ratio for r in rounds]
        hopeless = _hopeless(ratios)
        done = hopeless or (decided or _undecided_no_more)(ratios)
        # The slowest of the last rounds, with a margin: a busy machine's rounds vary, and a
        # round that overruns cannot be stopped half-way.
        next_s = 1.5 * per_round * max(r.reference_s + r.candidate_s for r in rounds[-3:])
        out_of_time = not done and min_rounds <= len(rounds) < cap and not may_continue(next_s)
        if done and not hopeless and len(rounds) < settle_rounds:
            done = not may_continue(next_s)
        done, out_of_time = agree((done, out_of_time))
        cut_short = out_of_time
        return done or out_of_time

    rounds = paired_rounds(
        _side(reference),
        _side(candidate),
        device=device,
        steps_per_round=per_round,
        max_rounds=cap,
        stop=stop,
        steps_per_block=per_block,
        clock=clock,
    )
    rounds = [*earlier, *agree(rounds)]
    # Geometric means of the same rounds the ratio is the geometric mean of: the throughputs
    # shown divide to the ratio shown, exactly (medians of each side need not).
    reference.step_seconds = geometric_mean(r.reference_s for r in rounds)
    candidate.step_seconds = geometric_mean(r.candidate_s for r in rounds)
    comparison = _rounds_comparison(rounds, against, per_round)
    flipped = None
    if reversed_against is not None:
        flipped = _rounds_comparison([_flip(r) for r in rounds], reversed_against, per_round)
    return Measured(comparison, cut_short, flipped, tuple(rounds))


def _hopeless(ratios: Sequence[float]) -> bool:
    """Two rounds both ``HOPELESS_SLOWDOWN`` times slower decide it: a third would only cost
    their time."""
    return len(ratios) >= 2 and max(ratios) < 1 / HOPELESS_SLOWDOWN


def _undecided_no_more(ratios: Sequence[float]) -> bool:
    return estimate(ratios).decision != "undecided"


def _flip(round_: Round) -> Round:
    return Round(
        reference_s=round_.candidate_s,
        candidate_s=round_.reference_s,
        reference_count=round_.candidate_count,
        candidate_count=round_.reference_count,
    )


def _rounds_comparison(rounds: Sequence[Round], against: str, per_round: int) -> Comparison:
    ratios = [r.ratio for r in rounds]
    return Comparison(
        against=against,
        # Undecided stays undecided (the verdict says so); only a hopeless one is "not faster".
        speed=estimate(ratios, final=_hopeless(ratios)),
        steps_per_round=per_round,
        step_ms=geometric_mean(r.candidate_s for r in rounds) * 1e3,
        reference_step_ms=geometric_mean(r.reference_s for r in rounds) * 1e3,
        throughput=geometric_mean(r.candidate_count / r.candidate_s for r in rounds),
        reference_throughput=geometric_mean(r.reference_count / r.reference_s for r in rounds),
        step_samples_ms=tuple(r.candidate_s * 1e3 for r in rounds),
        ratios=tuple(r.ratio for r in rounds),
    )


def geometric_mean(values: Iterable[float]) -> float:
    return statistics.geometric_mean(list(values))


@dataclass(frozen=True)
class Chained:
    """Several configs timed in the same rounds: each one's figures, and each one's ratio to
    the config before it (``rows[0]`` is the first config, with no ratio)."""

    rows: tuple[Comparison | None, ...]
    #: The last config against the first, from the same rounds.
    overall: Measured
    #: Each config's throughput in each round.
    throughputs: tuple[tuple[float, ...], ...]


def compare_chain(
    trials: Sequence[Trial],
    names: Sequence[str],
    *,
    device: torch.device,
    max_rounds: int | None,
    may_continue: Callable[[float], bool],
    min_rounds: int = MIN_ROUNDS,
    settle_rounds: int = 1,
    decided: Callable[[RatioEstimate], bool] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Chained:
    """Time every trial in the same rounds (the order reversing from round to round, and a long
    round cut into blocks that take turns, so drift hits all alike) until the last against the
    first is decided, like :func:`compare`.

    One measurement gives every figure: a config's throughput over the previous one's is its
    ratio, so an incremental table built from it reproduces its ratios by division, and the
    last row over the first is the overall ratio. ``decided(estimate)`` (default: the
    estimate's decision is not "undecided") says when the last against the first needs no more
    rounds."""
    step_s = min(s for s in (*(t.step_seconds for t in trials), math.inf) if s)
    cycle = batch_cycle(trials[0].recipe, *(t.batches for t in trials))
    per_round, per_block = agree((steps_per_round(step_s, cycle), steps_per_round(step_s)))
    for trial in trials[:-1]:
        trial.align_with(trials[-1])
    seconds: list[list[float]] = [[] for _ in trials]
    counts: list[list[float]] = [[] for _ in trials]
    cut_short = False
    while True:
        order = list(range(len(trials)))
        if len(seconds[0]) % 2:
            order.reverse()
        round_s = interleaved_round(
            [trials[i].step for i in order], per_round, per_block, device, clock
        )
        for i, per_step in zip(order, round_s, strict=True):
            seconds[i].append(per_step)
            counts[i].append(trials[i].recent_count(per_round) / per_round)
        rounds = len(seconds[0])
        ratios = [_ratio(counts, seconds, -1, 0, r) for r in range(rounds)]
        done = rounds >= min_rounds and (decided or _decision_made)(estimate(ratios))
        next_s = 1.5 * per_round * sum(max(s[-3:]) for s in seconds)
        out_of_time = not done and min_rounds <= rounds and not may_continue(next_s)
        if done and rounds < settle_rounds:
            done = not may_continue(next_s)
        done, out_of_time = agree((done, out_of_time))
        if done or out_of_time or (max_rounds is not None and rounds >= max_rounds):
            cut_short = out_of_time
            break
    seconds, counts = agree((seconds, counts))
    throughputs = tuple(
        tuple(c / s for c, s in zip(count, secs, strict=True))
        for count, secs in zip(counts, seconds, strict=True)
    )
    rows: list[Comparison | None] = [None]
    for i in range(1, len(trials)):
        rows.append(_chain_row(names[i - 1], i - 1, i, seconds, throughputs, per_round))
    overall = _chain_row(names[0], 0, len(trials) - 1, seconds, throughputs, per_round)
    for trial, secs in zip(trials, seconds, strict=True):
        trial.step_seconds = geometric_mean(secs)
    return Chained(tuple(rows), Measured(overall, cut_short), throughputs)


def _decision_made(speed: RatioEstimate) -> bool:
    return speed.decision != "undecided"


def _ratio(counts: list[list[float]], seconds: list[list[float]], i: int, j: int, r: int) -> float:
    return (counts[i][r] / seconds[i][r]) / (counts[j][r] / seconds[j][r])


def _chain_row(
    against: str,
    reference: int,
    candidate: int,
    seconds: list[list[float]],
    throughputs: tuple[tuple[float, ...], ...],
    per_round: int,
) -> Comparison:
    ratios = [c / r for c, r in zip(throughputs[candidate], throughputs[reference], strict=True)]
    return Comparison(
        against=against,
        speed=estimate(ratios, final=True),
        steps_per_round=per_round,
        step_ms=geometric_mean(seconds[candidate]) * 1e3,
        reference_step_ms=geometric_mean(seconds[reference]) * 1e3,
        throughput=geometric_mean(throughputs[candidate]),
        reference_throughput=geometric_mean(throughputs[reference]),
        step_samples_ms=tuple(s * 1e3 for s in seconds[candidate]),
        ratios=tuple(ratios),
    )


def _side(trial: Trial) -> Side:
    return Side(step=trial.step, recent_count=trial.recent_count)
