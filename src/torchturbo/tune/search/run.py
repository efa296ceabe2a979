"""The tuner: measure the biggest levers first, keep what helps, within a budget it keeps.

The article's closing advice ("apply one or two changes at a time and measure the real effect")
as a procedure:

1. **Baseline**: the recipe in fp32 eager on fixed batches; its first steps are the loss reference.
2. **Facts** (seconds): GEMM rates per precision, padding with and without length buckets, the
   convolution share of the FLOPs (``techniques.framework.facts``). A precision that cannot help
   on this hardware (TF32 on a CPU, bf16 without bf16 units) is decided here, not by training.
3. **Candidates by expected gain per second of measuring** (``techniques.framework.levers``), each
   built on the current best and timed against it in paired rounds on the same batches until the
   ratio is decided (``compare``; rules in ``decide``). A candidate that does not fit in what is
   left of the budget is not measured, and says how long it would have needed.
4. **Confirmation** of the chosen config against the baseline, only when they differ; adoptions
   that do not survive it are re-measured alone and dropped (``confirm``).

The budget covers all of it: before each candidate the time for the confirmation and the report
is held back, a running comparison stops when its next round would not fit, and a one-time cost
that cannot be split (a compile) is announced with its estimate and started only when it fits.
Tuning again with the previous results.json reuses what was measured (``previous``); so does
tuning again after a stop, from the record kept after every decided row (``on_record``) or the
report of the stopped run (:class:`TuneInterrupted`).

Under torchrun every rank runs the tuner, every trial is a DDP/FSDP trial, and every branch taken
on a measurement follows rank 0's value (``distributed.consensus``), so the ranks' collectives
keep pairing up and all ranks end with rank 0's config.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torchturbo.base.compiler import compile_cache
from torchturbo.config import TurboConfig
from torchturbo.distributed.consensus import agree
from torchturbo.distributed.launch import current_env
from torchturbo.engine import resolve_device
from torchturbo.measure.breakdown import PhaseRecorder
from torchturbo.measure.device_busy import measure_device_busy
from torchturbo.measure.footprint import MemoryEstimate
from torchturbo.measure.machine import summary
from torchturbo.measure.memory import memory_capacity
from torchturbo.measure.timing import time_once
from torchturbo.output.suggest import did_you_mean
from torchturbo.output.tables import format_bytes
from torchturbo.recipe import Recipe
from torchturbo.techniques import registry
from torchturbo.techniques.framework.facts import gather
from torchturbo.techniques.framework.levers import priority
from torchturbo.techniques.framework.proposal import Candidate, StageContext
from torchturbo.trials.memory_estimate import estimate_recipe_memory
from torchturbo.trials.trial import TrialBatches, start_trial
from torchturbo.tune.batch.choice import BatchChoice
from torchturbo.tune.batch.probe import apply_choice, find_batch
from torchturbo.tune.memory.plan import smallest_optimizer_state
from torchturbo.tune.search import batching
from torchturbo.tune.search.budget import (
    Budget,
    one_decision_s,
    refuse_impossible_memory_budget,
    refuse_short_time_budget,
)
from torchturbo.tune.search.candidate import estimate, reserve, try_candidate
from torchturbo.tune.search.compare import steps_per_round
from torchturbo.tune.search.confirm import confirm, unconfirmed
from torchturbo.tune.search.fastest_fit import fastest_alternative, fastest_fit
from torchturbo.tune.search.loader_stage import loader_stage
from torchturbo.tune.search.outcome import Confirmation, Outcome, TuneResult, left_out_for_time
from torchturbo.tune.search.previous import Previous, fingerprint, is_reusable
from torchturbo.tune.search.stages import levers, memory_stages, tuner_stages
from torchturbo.tune.search.state import (
    NUM_BATCHES,
    PARITY_STEPS,
    REPORT_S,
    WARM_STEPS,
    Incumbent,
    Run,
    Stage,
    TuneOptions,
    batch_count,
)

__all__ = ["TuneInterrupted", "TuneOptions", "select_stages", "tune"]

#: The stage that measures the loader rather than proposing trial candidates.
LOADER_STAGE = "data_loader"
#: A candidate expected to gain this much is one the budget should measure (or say it cannot).
LARGE_GAIN = 1.10


class TuneInterrupted(KeyboardInterrupt):
    """A stop signal or Ctrl-C during :func:`tune` once the baseline was measured. ``partial``
    holds every candidate decided so far and the adoptions in order, in the shape of a
    results.json, so that ``tune(..., previous=partial)`` reuses them and measures only the rest;
    ``config`` and ``result`` are the run as far as it went (its confirmation ``interrupted``),
    for the report. Building them measures nothing and meets no other rank."""

    def __init__(
        self, partial: dict[str, Any], config: TurboConfig, result: TuneResult, why: str
    ) -> None:
        self.partial = partial
        self.config = config
        self.result = result
        #: "stopped by SIGTERM": what ended the run.
        self.why = why
        super().__init__(f"{self.measured} measured candidate(s) kept in .partial")

    @property
    def measured(self) -> int:
        """How many of the candidates the next run will reuse."""
        return sum(is_reusable(r["verdict"], r["stage"]) for r in self.partial["candidates"])


def tune(
    recipe: Recipe,
    options: TuneOptions | None = None,
    *,
    stages: Mapping[str, Stage] | None = None,
    on_progress: Callable[[str, str, float], None] | None = None,
    previous: Mapping[str, Any] | Sequence[tuple[Mapping[str, Any], str]] | None = None,
    previous_source: str = "the previous results.json",
    clock: Callable[[], float] = time.perf_counter,
    on_estimate: Callable[[MemoryEstimate], None] | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[TurboConfig, TuneResult]:
    """Tune ``recipe``; returns the chosen config and the run's :class:`TuneResult`.

    ``previous`` is an earlier run's results (its results.json, named by ``previous_source``):
    candidates it decided for the same recipe, machine and options are reused and the budget goes
    to the others. Several (results, name) pairs may be given: the first made for this run is
    reused. ``on_progress(stage, candidate, seconds_left)`` is called as the work moves on;
    ``clock`` is what the budget is counted on. ``on_estimate`` is handed the memory estimate
    of the baseline step before anything is measured (the result then says how far off it was).
    ``on_record`` is handed the run's record so far (as ``previous`` reads it) after every
    decided row, so that a run killed at any point loses at most the row it was measuring.
    """
    options = options or TuneOptions()
    with compile_cache(options.compile_cache_dir):
        config, result = _tune(
            recipe,
            options,
            stages,
            on_progress,
            previous,
            previous_source,
            clock,
            on_estimate,
            on_record,
        )
    if config.compile.mode != "off" and options.compile_cache_dir:
        config = config.replace(compile__cache_dir=options.compile_cache_dir)
    return config, result


def _find_batch(
    recipe: Recipe,
    options: TuneOptions,
    config: TurboConfig,
    say: Callable[[str, str, float], None],
    budget: Budget,
) -> BatchChoice | None:
    """The batch finder's plan when asked for (``--find-batch``): the baseline, hence every
    candidate built on it, trains in its micro-batches."""
    if options.find_batch is None:
        return None
    within = batch_budget(options.memory_budget, resolve_device(config.device))
    say("batch", f"largest micro-batch within {format_bytes(within)}", budget.left())
    return find_batch(recipe, within, config=config, mode=options.find_batch)


#: Without --memory-budget, the batch finder fills this share of a GPU's memory (the rest is
#: the caching allocator's slack and what other processes hold).
GPU_MEMORY_SHARE = 0.9


def batch_budget(memory_budget: int | None, device: torch.device) -> int:
    """The bytes ``--find-batch`` fits a step into: ``--memory-budget``, else on a GPU most of
    its memory; on a CPU there is no such default (RAM is shared with everything else)."""
    if memory_budget is not None:
        return memory_budget
    if device.type != "cuda":
        raise ValueError(
            "--find-batch needs --memory-budget on a CPU (give the memory a step may use, e.g. "
            "--memory-budget 8GiB); on a GPU it defaults to 90% of the GPU's memory"
        )
    return int(GPU_MEMORY_SHARE * memory_capacity(device))


def _tune(
    recipe: Recipe,
    options: TuneOptions,
    stages: Mapping[str, Stage] | None,
    on_progress: Callable[[str, str, float], None] | None,
    previous: Mapping[str, Any] | Sequence[tuple[Mapping[str, Any], str]] | None,
    previous_source: str,
    clock: Callable[[], float],
    on_estimate: Callable[[MemoryEstimate], None] | None,
    on_record: Callable[[dict[str, Any]], None] | None,
) -> tuple[TurboConfig, TuneResult]:
    selected = select_stages(stages or tuner_stages(), options)
    budget = Budget(options.time_budget_s, clock)
    device = resolve_device(options.device or "auto")
    say = on_progress or (lambda stage, candidate, left: None)
    base_config = TurboConfig(device=str(device))
    batch_choice = _find_batch(recipe, options, base_config, say, budget)
    if batch_choice is not None:
        base_config = apply_choice(base_config, batch_choice)
    say("baseline", "fp32 eager", budget.left())
    trial_batches = TrialBatches(recipe, NUM_BATCHES)
    batches = trial_batches(base_config)
    say("estimate", "memory of the baseline step", budget.left())
    # Block forwards are timed only for the planner: without a budget nothing is planned.
    memory, memory_error = _estimate(recipe, batches[0], device, options.memory_budget is not None)
    if memory is not None and on_estimate is not None:
        on_estimate(memory)
    if options.refuse_impossible and options.memory_budget is not None and memory is not None:
        refuse_impossible_memory_budget(
            options.memory_budget,
            weights=memory.weights_bytes,
            gradients=memory.gradients_bytes,
            # A smaller optimizer state is one of the planner's plans: the floor is its bytes.
            optimizer_state=smallest_optimizer_state(recipe, memory),
            step_bytes=memory.total_bytes,
        )
    say("baseline", "fp32 eager", budget.left())
    begin = clock()
    trial, first = start_trial(recipe, base_config, batches, clock)
    build_s = max(0.0, clock() - begin - first)
    # Seconds per step: fewer batches per trial, so that a pass over them stays short.
    trial_batches.shorten(agree(batch_count(first)))
    baseline = Incumbent("fp32 eager", base_config, trial, None)
    best = baseline
    adoptions: list[Incumbent] = []
    try:
        phases = PhaseRecorder(device)
        with trial.turbo.recording(phases):
            steps = [time_once(trial.step, device, clock) for _ in range(PARITY_STEPS - 1)]
        trial.step_seconds = agree(statistics.median(steps))
        baseline.one_time_s = max(0.0, agree(first) - trial.step_seconds)
        if options.refuse_impossible:
            _refuse_short_budget(recipe, options, budget, agree(build_s), trial.step_seconds)
        baseline.memory_bytes = agree(trial.memory_footprint()[0])
        say("facts", "GEMM rates per precision, padding, FLOPs", budget.left())
        run = Run(
            recipe=recipe,
            options=options,
            device=device,
            budget=budget,
            batches=trial_batches,
            say=say,
            facts=_facts(recipe, trial, device, phases),
            build_s=agree(build_s),
            baseline_step_s=trial.step_seconds,
            reference_config=base_config,
            reference_curves={
                registry.batch_key(base_config): (batches, trial.loss_curve()[:PARITY_STEPS])
            },
            adoptions=adoptions,
            memory=memory,
            baseline_count=trial.mean_count(),
        )
        parameters = sum(p.numel() for p in trial.model.parameters())
        current = fingerprint(recipe, options, device, parameters)
        if isinstance(previous, Mapping):
            previous = [(previous, previous_source)]
        reuse, reuse_note = Previous.first(previous or [], current)
        if reuse_note:
            say("reuse", reuse_note, budget.left())
        if on_record is not None:
            run.on_decided = lambda: on_record(_partial(run, current, reuse))
        loader = None
        try:
            if LOADER_STAGE in selected:
                outcome, loader, data = loader_stage(run, baseline)
                run.outcomes.append(outcome)
                if data is not None:
                    baseline.config = base_config.replace(data=data)
            best = _replay(run, reuse, baseline)
            trial_stages = {k: v for k, v in selected.items() if k != LOADER_STAGE}
            best = _search(run, trial_stages, best, baseline)
            say("confirmation", best.name, budget.left())
            confirmation, best = confirm(run, baseline, best)
        except KeyboardInterrupt as interrupt:
            best = run.adoptions[-1] if run.adoptions else baseline
            # Ctrl-C under Python's own handler is a plain KeyboardInterrupt.
            why = f"stopped by {getattr(interrupt, 'signal_name', None) or 'SIGINT'}"
            result = _result(
                run,
                baseline,
                best,
                unconfirmed(run, why),
                loader,
                reuse,
                reuse_note,
                current,
                interrupted=True,
            )
            result = dataclasses.replace(
                result,
                memory_estimate=_estimate_record(memory, memory_error, baseline.memory_bytes),
            )
            partial = _partial(run, current, reuse)
            raise TuneInterrupted(partial, best.config, result, why) from interrupt
        result = _result(run, baseline, best, confirmation, loader, reuse, reuse_note, current)
        result = dataclasses.replace(
            result, memory_estimate=_estimate_record(memory, memory_error, baseline.memory_bytes)
        )
    finally:
        live = {id(i.trial): i.trial for i in (baseline, best, *adoptions)}
        for live_trial in live.values():
            live_trial.close()
    if batch_choice is not None:
        result = dataclasses.replace(result, batch=batch_choice.to_dict())
    return best.config, result


def _refuse_short_budget(
    recipe: Recipe, options: TuneOptions, budget: Budget, build_s: float, step_s: float
) -> None:
    """Stop at once, before more of it is spent, when the time budget cannot decide a
    single candidate (``tune.search.budget.one_decision_s``, from the baseline's steps)."""
    needed = one_decision_s(
        spent_s=budget.elapsed(),
        build_s=build_s,
        step_s=step_s,
        # The cheapest candidate trains the baseline's batches: one step a side is a round.
        steps_per_round=steps_per_round(step_s),
        warm_steps=WARM_STEPS,
        report_s=REPORT_S,
    )
    refuse_short_time_budget(options.time_budget_s, agree(needed), step_s)


def _estimate(
    recipe: Recipe, batch: Any, device: torch.device, time_blocks: bool
) -> tuple[MemoryEstimate | None, str | None]:
    """The baseline step's memory estimate, or None and why it could not be made (the tuner
    goes on without it: the planner then says it has nothing to plan from)."""
    try:
        memory = estimate_recipe_memory(recipe, batch, device, time_blocks=time_blocks)
        return agree(memory), None
    except Exception as err:  # a model the hooks cannot follow is a finding, not a crash
        return None, agree(f"{type(err).__name__}: {err}"[:300])


def _estimate_record(
    memory: MemoryEstimate | None, error: str | None, measured: int | None
) -> dict[str, Any]:
    """What results.json keeps of the estimate: its split, the measured footprint it is
    judged against and the relative error (estimate / measured - 1)."""
    if memory is None:
        return {"error_reason": error or "not made"}
    record = memory.to_dict()
    record["measured_bytes"] = measured
    record["error"] = None if not measured else memory.total_bytes / measured - 1
    return record


def select_stages(stages: Mapping[str, Stage], options: TuneOptions) -> dict[str, Stage]:
    """The stages ``only`` and ``skip`` leave, in order; an unknown name is an error that lists
    the stages."""
    names = [LOADER_STAGE, *stages]
    for option, chosen in (("--only", options.only), ("--skip", options.skip)):
        unknown = sorted(set(chosen) - set(names))
        if unknown:
            guess = did_you_mean(unknown[0], names)
            raise ValueError(
                f"{option} {','.join(unknown)}: no such stage{guess}; the stages are "
                f"{', '.join(names)}"
            )
    keep = [n for n in names if (not options.only or n in options.only) and n not in options.skip]
    return {n: stages.get(n, _measured_apart) for n in keep}


def _measured_apart(context: StageContext) -> str:
    return "the loader is measured apart from the trials (tune.search.loader_stage)"


def _facts(recipe: Recipe, trial: Any, device: torch.device, phases: PhaseRecorder) -> Any:
    batch = trial.batches[0]

    def forward() -> Any:
        return trial.turbo.forward(recipe.loss_fn, batch)

    comm = trial.comm_per_step()
    step = trial.step_seconds
    share = None if comm is None or comm[1] is None or not step else min(1.0, comm[1] / step)
    totals = phases.totals()
    optimizer = totals.get("optimizer", 0.0) / sum(totals.values()) if totals else None
    facts = gather(
        recipe,
        trial.model,
        trial.batches,
        device,
        forward,
        comm_share=share,
        optimizer_share=optimizer,
        step_s=step,
        device_busy=measure_device_busy(trial.step, device),
    )
    return agree(facts)


def _partial(run: Run, current: dict[str, Any], reuse: Previous | None) -> dict[str, Any]:
    """What an interrupted run measured, as much of a results.json as ``Previous`` reads; with
    what it was reusing even when interrupted before replaying it, so that nothing is lost."""
    outcomes = list(run.outcomes)
    adopted = [a.name for a in run.adoptions]
    if reuse is not None and reuse.outcomes and not any(o.reused for o in outcomes):  # not replayed
        outcomes += reuse.outcomes
        adopted = [o.name for o in reuse.adopted]
    return {
        "recipe": run.recipe.name,
        "interrupted": True,
        "fingerprint": current,
        "candidates": [o.to_dict() for o in outcomes],
        "adopted": adopted,
    }


def _replay(run: Run, reuse: Previous | None, baseline: Incumbent) -> Incumbent:
    """Take a previous run's outcomes and rebuild the config it chose as the current best."""
    if reuse is None:
        return baseline
    if not reuse.adopted:
        run.outcomes.extend(reuse.outcomes)
        return baseline
    names = ", ".join(o.name for o in reuse.adopted)
    run.say("reuse", f"rebuilding {names}", run.budget.left())
    last = reuse.adopted[-1]
    config = TurboConfig.from_dict(last.config)
    trial, _ = start_trial(run.recipe, config, run.batches(config), run.clock)
    for _ in range(WARM_STEPS):
        trial.step()
    trial.step_seconds = agree(min(time_once(trial.step, run.device, run.clock) for _ in range(2)))
    for outcome in reuse.adopted:
        adopted = TurboConfig.from_dict(outcome.config)
        run.adoptions.append(Incumbent(outcome.name, adopted, trial, None, outcome=outcome))
    best = Incumbent(last.name, config, trial, agree(trial.memory_footprint()[0]), outcome=last)
    best.one_time_s = last.one_time_s or 0.0
    run.adoptions[-1] = best
    # Only now: a rebuild interrupted before this keeps them through _partial, adoptions too.
    run.outcomes.extend(reuse.outcomes)
    return best


def _search(
    run: Run, stages: Mapping[str, Stage], best: Incumbent, baseline: Incumbent
) -> Incumbent:
    """Measure candidates, the highest expected gain per second first, until none is left."""
    tried = {o.name for o in run.outcomes}
    planned = False
    memory, lever_of = memory_stages(), levers()
    while proposals := _proposals(run, stages, best, tried):
        run.on_decided()  # the rows decided so far, whatever ends the run from here
        if not planned:  # before the first measurement, say what the budget leaves out
            planned = True
            # Estimates read this rank's clock: every rank takes rank 0's note (a collective).
            run.budget_note = agree(_budget_note(run, proposals, best))
            if run.budget_note:
                run.say("budget", run.budget_note, run.budget.left())
        over = _over_memory_budget(run, best)
        ranks = [
            _rank(run, *proposal, best, over and proposal[0] in memory) for proposal in proposals
        ]
        # Estimates read this rank's clock and load: the pick is rank 0's on every rank.
        stage, candidate = proposals[agree(ranks.index(max(ranks)))]
        if over and stage in memory:
            fits = [(s, c) for s, c in proposals if s in memory]
            best = fastest_fit(run, fits, best, tried)
            continue
        # The lever's alternatives (bf16 or fp16, buckets or packing), best prior first, are
        # measured against the same best and raced, not each judged after the other's adoption.
        by_rank = agree(sorted(range(len(proposals)), key=lambda i: -ranks[i]))
        pulls = lever_of.get(stage, stage)
        lever = [
            proposals[i] for i in by_rank if lever_of.get(proposals[i][0], proposals[i][0]) == pulls
        ]
        if len(lever) > 1:
            best = fastest_alternative(run, lever, best, tried)
            continue
        tried.add(candidate.name)
        outcome, incumbent = try_candidate(run, stage, candidate, best, over and stage in memory)
        run.outcomes.append(outcome)
        if incumbent is not None:
            # The superseded best stays alive: the confirmation times every adoption again
            # in the same rounds, which is what the incremental table shows.
            run.adoptions.append(incumbent)
            best = incumbent
    if not run.adoptions:
        best = _undecided_again(run, stages, best)
    run.on_decided()
    return best


def _undecided_again(run: Run, stages: Mapping[str, Stage], best: Incumbent) -> Incumbent:
    """Nothing was adopted, so no confirmation will run: the time held back for it goes to the
    candidates the budget left undecided, the largest expected gain first, each measured
    against the baseline again, going on from its earlier rounds, until one is adopted (its own
    measurement against the baseline is then its figure, ``confirm``) or the time is spent. Each
    one's new row replaces its undecided one."""
    undecided = {o.name: o for o in run.outcomes if o.verdict == "undecided"}
    if not undecided:
        return best
    tried = {o.name for o in run.outcomes} - set(undecided)
    again = [p for p in _proposals(run, stages, best, tried) if p[1].name in undecided]
    again.sort(key=lambda proposal: -(proposal[1].expected_gain or 1.0))
    for stage, candidate in again:
        earlier = undecided[candidate.name].rounds
        outcome, incumbent = try_candidate(
            run, stage, candidate, best, False, confirming=False, earlier=earlier
        )
        if outcome.verdict == "not measured":  # the time is spent: the first row stands
            break
        run.outcomes = [o for o in run.outcomes if o.name != candidate.name] + [outcome]
        if incumbent is not None:
            run.adoptions.append(incumbent)
            return incumbent
    return best


def _budget_note(run: Run, proposals: list[tuple[str, Candidate]], best: Incumbent) -> str:
    """Before the search: when what is left of the budget cannot measure every candidate
    expected to gain ``LARGE_GAIN`` or more, which of them it may leave out and the budget that
    would measure them all (from the candidates' cost estimates, ``candidate.estimate``)."""
    large = [c for _, c in proposals if (c.expected_gain or 0.0) >= LARGE_GAIN]
    needed = sum(estimate(run, c, best).typical_s for c in large)
    needed += reserve(run, best.trial.step_seconds or run.baseline_step_s)
    left = run.budget.left()
    if not large or needed <= left:
        return ""
    names = ", ".join(f"{c.name} (~{c.expected_gain:.2f}x)" for c in large)
    minutes = math.ceil((run.budget.elapsed() + needed) / 60)
    return (
        f"the {_duration(run.options.time_budget_s)} budget may not measure every candidate "
        f"expected to gain {LARGE_GAIN - 1:.0%} or more: {names} need ~{needed:.0f} s, "
        f"{max(left, 0.0):.0f} s are left; --time-budget {minutes}m would measure them all"
    )


def _duration(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 and seconds % 60 == 0 else f"{seconds:g} s"


def _proposals(
    run: Run, stages: Mapping[str, Stage], best: Incumbent, tried: set[str]
) -> list[tuple[str, Candidate]]:
    """Every untried candidate of every stage, built on the current best; a stage or candidate
    that cannot apply is recorded once (in ``tried``), as not applicable, with the fact that
    says so."""
    context = _context(run, best)
    proposals = []
    for stage_name, stage in stages.items():
        proposed = stage(context)
        if isinstance(proposed, str):
            if stage_name not in tried:
                tried.add(stage_name)
                run.outcomes.append(_stage_outcome(stage_name, best.config, proposed))
            continue
        for candidate in proposed:
            if candidate.name in tried:
                continue
            if candidate.not_applicable:
                tried.add(candidate.name)
                run.outcomes.append(
                    Outcome(
                        stage=stage_name,
                        name=candidate.name,
                        config=candidate.config.to_dict(),
                        verdict="not applicable",
                        reason=candidate.not_applicable,
                    )
                )
                continue
            proposals.append((stage_name, candidate))
    return proposals


def _stage_outcome(stage: str, config: TurboConfig, reason: str) -> Outcome:
    return Outcome(
        stage=stage, name=stage, config=config.to_dict(), verdict="not applicable", reason=reason
    )


def _context(run: Run, best: Incumbent) -> StageContext:
    env = current_env()
    return StageContext(
        recipe=run.recipe,
        best=best.config,
        device=run.device,
        facts=run.facts,
        best_memory_bytes=best.memory_bytes,
        memory_budget=run.options.memory_budget,
        world_size=env.world_size,
        backend=env.backend,
        batch_size=batching.batch_size(best.trial.batches),
        memory=run.memory,
    )


def _over_memory_budget(run: Run, best: Incumbent) -> bool:
    budget = run.options.memory_budget
    return budget is not None and (best.memory_bytes or 0) > budget


def _rank(run: Run, stage: str, candidate: Candidate, best: Incumbent, fits_first: bool) -> float:
    """Memory candidates first while the best does not fit the budget (``fits_first``); then
    gain per second."""
    if fits_first:
        return math.inf
    return priority(candidate.expected_gain, estimate(run, candidate, best).typical_s)


def _result(
    run: Run,
    baseline: Incumbent,
    best: Incumbent,
    confirmation: Confirmation,
    loader: dict[str, Any] | None,
    reuse: Previous | None,
    reuse_note: str,
    current: dict[str, Any],
    *,
    interrupted: bool = False,
) -> TuneResult:
    """The run's result. ``interrupted``: a stop cut it short, and the ranks may no longer meet:
    nothing is measured (no phase breakdown) and the counts are those already agreed."""
    order = {name: i for i, name in enumerate([LOADER_STAGE, *tuner_stages()])}
    candidates = sorted(run.outcomes, key=lambda o: order.get(o.stage, len(order)))
    kept = (
        ()
        if confirmation.state == "reverted"
        else tuple(a.name for a in run.adoptions if a.name not in confirmation.dropped)
    )
    loader_adopted = tuple(
        o.name for o in candidates if o.stage == LOADER_STAGE and o.verdict == "adopted"
    )
    breakdown = {} if interrupted else _breakdowns(run, baseline, best)
    return TuneResult(
        recipe=run.recipe.name,
        device=str(run.device),
        processes=current_env().world_size,
        torch=torch.__version__,
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        unit=f"{run.recipe.count_unit}/s",
        baseline=Outcome(
            stage="baseline",
            name="fp32 eager",
            config=baseline.config.to_dict(),
            verdict="reference",
            reason="the reference every candidate is measured against",
            memory_bytes=baseline.memory_bytes,
            one_time_s=baseline.one_time_s,
            comm_bytes_per_step=(baseline.trial.comm_per_step() or (None,))[0],
            loss_curve=tuple(run.reference_losses),
        ),
        baseline_step_ms=run.baseline_step_s * 1e3,
        baseline_throughput=run.baseline_count / run.baseline_step_s,
        candidates=tuple(candidates),
        adopted=loader_adopted + kept,
        confirmation=confirmation,
        facts=dataclasses.asdict(run.facts),
        loader=loader,
        time_budget_s=run.options.time_budget_s,
        elapsed_s=run.budget.elapsed(),
        memory_budget_bytes=run.options.memory_budget,
        planned_steps=run.horizon.steps,
        planned_steps_source=run.horizon.source,
        planned_steps_assumed=run.horizon.assumed,
        baseline_one_time_s=baseline.one_time_s,
        best_one_time_s=best.one_time_s,
        loss_tolerance=run.options.loss_tolerance,
        unmeasured_s=sum(
            o.estimate_s or 0.0 for o in candidates if left_out_for_time(o.verdict, o.reason)
        ),
        reused_from=None if reuse is None else reuse.source,
        reuse_note=reuse_note,
        breakdown=breakdown,
        loss_curves={
            "baseline": list(run.reference_losses),
            "best": batching.window_losses(best.trial.loss_curve(), best.config.accumulation.steps)[
                :PARITY_STEPS
            ],
        },
        system=summary(),
        fingerprint=current,
        budget_note=run.budget_note,
        baseline_count_per_step=_job_count_per_step(run, baseline, run.baseline_count),
        best_count_per_step=_job_count_per_step(
            run, best, _trial_count(run, best, baseline, interrupted)
        ),
    )


def _trial_count(run: Run, best: Incumbent, baseline: Incumbent, interrupted: bool) -> float:
    """The chosen config's trial's mean count per step: counted again (a collective), or after
    a stop the figure its adoption agreed on."""
    if best is baseline:
        return run.baseline_count
    if not interrupted:
        return best.trial.mean_count()
    counted = best.outcome.count_per_step if best.outcome is not None else None
    return run.baseline_count if counted is None else counted


def _job_count_per_step(run: Run, incumbent: Incumbent, trial_count: float) -> float:
    """What a step of ``incumbent``'s job trains on average: the epoch's tokens over its plan's
    batches where the recipe counts tokens and has lengths, else its trial's mean count."""
    count = run.batches.tokens_per_step(incumbent.config)
    return trial_count if count is None else count


def _breakdowns(run: Run, baseline: Incumbent, best: Incumbent) -> dict[str, dict[str, float]]:
    """Seconds per step by phase of the baseline and the chosen config, from up to three steps
    each with a syncing PhaseRecorder, as far as the budget allows (the report says when not)."""
    out: dict[str, dict[str, float]] = {}
    for key, incumbent in (("baseline", baseline), ("best", best)):
        if key == "best" and best is baseline:
            if "baseline" in out:
                out["best"] = out["baseline"]
            break
        step_s = incumbent.trial.step_seconds or run.baseline_step_s
        recorder = PhaseRecorder(incumbent.trial.turbo.device)
        steps = 0
        with incumbent.trial.turbo.recording(recorder):
            while steps < 3 and agree(run.budget.left() - REPORT_S >= step_s):
                incumbent.trial.step()
                steps += 1
        if steps:
            out[key] = {phase: seconds / steps for phase, seconds in recorder.totals().items()}
    return out
