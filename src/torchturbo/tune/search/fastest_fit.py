"""The fastest of alternatives, found by racing them head to head: the plans that fit a memory
budget (``fastest_fit``), and the alternatives of one lever (bf16 or fp16, length buckets or
packing, the fused or the foreach optimizer step, whole-model or regional compile:
``fastest_alternative``).

The first alternative of a lever is measured against the best, for its loss, its footprint and
its speed. Each later one is measured against the leader of its lever, once there is one: in
paired rounds of their own, both sides fast, until one is faster beyond the noise or each is
within ``WORTH_MEASURING`` of the other (``decide.head_to_head_decided``), and it takes the
leader's place when its job is the shorter at the measured ratio, one-time costs included
(``decide.judge_against_leader``). Measuring it first against the slower best cost a 45M
decoder's tune the alternative it would have kept (its rounds against fp32 steps of 2 s ran
out of budget, docs/tuner.md); comparing two ratios against the best, taken minutes apart,
ordered alternatives a few percent apart by noise.

Plans that fit a memory budget are all measured against the best (fitting is their gain, not
speed), and those that fit are raced: each against the fastest so far, in paired rounds, until
one is faster beyond the noise or each is within ``WORTH_MEASURING`` of the other
(``decide.head_to_head_decided``). Two whose intervals against the best do not overlap are not
raced: the order is already known (``decide.order_known``; a quiet 2-core run had adopted a plan
0.72x as fast as the fastest that fit, docs/memory_planning.md, before they were raced). A beaten
candidate's row shows the measurement that beat it. Every verdict is ``decide``'s; this module
measures and records.
"""

from __future__ import annotations

import dataclasses
import math

from torchturbo.techniques.framework.decide import (
    describe,
    head_to_head_decided,
    job_times,
    judge_race,
    order_known,
)
from torchturbo.techniques.framework.proposal import Candidate
from torchturbo.tune.search.candidate import reserve, try_candidate
from torchturbo.tune.search.compare import compare
from torchturbo.tune.search.outcome import Comparison, Outcome
from torchturbo.tune.search.state import Incumbent, Run

Entry = tuple[Outcome, Incumbent]


def fastest_fit(
    run: Run, proposals: list[tuple[str, Candidate]], best: Incumbent, tried: set[str]
) -> Incumbent:
    """Over the memory budget: measure every proposal against ``best``, race those that fit,
    adopt the winner (or keep ``best`` when none fits)."""
    return _fastest(run, proposals, best, tried, fit_memory=True)


def fastest_alternative(
    run: Run, proposals: list[tuple[str, Candidate]], best: Incumbent, tried: set[str]
) -> Incumbent:
    """The alternatives of one lever: measure each against ``best``, race those that would be
    adopted, adopt the winner (or keep ``best`` when none would)."""
    return _fastest(run, proposals, best, tried, fit_memory=False)


def _fastest(
    run: Run,
    proposals: list[tuple[str, Candidate]],
    best: Incumbent,
    tried: set[str],
    *,
    fit_memory: bool,
) -> Incumbent:
    """Every row goes to ``run.outcomes``; at most three trials (the best, the leader, the
    challenger) are alive at once."""
    leader: Entry | None = None
    for stage, candidate in proposals:
        tried.add(candidate.name)
        if leader is not None and not fit_memory:
            leader = _challenge(run, stage, candidate, leader)
            continue
        outcome, incumbent = try_candidate(run, stage, candidate, best, fit_memory)
        if incumbent is None:
            run.outcomes.append(outcome)
            continue
        if leader is None:
            leader = (outcome, incumbent)
            continue
        leader, beaten = _race(run, leader, (outcome, incumbent), best.name, fit_memory)
        beaten[1].trial.close()
        run.outcomes.append(beaten[0])
    if leader is None:
        return best
    run.outcomes.append(leader[0])
    run.adoptions.append(leader[1])
    return leader[1]


def _challenge(run: Run, stage: str, candidate: Candidate, leader: Entry) -> Entry:
    """``candidate`` raced against the lever's ``leader`` (module docstring): the new leader
    when its job is the shorter, the beaten leader's row rejected with the figure that beat it;
    else the leader still, the candidate's row its own measurement against the leader."""
    outcome, incumbent = try_candidate(run, stage, candidate, leader[1], False, leader=True)
    if incumbent is None:
        run.outcomes.append(outcome)
        return leader
    beaten = leader[0]
    assert outcome.comparison is not None and beaten.comparison is not None  # both measured
    ahead = beaten.over_best or beaten.comparison.speed.ratio
    run.outcomes.append(
        dataclasses.replace(
            beaten,
            verdict="rejected",
            reason=(
                f"faster than the best, but {outcome.name} makes the job shorter: it measured "
                f"{describe(outcome.comparison.speed)} against this head to head; {beaten.reason}"
            ),
        )
    )
    leader[1].trial.close()
    # Its ratio is against the leader: over the best, the two measurements multiply.
    outcome = dataclasses.replace(outcome, over_best=ahead * outcome.comparison.speed.ratio)
    incumbent.outcome = outcome
    return outcome, incumbent


def _race(
    run: Run, leader: Entry, challenger: Entry, best: str, fit_memory: bool
) -> tuple[Entry, Entry]:
    """(winner, beaten): the beaten one's outcome rejected, with the figures that decided it."""
    qualifies = "fits, but " if fit_memory else "faster than the best, but "
    lead, rival = leader[0].comparison, challenger[0].comparison
    assert lead is not None and rival is not None  # both were measured against the best
    # Both were timed against the same best: their jobs compare too (one-time costs included).
    ahead = order_known(lead.speed, leader[0].job_s or 0.0, rival.speed, challenger[0].job_s or 0.0)
    if ahead is not None:
        winner, beaten = (challenger, leader) if ahead else (leader, challenger)
        faster, slower = (rival, lead) if ahead else (lead, rival)
        reason = (
            f"{qualifies}{winner[0].name} is faster: {describe(faster.speed)} against "
            f"{describe(slower.speed)}, both against {best}, intervals apart"
        )
        return winner, (_rejected(run, beaten[0], reason), beaten[1])
    step_s = min(leader[1].trial.step_seconds or 0.0, challenger[1].trial.step_seconds or 0.0)
    held_back = reserve(run, step_s)
    stage = challenger[0].stage
    run.say(stage, f"race: {challenger[0].name} against {leader[0].name}", run.budget.left())
    measured = compare(
        leader[1].trial,
        challenger[1].trial,
        against=leader[0].name,
        reversed_against=challenger[0].name,
        device=run.device,
        max_rounds=run.options.max_rounds,
        may_continue=lambda seconds: run.budget.left() - held_back >= seconds,
        decided=head_to_head_decided,
        clock=run.clock,
    )
    assert measured.reversed is not None
    # compare's rounds are agreed, and so are both sides' one-time costs: every rank judges
    # the race alike.
    job = job_times(
        steps=run.horizon.steps,
        best_step_s=measured.comparison.reference_step_ms / 1e3,
        ratio=measured.comparison.speed.ratio,
        best_one_time_s=leader[0].one_time_s or 0.0,
        one_time_s=challenger[0].one_time_s or 0.0,
    )
    forward, backward = measured.comparison, measured.reversed
    challenger_wins, verdict = judge_race(
        job, forward.speed, forward.ratios, backward.speed, backward.ratios
    )
    if challenger_wins:
        winner, beaten, race = challenger, leader, backward
    else:
        winner, beaten, race = leader, challenger, forward
    reason = (
        f"{qualifies}{winner[0].name} {verdict}: this measured {describe(race.speed)} against "
        "it head to head"
    )
    if measured.cut_short:
        reason += ", the budget stopped the race"
    return winner, (_rejected(run, beaten[0], reason, race, winner[0]), beaten[1])


def _rejected(
    run: Run,
    outcome: Outcome,
    reason: str,
    race: Comparison | None = None,
    winner: Outcome | None = None,
) -> Outcome:
    """``outcome`` rejected for ``reason``; after a race, its figures are the race's (its speed
    and its job against the winner's), so that the row's columns agree with its reason."""
    rejected = dataclasses.replace(
        outcome, verdict="rejected", reason=f"{reason}; {outcome.reason}"
    )
    if race is None or winner is None:
        return rejected
    job = job_times(
        steps=run.horizon.steps,
        best_step_s=race.reference_step_ms / 1e3,
        ratio=race.speed.ratio,
        best_one_time_s=winner.one_time_s or 0.0,
        one_time_s=outcome.one_time_s or 0.0,
    )
    return dataclasses.replace(
        rejected,
        comparison=race,
        job_s=job.candidate_s,
        reference_job_s=job.best_s,
        break_even_steps=None if job.break_even == math.inf else job.break_even,
    )
