"""The confirmation: the chosen config against the baseline, measured again, and what to do when
it does not hold.

Each adoption was measured against the best of its time; chaining them assumes the gains
multiply, and each verdict had its own (small) chance of being noise. So the chosen config is
timed against the fp32 baseline once more. If it is not faster beyond the noise, every adoption
is re-measured alone against the baseline, those that are not faster are dropped, the survivors
are combined and confirmed (or, failing that, the single best survivor is kept), and the report
says so. When nothing survives, or the budget runs out first, the baseline is kept: the written
turbo.toml is never one that measured no faster than the defaults. The rules are ``decide``'s
(``judge_confirmation``, ``holds_alone``); this module measures and records.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torchturbo.config import TurboConfig, sections
from torchturbo.distributed.consensus import agree
from torchturbo.techniques.framework.decide import (
    MIN_ROUNDS,
    confirmation_target,
    describe,
    holds_alone,
    judge_confirmation,
)
from torchturbo.trials.trial import Trial, start_trial
from torchturbo.tune.search.budget import CONFIRM_ROUNDS
from torchturbo.tune.search.compare import Measured, compare, compare_chain
from torchturbo.tune.search.outcome import Comparison, Confirmation, ConfirmationState
from torchturbo.tune.search.stages import memory_stages
from torchturbo.tune.search.state import REPORT_S, WARM_STEPS, Incumbent, Run

BASELINE = "fp32 eager"


def confirm(run: Run, baseline: Incumbent, best: Incumbent) -> tuple[Confirmation, Incumbent]:
    """The confirmation and the config to keep (``best``, a reduced one, or the baseline).

    The baseline and every adoption's trial are timed in the same rounds (``compare_chain``):
    the incremental table is that one measurement, so each row's throughput over the row above
    is its ratio, and its last row over its first is the confirmed ratio."""
    if best is baseline or not run.adoptions:
        return Confirmation(state="not needed", comparison=None), baseline
    if len(run.adoptions) == 1 and run.budget.left() - REPORT_S < _least_confirmation(run):
        # The time held back for this was given to the search (``run._undecided_again``): the
        # lone adoption's own paired measurement against the baseline is its figure.
        why = "the budget held back for the confirmation went to measuring it"
        return unconfirmed(run, why, state="unconfirmed"), best
    floor = _fitting_floor(run, baseline)
    if floor is best:
        return _fits(floor, ()), floor
    steps = _chain_steps(run, baseline)
    searched = _searched(run)
    expected = confirmation_target(searched, must_fit=floor is not None)
    chained = compare_chain(
        [trial for _, _, trial in steps],
        [name for name, _, _ in steps],
        device=run.device,
        max_rounds=run.options.max_rounds,
        may_continue=lambda seconds: run.budget.left() - REPORT_S >= seconds,
        settle_rounds=CONFIRM_ROUNDS,
        # Rounds go on until the search is confirmed or contradicted (or time and rounds run
        # out): "not faster, but not contradicting either" is not an answer worth stopping at.
        decided=lambda speed: judge_confirmation(speed, expected) != "consistent",
        clock=run.clock,
    )
    measured = chained.overall
    rows = tuple(
        _row(name, stage, trial, comparison)
        for (name, stage, trial), comparison in zip(steps, chained.rows, strict=True)
    )
    rows[0]["throughput"] = rows[1]["reference_throughput"]
    speed = measured.comparison.speed
    judged = judge_confirmation(speed, expected)
    if judged == "confirmed":
        return Confirmation(state="confirmed", comparison=measured.comparison, rows=rows), best
    if judged == "consistent":
        note = (
            f"the search measured {searched:.2f}x; the confirmation does not contradict it but "
            f"could not decide it in {speed.rounds} rounds on this machine: rerun when it is "
            "quieter, or with a larger budget, to confirm"
        )
        return (
            Confirmation(state="consistent", comparison=measured.comparison, note=note, rows=rows),
            best,
        )
    if floor is not None:
        later = [a.name for a in run.adoptions[run.adoptions.index(floor) + 1 :]]
        return _fits(floor, tuple(later), describe(speed)), floor
    return _drop(run, baseline, measured)


def _searched(run: Run) -> float:
    """What the search's adoptions multiply to over the baseline, each by its own measurement."""
    return math.prod(
        a.outcome.over_best or a.outcome.comparison.speed.ratio
        for a in run.adoptions
        if a.outcome is not None and a.outcome.comparison is not None
    )


def _least_confirmation(run: Run) -> float:
    """Seconds of the shortest confirmation: ``MIN_ROUNDS`` paired rounds of the baseline and
    the best, each of the steps ``compare`` would time (one per step at these step times)."""
    best = run.adoptions[-1].trial.step_seconds or run.baseline_step_s
    return MIN_ROUNDS * (run.baseline_step_s + best)


def unconfirmed(run: Run, why: str, *, state: ConfirmationState = "interrupted") -> Confirmation:
    """No confirmation ran (``why``: the run was stopped, ``state`` "interrupted", or the
    budget went to measuring the lone adoption, "unconfirmed"): the incremental table is each
    adoption's own measurement, the one that adopted it, against the best of its time."""
    measured = [
        (a.name, a.outcome.stage, a.outcome.comparison)
        for a in run.adoptions
        if a.outcome is not None and a.outcome.comparison is not None
    ]
    if not measured:
        return Confirmation(state=state, comparison=None, note=f"{why}: nothing adopted")
    first = measured[0][2]
    head = {
        "name": f"baseline ({BASELINE})",
        "stage": "",
        "step_ms": first.reference_step_ms,
        "throughput": first.reference_throughput,
    }
    rows = [{"name": f"+ {name}", "stage": stage, **c.to_dict()} for name, stage, c in measured]
    if state == "unconfirmed":
        note = (
            f"{why}: it measured {_searched(run):.2f}x against the baseline in its own paired "
            "rounds, unconfirmed; a larger --time-budget confirms it"
        )
    else:
        note = (
            f"{why} before the confirmation: the search's adoptions measured "
            f"{_searched(run):.2f}x together, unconfirmed; the same command measures the rest "
            "and confirms"
        )
    return Confirmation(state=state, comparison=None, note=note, rows=(head, *rows))


def _fitting_floor(run: Run, baseline: Incumbent) -> Incumbent | None:
    """The last adoption that made the step fit ``--memory-budget``, when the baseline does
    not fit it: the written config must keep it (None when there is no budget to fit)."""
    budget = run.options.memory_budget
    if budget is None or baseline.memory_bytes is None or baseline.memory_bytes <= budget:
        return None
    fitting = [
        a for a in run.adoptions if a.outcome is not None and a.outcome.stage in memory_stages()
    ]
    return fitting[-1] if fitting else None


def _fits(floor: Incumbent, dropped: tuple[str, ...], measured: str = "") -> Confirmation:
    """The fitting adoption kept, with its own measurement against the baseline."""
    note = f"{BASELINE} does not fit the memory budget, so {floor.name} is kept"
    if dropped:
        note = (
            f"the chosen config measured {measured} against {BASELINE}, below what the search "
            f"measured: {', '.join(dropped)} dropped; {note}"
        )
    outcome = floor.outcome
    if outcome is None or outcome.comparison is None:
        return Confirmation(state="fits", comparison=None, dropped=dropped, note=note)
    rows = _pair_rows(floor.name, outcome.comparison, outcome.stage)
    return Confirmation(
        state="fits", comparison=outcome.comparison, dropped=dropped, note=note, rows=rows
    )


def _chain_steps(run: Run, baseline: Incumbent) -> list[tuple[str, str, Trial]]:
    """(name, stage, trial) of the baseline and each adoption; adoptions replayed from a
    previous run share one rebuilt trial and make one row."""
    steps: list[tuple[str, str, Trial]] = [(f"baseline ({BASELINE})", "", baseline.trial)]
    for adoption in run.adoptions:
        stage = adoption.outcome.stage if adoption.outcome is not None else ""
        if steps[-1][2] is adoption.trial:
            name, stages, trial = steps[-1]
            steps[-1] = (f"{name} + {adoption.name}", f"{stages}, {stage}", trial)
        else:
            steps.append((f"+ {adoption.name}", stage, adoption.trial))
    return steps


def _row(name: str, stage: str, trial: Trial, comparison: Comparison | None) -> dict[str, Any]:
    """One row of the incremental table: a config's figures from the chained measurement."""
    row: dict[str, Any] = {"name": name, "stage": stage}
    if comparison is None:  # the first row: its figures are the reference side of the next
        row.update(step_ms=(trial.step_seconds or math.nan) * 1e3)
        return row
    row.update(comparison.to_dict())
    return row


def _pair_rows(name: str, c: Comparison, stage: str = "") -> tuple[dict[str, Any], ...]:
    """The incremental table of one comparison with the baseline: the baseline, then the kept
    config (a pairwise confirmation's, or a fitting plan's own measurement)."""
    first = {
        # A fitting plan measured on top of an earlier adoption names that one.
        "name": f"baseline ({BASELINE})" if c.against == BASELINE else c.against,
        "stage": "",
        "step_ms": c.reference_step_ms,
        "throughput": c.reference_throughput,
    }
    return first, {"name": f"+ {name}", "stage": stage, **c.to_dict()}


def _against_baseline(run: Run, baseline: Incumbent, trial: Trial) -> Measured:
    return compare(
        baseline.trial,
        trial,
        against=BASELINE,
        device=run.device,
        max_rounds=run.options.max_rounds,
        may_continue=lambda seconds: run.budget.left() - REPORT_S >= seconds,
        min_rounds=MIN_ROUNDS,
        settle_rounds=CONFIRM_ROUNDS,
        clock=run.clock,
    )


def _drop(run: Run, baseline: Incumbent, failed: Measured) -> tuple[Confirmation, Incumbent]:
    """Re-measure each adoption alone; keep the survivors together if that confirms, else the
    best single survivor, else the baseline."""
    names = [a.name for a in run.adoptions]
    run.say(
        "confirmation", f"not confirmed: re-measuring {', '.join(names)} alone", run.budget.left()
    )
    survivors: list[tuple[Incumbent, Measured]] = []
    changes: dict[str, dict[str, Any]] = {}
    remeasured = []
    previous = baseline.config
    for adoption in run.adoptions:
        changes[adoption.name] = _changes(previous, adoption.config)
        previous = adoption.config
        if agree(run.budget.left() <= REPORT_S):
            continue
        remeasured.append(adoption.name)
        alone = _start(run, adoption.name, changes[adoption.name], baseline)
        measured = _against_baseline(run, baseline, alone.trial)
        if holds_alone(measured.comparison.speed):
            survivors.append((alone, measured))
        else:
            alone.trial.close()
    lead = (
        f"the chosen config measured {describe(failed.comparison.speed)} against {BASELINE}, "
        "below what the search measured"
    )
    if not survivors:
        unchecked = [n for n in names if n not in remeasured]
        why = (
            f"no time was left to re-measure {', '.join(unchecked)}"
            if unchecked
            else "no adoption was faster alone"
        )
        if unchecked and remeasured:
            why = f"{', '.join(remeasured)} were not faster alone and {why}"
        note = f"{lead}, and {why}: keeping {BASELINE}"
        return (
            Confirmation(
                state="reverted",
                comparison=failed.comparison,
                dropped=tuple(names),
                note=note,
            ),
            baseline,
        )
    kept, measured = max(survivors, key=lambda s: s[1].comparison.speed.ratio)
    if len(survivors) > 1 and agree(run.budget.left() > REPORT_S):
        together = _start(
            run,
            " + ".join(s.name for s, _ in survivors),
            {k: v for s, _ in survivors for k, v in changes[s.name].items()},
            baseline,
        )
        combined = _against_baseline(run, baseline, together.trial)
        if holds_alone(combined.comparison.speed):
            kept, measured = together, combined
        else:
            together.trial.close()
    for other, _ in survivors:
        if other is not kept:
            other.trial.close()
    held = [s.name for s, _ in survivors if s.name in kept.name.split(" + ")]
    dropped = tuple(n for n in names if n not in held)
    gone = f" and {', '.join(dropped)} were dropped" if dropped else ", nothing was dropped"
    note = f"{lead}; re-measured alone, {', '.join(held)} held{gone}"
    return Confirmation(
        state="dropped",
        comparison=measured.comparison,
        dropped=dropped,
        note=note,
        rows=_pair_rows(kept.name, measured.comparison),
    ), kept


def _changes(before: TurboConfig, after: TurboConfig) -> dict[str, Any]:
    """``section__field`` -> value for every field ``after`` changed relative to ``before``."""
    changes = {}
    for name in sections():  # the core ones and those techniques declare
        old, new = before.section(name), after.section(name)
        for f in dataclasses.fields(new):
            if getattr(old, f.name) != getattr(new, f.name):
                changes[f"{name}__{f.name}"] = getattr(new, f.name)
    return changes


def _start(
    run: Run,
    name: str,
    changes: dict[str, Any],
    baseline: Incumbent,
) -> Incumbent:
    """A warmed-up trial of the baseline config with ``changes``, on the batches they plan."""
    config = baseline.config.replace(**changes)
    trial, _ = start_trial(run.recipe, config, run.batches(config), run.clock)
    for _ in range(WARM_STEPS):
        trial.step()
    return Incumbent(name, config, trial, None)
