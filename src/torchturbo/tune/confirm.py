"""The confirmation: the chosen config against the baseline, measured again, and what to do when
it does not hold.

Each adoption was measured against the best of its time; chaining them assumes the gains
multiply, and each verdict had its own (small) chance of being noise. So the chosen config is
timed against the fp32 baseline once more. If it is not faster beyond the noise, every adoption
is re-measured alone against the baseline, those that are not faster are dropped, the survivors
are combined and confirmed (or, failing that, the single best survivor is kept), and the report
says so. When nothing survives, or the budget runs out first, the baseline is kept: the written
turbo.toml is never one that measured no faster than the defaults.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torchturbo.bench import Trial, start_trial
from torchturbo.config import TurboConfig
from torchturbo.distributed.consensus import agree
from torchturbo.tune import batching
from torchturbo.tune.budget import CONFIRM_ROUNDS
from torchturbo.tune.compare import Measured, compare
from torchturbo.tune.decide import MIN_ROUNDS, describe, estimate
from torchturbo.tune.outcome import Confirmation
from torchturbo.tune.state import NUM_BATCHES, REPORT_S, WARM_STEPS, Incumbent, Run

BASELINE = "fp32 eager"


def confirm(run: Run, baseline: Incumbent, best: Incumbent) -> tuple[Confirmation, Incumbent]:
    """The confirmation and the config to keep (``best``, a reduced one, or the baseline)."""
    if best is baseline or not run.adoptions:
        return Confirmation(state="not needed", comparison=None), baseline
    alone = _against_baseline(run, baseline, best.trial)
    measured = _pooled(run, alone)
    speed = measured.comparison.speed
    pooled = speed.rounds - alone.comparison.speed.rounds
    if speed.decision == "faster":
        note = f"pooled with the search's {pooled} rounds of the same comparison" if pooled else ""
        return Confirmation(state="confirmed", comparison=measured.comparison, note=note), best
    searched = math.prod(
        a.outcome.comparison.speed.ratio
        for a in run.adoptions
        if a.outcome is not None and a.outcome.comparison is not None
    )
    if speed.plausible_high >= max(searched, 1.0):
        note = (
            f"the search measured {searched:.2f}x; the confirmation does not contradict it but "
            f"could not decide it in {speed.rounds} rounds on this machine: rerun when it is "
            "quieter, or with a larger budget, to confirm"
        )
        return Confirmation(state="consistent", comparison=measured.comparison, note=note), best
    best.trial.close()
    return _drop(run, baseline, measured)


def _pooled(run: Run, measured: Measured) -> Measured:
    """With one adoption, measured against the baseline itself, the confirmation times the same
    two configs on the same batches again: its rounds and the search's are one sample, and
    deciding on all of them beats deciding on the confirmation's few alone."""
    adoption = run.adoptions[0].outcome if len(run.adoptions) == 1 else None
    search = adoption.comparison if adoption is not None else None
    if search is None or search.against != BASELINE or not search.ratios:
        return measured
    ratios = search.ratios + measured.comparison.ratios
    speed = estimate(list(ratios), final=True)
    return dataclasses.replace(
        measured,
        comparison=dataclasses.replace(measured.comparison, speed=speed, ratios=ratios),
    )


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
        alone = _start(run, adoption.name, changes[adoption.name], [_batching(adoption)], baseline)
        measured = _against_baseline(run, baseline, alone.trial)
        if measured.comparison.speed.decision == "faster":
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
                state="reverted", comparison=failed.comparison, dropped=tuple(names), note=note
            ),
            baseline,
        )
    kept, measured = max(survivors, key=lambda s: s[1].comparison.speed.ratio)
    if len(survivors) > 1 and agree(run.budget.left() > REPORT_S):
        together = _start(
            run,
            " + ".join(s.name for s, _ in survivors),
            {k: v for s, _ in survivors for k, v in changes[s.name].items()},
            [_batching(s) for s, _ in survivors],
            baseline,
        )
        combined = _against_baseline(run, baseline, together.trial)
        if combined.comparison.speed.decision == "faster":
            kept, measured = together, combined
        else:
            together.trial.close()
    for other, _ in survivors:
        if other is not kept:
            other.trial.close()
    held = [s.name for s, _ in survivors if s.name in kept.name.split(" + ")]
    dropped = tuple(n for n in names if n not in held)
    note = (
        f"{lead}; re-measured alone, {', '.join(held)} held and {', '.join(dropped)} were dropped"
    )
    return Confirmation(
        state="dropped", comparison=measured.comparison, dropped=dropped, note=note
    ), kept


def _batching(adoption: Incumbent) -> str | None:
    return adoption.outcome.batching if adoption.outcome is not None else None


def _changes(before: TurboConfig, after: TurboConfig) -> dict[str, Any]:
    """``section__field`` -> value for every field ``after`` changed relative to ``before``."""
    changes = {}
    for section in dataclasses.fields(TurboConfig):
        old, new = getattr(before, section.name), getattr(after, section.name)
        if not dataclasses.is_dataclass(new):
            continue
        for f in dataclasses.fields(new):
            if getattr(old, f.name) != getattr(new, f.name):
                changes[f"{section.name}__{f.name}"] = getattr(new, f.name)
    return changes


def _start(
    run: Run,
    name: str,
    changes: dict[str, Any],
    batchings: list[str | None],
    baseline: Incumbent,
) -> Incumbent:
    """A warmed-up trial of the baseline config with ``changes``, on the batches they need."""
    config = baseline.config.replace(**changes)
    batches = batching.batches_for(run.recipe, batchings, baseline.trial.batches, NUM_BATCHES)
    trial, _ = start_trial(run.recipe, config, batches, run.clock)
    for _ in range(WARM_STEPS):
        trial.step()
    return Incumbent(name, config, trial, None)
