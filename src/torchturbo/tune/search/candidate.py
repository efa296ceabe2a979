"""Measuring one candidate against the current best: its cost, then its outcome.

The cost is estimated from the step times measured so far (``budget``); a candidate that does not
fit in what is left once the confirmation and the report are held back is not measured and says
what it needed. Otherwise it is built from the recipe's initial weights, stepped a few times (its
first step carries its one-time costs; a compile also steps once through every batch shape, since
each new shape recompiles), warmed up, and timed against the best in paired rounds until the
ratio is decided (``compare``). ``decide.judge`` gives the verdict.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchturbo.base.compiler import compiled_graphs
from torchturbo.config import TurboConfig
from torchturbo.distributed.consensus import agree, any_rank
from torchturbo.measure.paired import Round
from torchturbo.measure.timing import time_once
from torchturbo.techniques import registry
from torchturbo.techniques.framework.decide import (
    MIN_ROUNDS,
    head_to_head_decided,
    job_times,
    judge,
    judge_against_leader,
    loss_parity,
    rounds_to_decide,
)
from torchturbo.techniques.framework.facts import shape_key
from torchturbo.techniques.framework.proposal import Candidate
from torchturbo.trials.trial import Trial, start_trial
from torchturbo.tune.search import batching
from torchturbo.tune.search.budget import (
    candidate_seconds,
    compile_seconds,
    confirm_seconds,
    machine_load,
)
from torchturbo.tune.search.compare import Measured, compare, steps_per_round
from torchturbo.tune.search.outcome import Comparison, Outcome, State
from torchturbo.tune.search.state import (
    PARITY_STEPS,
    REPORT_S,
    WARM_STEPS,
    Incumbent,
    Run,
)

#: The most a compile is assumed to speed a step up when deciding whether it is worth measuring
#: at all: on the built-in workloads and Hugging Face models it measured 0.9-1.3x on a CPU.
OPTIMISTIC_COMPILE_GAIN = 1.5
#: A compile from inductor's warm cache against a cold one, rounded up from the 0.08-0.13x
#: measured (docs/techniques/compile.md): what re-timing a compiled candidate's first steps costs.
WARM_CACHE_SHARE = 0.25


@dataclass(frozen=True)
class Estimate:
    """Seconds a candidate is expected to take: at the fewest rounds, at a typical count, and
    the compile within them (0 when it does not compile)."""

    min_s: float
    typical_s: float
    compile_s: float


def estimate(run: Run, candidate: Candidate, best: Incumbent) -> Estimate:
    best_step = best.trial.step_seconds or run.baseline_step_s
    step = _expected_step(run, candidate, best)
    # Another mode, scope (whole model or blocks) or activation budget (another partition of
    # the graph) compiles anew; a candidate that keeps the best's compile finds its graphs in
    # inductor's cache.
    mine, theirs = candidate.config.compile, best.config.compile
    compiles = mine.mode != theirs.mode or (
        mine.mode != "off"
        and (
            mine.scope != theirs.scope
            or mine.activation_memory_budget != theirs.activation_memory_budget
        )
    )
    regional = mine.scope == "blocks"
    compile_s = compile_seconds(run.facts, regional=regional) if compiles else 0.0
    per_round = steps_per_round(min(step, best_step), run_cycle(run, candidate.config, best.config))
    fixed = run.build_s + compile_s + (1 + WARM_STEPS) * step + step  # + the memory probe
    fixed += candidate.one_time_s * machine_load()  # what else its first step compiles
    if _reference_needed(run, candidate):  # the baseline trained on its batches, for parity
        fixed += run.build_s + PARITY_STEPS * run.baseline_step_s
    if compiles:
        batches = run.batches.count
        fixed += (batches - 1) * step  # one pass over every batch shape: recompiles
        if run.options.compile_cache_dir:
            # The warm-cache first steps timed again (_warm_cache_one_time): measured at
            # 0.08-0.13x of a cold compile on a 2-core CPU (benchmarks/compile_cache.py).
            fixed += WARM_CACHE_SHARE * compile_s + batches * step
    return Estimate(
        min_s=candidate_seconds(fixed, per_round, MIN_ROUNDS, best_step, step),
        typical_s=candidate_seconds(fixed, per_round, MIN_ROUNDS + 2, best_step, step),
        compile_s=compile_s,
    )


def _cannot_pay_back(run: Run, cost: Estimate, best: Incumbent) -> str:
    """Why a compile cannot pay back on this job even at ``OPTIMISTIC_COMPILE_GAIN`` (so it is
    not worth the budget to measure); "" when it might. The one-time cost is the one the job
    pays: a warm-cache compile when tuning leaves its cache beside turbo.toml."""
    if not cost.compile_s:
        return ""
    one_time = cost.compile_s * (WARM_CACHE_SHARE if run.options.compile_cache_dir else 1.0)
    step = best.trial.step_seconds or run.baseline_step_s
    saving = run.horizon.steps * step * (1 - 1 / OPTIMISTIC_COMPILE_GAIN)
    if saving >= one_time:
        return ""
    return (
        f"cannot pay back on this job: even {OPTIMISTIC_COMPILE_GAIN:g}x faster steps would save "
        f"~{saving:.0f} s of the {run.horizon.steps:,}-step job, and compiling costs "
        f"~{one_time:.0f} s"
    )


def reserve(run: Run, best_step_s: float, *, confirming: bool = True) -> float:
    """Seconds held back for the confirmation (were the best to change) and the report: its
    rounds are whole cycles of batches when the best may train other batches than fp32 eager.
    ``confirming=False``: for the report alone (the confirmation's time given to the search)."""
    if not confirming:
        return REPORT_S
    cycle = 1 if run.recipe.lengths is None else run.batches.count
    return REPORT_S + confirm_seconds(
        run.baseline_step_s, best_step_s, lambda step_s: steps_per_round(step_s, cycle)
    )


def run_cycle(run: Run, config: TurboConfig, other: TurboConfig) -> int:
    """The batch cycle of a comparison of ``config`` with ``other``: one step when they plan the
    same batches, else a pass over each trial's ``run.batches.count`` batches
    (``compare.batch_cycle``)."""
    if run.recipe.lengths is None or registry.batch_key(config) == registry.batch_key(other):
        return 1
    return run.batches.count


def _expected_step(run: Run, candidate: Candidate, best: Incumbent) -> float:
    best_step = best.trial.step_seconds or run.baseline_step_s
    return best_step / max(candidate.expected_gain or 1.0, 1.0)


def not_measured(
    stage: str,
    candidate: Candidate,
    reason: str,
    *,
    verdict: State = "not applicable",
    estimate_s: float | None = None,
) -> Outcome:
    return Outcome(
        stage=stage,
        name=candidate.name,
        config=candidate.config.to_dict(),
        verdict=verdict,
        reason=reason,
        expected_gain=candidate.expected_gain,
        estimate_s=estimate_s,
    )


@dataclass(frozen=True)
class Figures:
    """What measuring a candidate found, agreed once (rank 0's) before it is judged."""

    measured: Measured
    curve: list[float]
    step_s: float
    shapes: int
    memory_bytes: int | None
    memory_kind: str
    one_time_s: float
    cold_one_time_s: float | None
    graphs: int | None
    spent_s: float = 0.0
    count_per_step: float | None = None
    comm_bytes_per_step: int | None = None
    #: The fp32 baseline's first ``PARITY_STEPS`` losses on the candidate's batches
    #: (:func:`reference_curve`): what its own curve is held to.
    reference: tuple[float, ...] = ()


def try_candidate(
    run: Run,
    stage: str,
    candidate: Candidate,
    best: Incumbent,
    fit_memory: bool,
    *,
    leader: bool = False,
    confirming: bool = True,
    earlier: Sequence[Round] = (),
) -> tuple[Outcome, Incumbent | None]:
    """Measure ``candidate`` on top of ``best``; the outcome, and the new best if adopted.

    ``fit_memory``: the best does not fit the memory budget, so fitting is this candidate's gain
    and it need not be faster. ``leader``: ``best`` is another alternative of the candidate's
    lever, which it races (``decide.judge_against_leader``). ``confirming=False``: the time
    held back for the confirmation is the measurement's too (``reserve``). ``earlier``: rounds
    of an earlier measurement of this candidate against ``best``, which this one goes on from.

    Under torchrun the ranks agree at the edges: on the cost and whether to measure, then on the
    figures measured (rank 0's), which are judged alike on every rank. Inside, only what keeps
    their collectives paired is agreed (the steps each takes, ``compare``'s rounds)."""
    cost = agree(estimate(run, candidate, best))  # a local clock and load: rank 0's figures
    skipped = agree(_not_worth_measuring(run, candidate, best, cost, fit_memory, confirming))
    if skipped:
        return not_measured(
            stage, candidate, skipped, verdict="not measured", estimate_s=cost.min_s
        ), None
    label = candidate.name + (f": compiling, ~{cost.compile_s:.0f} s" if cost.compile_s else "")
    run.say(stage, label, run.budget.left())
    began = run.clock()
    trial, figures, error = _measure(run, candidate, best, cost, leader, confirming, earlier)
    if any_rank(error is not None, run.device):
        if trial is not None:
            trial.close()
        message = f"{type(error).__name__}: {error}" if error else "it failed on another rank"
        reason = agree(f"error: {message}"[:500])
        return not_measured(
            stage, candidate, reason, verdict="rejected", estimate_s=cost.min_s
        ), None
    assert trial is not None and figures is not None
    figures = agree(
        dataclasses.replace(
            figures,
            spent_s=run.clock() - began,
            count_per_step=trial.mean_count(),  # a collective: every rank reaches it
            comm_bytes_per_step=(trial.comm_per_step() or (None,))[0],
        )
    )
    trial.step_seconds = figures.step_s
    outcome = _judged(run, stage, candidate, figures, best, fit_memory, leader)
    outcome = dataclasses.replace(outcome, estimate_s=cost.min_s)
    if outcome.verdict != "adopted":
        trial.close()
        return outcome, None
    return outcome, Incumbent(
        candidate.name,
        candidate.config,
        trial,
        figures.memory_bytes,
        candidate,
        outcome,
        figures.one_time_s,
    )


def _not_worth_measuring(
    run: Run,
    candidate: Candidate,
    best: Incumbent,
    cost: Estimate,
    fit_memory: bool,
    confirming: bool,
) -> str:
    """Why ``candidate`` is not measured (its compile cannot pay back, or the budget cannot hold
    it); "" when it is. Fitting a memory budget is a gain of its own: only speed candidates must
    pay back."""
    hopeless = "" if fit_memory else _cannot_pay_back(run, cost, best)
    if hopeless:
        return hopeless
    held_back = reserve(run, _expected_step(run, candidate, best), confirming=confirming)
    free = run.budget.left() - held_back
    if free < cost.min_s:
        return f"budget: needs ~{cost.min_s:.0f} s, {max(free, 0.0):.0f} s left"
    return ""


def _measure(
    run: Run,
    candidate: Candidate,
    best: Incumbent,
    cost: Estimate,
    leader: bool,
    confirming: bool,
    earlier: Sequence[Round],
) -> tuple[Trial | None, Figures | None, Exception | None]:
    """The candidate's trial built, warmed up and timed against ``best``, with its loss curve,
    footprint and one-time cost: this rank's figures, or the error it failed with (a technique
    that fails on this model is a finding, not a crash)."""
    trial = None
    try:
        batches = candidate.batches or run.batches(candidate.config)
        graphs_before = compiled_graphs()
        trial, first = start_trial(
            candidate.recipe or run.recipe, candidate.config, batches, run.clock
        )
        warm = 0.0
        # Each rank holds its own batches: every rank steps as often as rank 0 (DDP collectives).
        shapes = agree(len({shape_key(b) for b in batches}))
        if cost.compile_s:  # every batch shape once: recompiling is a one-time cost too
            for _ in range(shapes - 1):
                warm += time_once(trial.step, run.device, run.clock)
        trial.step_seconds = min(
            time_once(trial.step, run.device, run.clock) for _ in range(WARM_STEPS)
        )
        held_back = reserve(run, trial.step_seconds, confirming=confirming)
        measured = compare(
            best.trial,
            trial,
            against=best.name,
            device=run.device,
            max_rounds=run.options.max_rounds,
            may_continue=lambda seconds: run.budget.left() - held_back >= seconds,
            decided=head_to_head_decided if leader else None,
            clock=run.clock,
            earlier=earlier,
        )
        while len(trial.losses) < PARITY_STEPS * candidate.config.accumulation.steps:
            trial.step()
        memory_bytes, memory_kind = trial.memory_footprint()
        warm_steps = 1 + (shapes - 1 if cost.compile_s else 0)
        one_time = max(0.0, first + warm - warm_steps * trial.step_seconds)
        cold_one_time = None
        if cost.compile_s and run.options.compile_cache_dir:
            cold_one_time = one_time
            one_time = _warm_cache_one_time(run, trial, shapes, best)
        curve = batching.window_losses(trial.loss_curve(), candidate.config.accumulation.steps)
        reference = reference_curve(run, candidate, batches)
        figures = Figures(
            measured=measured,
            curve=curve,
            step_s=trial.step_seconds,
            shapes=shapes,
            memory_bytes=memory_bytes,
            memory_kind=memory_kind,
            one_time_s=one_time,
            cold_one_time_s=cold_one_time,
            graphs=_graphs_since(graphs_before) if cost.compile_s else None,
            reference=tuple(reference),
        )
    except Exception as err:
        return trial, None, err
    return trial, figures, None


def reference_curve(run: Run, candidate: Candidate, batches: list[Any]) -> list[float]:
    """The fp32 baseline's first ``PARITY_STEPS`` losses on ``batches``, which ``candidate``
    trains on: its loss parity is judged like for like. A batch plan puts other samples in each
    step than the baseline's batches hold, and a short curve moves with its samples alone (a
    BERT tagger's length buckets averaged 6.2% under the baseline's six steps, and a sound plan
    was rejected). So the baseline config trains from the initial weights once on every other
    batch list a candidate brings (the plan's, kept for every candidate built on it after)."""
    key = _batches_key(run, candidate)
    if key not in run.reference_curves:
        reference = Trial(run.recipe, run.reference_config, batches, run.clock)
        try:
            steps = run.reference_config.accumulation.steps
            while len(reference.losses) < PARITY_STEPS * steps:
                reference.step()
            curve = batching.window_losses(reference.loss_curve(), steps)[:PARITY_STEPS]
        finally:
            reference.close()
        run.reference_curves[key] = (batches, curve)
    return run.reference_curves[key][1]


def _batches_key(run: Run, candidate: Candidate) -> Hashable:
    """What names ``candidate``'s samples among the reference curves: the list it brings
    (``Candidate.batches``; kept beside its curve, so its id stays its), its config's batch plan,
    or the baseline's rows. Rows padded to another multiple hold the baseline's samples, so the
    baseline's own curve is their reference: a model that does not mask padding shows there."""
    if candidate.batches is not None:
        return ("given", id(candidate.batches))
    if registry.plans_batches(candidate.config):
        return registry.batch_key(candidate.config)
    return registry.batch_key(run.reference_config)


def _reference_needed(run: Run, candidate: Candidate) -> bool:
    """Whether measuring ``candidate`` first trains the baseline on its batches."""
    return _batches_key(run, candidate) not in run.reference_curves


def _what_it_needs(comparison: Comparison, cut_short: bool) -> str:
    """Why an undecided comparison stopped, and the rounds and seconds it would need."""
    speed = comparison.speed
    # Without a round cap (the default) only the budget stops a comparison undecided.
    stopped = "the budget stopped it" if cut_short else "the rounds ran out"
    needed = rounds_to_decide(speed, comparison.ratios)
    if needed is None:
        return f"; {stopped} on a threshold of the rule"
    per_round_s = comparison.steps_per_round * (comparison.step_ms + comparison.reference_step_ms)
    more_s = (needed - speed.rounds) * per_round_s / 1e3
    return f"; {stopped}: about {needed} rounds would decide it (~{more_s:.0f} s more)"


def _warm_cache_one_time(run: Run, trial: Trial, shapes: int, best: Incumbent) -> float:
    """The one-time cost of ``trial``'s compile once its cache is there, as in a job that loads
    the cache tuning filled: dynamo's in-memory graphs are dropped (``torch.compiler.reset``),
    and the first steps over every batch shape compile again, now from inductor's cache.

    The reset drops every live trial's graphs: the other compiled ones step once, untimed, to
    load theirs back before they are timed again."""
    step_s = trial.step_seconds or 0.0
    torch.compiler.reset()
    first = sum(time_once(trial.step, run.device, run.clock) for _ in range(max(1, shapes)))
    live = {id(i.trial): i.trial for i in (best, *run.adoptions)}
    for other in live.values():
        if other is not trial and other.config.compile.mode != "off":
            for _ in range(max(1, shapes)):
                other.step()
    return max(0.0, first - max(1, shapes) * step_s)


def _graphs_since(before: int | None) -> int | None:
    after = compiled_graphs()
    return None if after is None else after - (before or 0)


def _judged(
    run: Run,
    stage: str,
    candidate: Candidate,
    figures: Figures,
    best: Incumbent,
    fit_memory: bool,
    leader: bool = False,
) -> Outcome:
    """The candidate's outcome from its agreed figures, by ``decide``'s rules: the same on
    every rank, with nothing measured or agreed here."""
    comparison = figures.measured.comparison
    job = job_times(
        steps=run.horizon.steps,
        best_step_s=comparison.reference_step_ms / 1e3,
        ratio=comparison.speed.ratio,
        best_one_time_s=best.one_time_s,
        one_time_s=figures.one_time_s,
    )
    parity = loss_parity(
        figures.reference, figures.curve[:PARITY_STEPS], run.options.loss_tolerance
    )
    judged = (
        functools.partial(judge_against_leader, leader=best.name)
        if leader
        else functools.partial(judge, must_be_faster=not fit_memory)
    )
    verdict = judged(
        speed=comparison.speed,
        parity=parity,
        memory_bytes=figures.memory_bytes,
        memory_budget=run.options.memory_budget,
        job=job,
        tolerance=run.options.loss_tolerance,
    )
    reason = verdict.reason
    if not verdict.decided:
        reason += _what_it_needs(comparison, figures.measured.cut_short)
    if figures.memory_bytes is None:  # a footprint that could not be measured says why
        reason += f"; memory {figures.memory_kind}"
    if figures.graphs is not None:  # recompiles are a one-time cost the job pays too
        reason += f"; {figures.graphs} graph(s) compiled for {figures.shapes} shape(s)"
    state: State = "adopted" if verdict.adopt else "rejected" if verdict.decided else "undecided"
    return Outcome(
        stage=stage,
        name=candidate.name,
        config=candidate.config.to_dict(),
        verdict=state,
        reason=reason,
        comparison=comparison,
        rounds=figures.measured.rounds,
        memory_bytes=figures.memory_bytes,
        one_time_s=figures.one_time_s,
        break_even_steps=None if job.break_even == math.inf else job.break_even,
        job_s=job.candidate_s,
        reference_job_s=job.best_s,
        parity=parity,
        loss_curve=tuple(figures.curve[:PARITY_STEPS]),
        expected_gain=candidate.expected_gain,
        spent_s=figures.spent_s,
        count_per_step=figures.count_per_step,
        comm_bytes_per_step=figures.comm_bytes_per_step,
        compiled_graphs=figures.graphs,
        cold_one_time_s=figures.cold_one_time_s,
    )
