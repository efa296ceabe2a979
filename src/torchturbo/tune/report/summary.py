"""The report's sentences: the headline, the confirmation, the system, the budgets, the loader.

Each is one line of plain text built from the results, shared by the terminal table (whose
caption is the headline) and the markdown and HTML reports.
"""

from __future__ import annotations

import math

from torchturbo.tune.report.fields import (
    BASELINE_LABEL,
    fmt_bytes,
    fmt_float,
    fmt_int,
    fmt_interval,
    fmt_pct,
    fmt_rate,
    num,
)
from torchturbo.tune.search.outcome import left_out_for_time


def headline(results: dict) -> str:
    """The one number a user came for, with its unit, and what was left unmeasured."""
    unit = str(results.get("unit") or "throughput")
    confirmation = results.get("confirmation")
    if not isinstance(confirmation, dict):
        confirmation = {}
    state = confirmation.get("state")
    if state == "consistent":
        line = (
            f"Measured {fmt_interval(confirmation)} over {BASELINE_LABEL}, {unit}: "
            "consistent with the search, not decided (a noisy machine)"
        )
    elif state in ("confirmed", "dropped"):
        line = f"Confirmed {fmt_interval(confirmation)} over {BASELINE_LABEL}, {unit}"
        dropped = confirmation.get("dropped") or []
        if state == "dropped":  # re-measured alone: every adoption may have held
            line += f", after dropping {', '.join(dropped)}" if dropped else ", measured again"
    elif state in ("interrupted", "unconfirmed"):
        note = str(confirmation.get("note") or "stopped")
        line = note[0].upper() + note[1:]
    elif state == "reverted":
        line = f"Nothing confirmed: keep {BASELINE_LABEL} ({confirmation.get('note') or ''})"
    elif state == "fits":
        line = (
            f"Fits the memory budget at {fmt_interval(confirmation)} the {unit} of "
            f"{BASELINE_LABEL}, which does not fit ({confirmation.get('note') or ''})"
        )
    else:
        measured = [c for c in _candidates(results) if c.get("ratio") is not None]
        line = (
            f"Measured {len(measured)} candidate{'s' if len(measured) != 1 else ''}: none beat "
            f"{BASELINE_LABEL} beyond the noise, keep the defaults"
            if measured
            else f"Nothing was measured: keep {BASELINE_LABEL}"
        )
    return (
        _job(results)
        + line
        + _not_paying(results)
        + _undecided(results)
        + _unmeasured(results)
        + _budget_note(results)
    )


def _job(results: dict) -> str:
    """'96 steps (the Trainer's ...): fp32 eager ~13 s, tuned ~5.6 s. ': the planned job timed
    both ways, one-time costs included; an assumed horizon says so."""
    job = results.get("job")
    if not isinstance(job, dict) or num(job.get("steps")) is None:
        return ""
    steps = f"{fmt_int(job.get('steps'))} steps"
    source = str(job.get("source") or "")
    if job.get("assumed"):
        source = "assumed, give --planned-steps or the recipe's planned_steps"
    times = f"{BASELINE_LABEL} ~{_seconds(job.get('baseline_s'))}"
    if num(job.get("best_s")) is not None and job.get("best_s") != job.get("baseline_s"):
        times += f", tuned ~{_seconds(job.get('best_s'))}"
    times += _trained(results, job)
    return f"{steps} ({source}): {times}. " if source else f"{steps}: {times}. "


def _trained(results: dict, job: dict) -> str:
    """' (each ~66,751 tokens)': what the job trains each way, the same data by the batch
    plan's rule (an epoch's tokens over its plan's batches where the recipe has lengths:
    ``trials.trial.epoch_tokens_per_step``); two figures when they differ by 0.5% or more."""
    unit = str(results.get("unit") or "").removesuffix("/s")
    baseline, best = num(job.get("baseline_count")), num(job.get("best_count"))
    if baseline is None or not unit:
        return ""
    if best is None or abs(best / baseline - 1) < 0.005:
        return f" (each ~{fmt_int(baseline)} {unit})"
    return f" ({fmt_int(baseline)} and {fmt_int(best)} {unit})"


def _seconds(value: object) -> str:
    v = num(value)
    if v is None:
        return "n/a"
    if v >= 7200:
        return f"{v / 3600:.1f} h"
    if v >= 120:
        return f"{v / 60:.0f} min"
    return f"{v:.2g} s" if v < 10 else f"{v:.0f} s"


def _not_paying(results: dict) -> str:
    """'; compile:default not adopted: 45 s to compile, pays back after 5,911 steps'."""
    parts = []
    for c in _candidates(results):
        if c.get("verdict") != "rejected" or not str(c.get("reason")).startswith("does not pay"):
            continue
        one_time = _seconds(c.get("one_time_s"))
        warm = " with the compile cache" if num(c.get("cold_one_time_s")) is not None else ""
        back = num(c.get("break_even_steps"))
        when = "never pays back" if back is None else f"pays back after {fmt_int(back)} steps"
        parts.append(f"{c.get('name')} not adopted: {one_time} one-time{warm}, {when}")
    return "; " + "; ".join(parts) if parts else ""


def _undecided(results: dict) -> str:
    """'; undecided: bf16 (0.91x after 2 rounds; about 9 rounds would decide it)'."""
    parts = []
    for c in _candidates(results):
        if c.get("verdict") != "undecided":
            continue
        reason = str(c.get("reason") or "").removeprefix("undecided: ")
        parts.append(f"{c.get('name')} ({reason})")
    return "; undecided, not rejected: " + "; ".join(parts) if parts else ""


def _budget_note(results: dict) -> str:
    note = str(results.get("budget_note") or "")
    return f"; said before the search: {note}" if note else ""


def _candidates(results: dict) -> list[dict]:
    return [c for c in results.get("candidates") or [] if c.get("stage") != "baseline"]


def _unmeasured(results: dict) -> str:
    """'; not measured for lack of time: X, Y (a budget of about N min would measure them)';
    then '; not measured, as it cannot pay back on this job: Z' (``candidate._cannot_pay_back``,
    the one other reason a row is not measured)."""
    rows = [c for c in _candidates(results) if c.get("verdict") == "not measured"]
    names = [str(c.get("name")) for c in rows if left_out_for_time(c["verdict"], c.get("reason"))]
    hopeless = [str(c.get("name")) for c in rows if str(c.get("name")) not in names]
    futile = f"; not measured, as it cannot pay back on this job: {', '.join(hopeless)}"
    if not names:
        return futile if hopeless else ""
    # The whole budget was needed for what ran (its last part is held back for the confirmation
    # and the report, so a run can end a little early): the skipped candidates come on top.
    spent = max(num(results.get("elapsed_s")) or 0.0, num(results.get("time_budget_s")) or 0.0)
    needed = spent + (num(results.get("unmeasured_s")) or 0.0)
    minutes = max(1, math.ceil(needed / 60))
    return (
        f"; not measured for lack of time: {', '.join(names)} "
        f"(a budget of about {minutes} min would measure them)" + (futile if hopeless else "")
    )


def incremental_note(results: dict) -> str:
    """What the incremental table's figures are, for the table the results hold: the
    confirmation's chained rounds, a kept config against the baseline alone, or the baseline
    by itself."""
    c = results.get("confirmation")
    state = c.get("state") if isinstance(c, dict) else None
    rows = c.get("rows") if isinstance(c, dict) else None
    search = (
        "Peak memory, one-time cost and break-even are the search's, from the measurement that "
        "adopted the row; the ratio that adopted it is in the table of every candidate below."
    )
    if not rows:
        return "Nothing was adopted: the table is the baseline's own measurement."
    if state in ("confirmed", "consistent"):
        return (
            "The baseline, then each adopted technique in the order it was adopted. Throughput, "
            "ratio and step time come from the confirmation, which timed the baseline and "
            "every adoption in the same paired rounds on the same batches: a row's ratio is its "
            "throughput over the row above's, with its 99.9% interval, and the last row over "
            f"the first is the headline's ratio. {search}"
        )
    if state == "interrupted":
        return (
            "The run was stopped before its confirmation: the baseline, then each adoption in "
            "the order it was adopted, each with the measurement that adopted it (against the "
            f"best of its time, in paired rounds, with its 99.9% interval). {search}"
        )
    if state == "unconfirmed":
        return (
            "No confirmation ran: the baseline, then the one adoption with the measurement that "
            "adopted it (against the baseline, in paired rounds, with its 99.9% interval). "
            f"{search}"
        )
    if state == "fits":
        return (
            "The kept plan's own measurement against what it was measured on, in paired rounds "
            f"on the same batches, with its 99.9% interval: the step fits only with it. {search}"
        )
    return (
        "The baseline and the config that was kept, measured against each other in paired "
        "rounds when the confirmation re-measured the adoptions alone (the note above says "
        f"which held), with the 99.9% interval. {search}"
    )


def confirmation_line(results: dict) -> str:
    c = results.get("confirmation")
    if isinstance(c, dict) and c.get("state") == "fits":
        return f"No confirmation against the baseline needed: {c.get('note')}."
    if isinstance(c, dict) and c.get("state") in ("interrupted", "unconfirmed"):
        return f"No confirmation: {c.get('note')}."
    if not isinstance(c, dict) or c.get("state") in (None, "not needed"):
        return (
            "No confirmation run: nothing was adopted, so the chosen config is the baseline "
            "(1.00x by definition)."
        )
    line = (
        f"Confirmation, baseline and chosen config in paired rounds: "
        f"{fmt_float(c.get('reference_step_ms'), 1)} ms → {fmt_float(c.get('step_ms'), 1)} ms "
        f"per step, {fmt_interval(c)} over {fmt_int(c.get('rounds'))} rounds "
        f"({fmt_rate(c.get('reference_throughput'))} → {fmt_rate(c.get('throughput'))} "
        f"{results.get('unit') or ''})."
    )
    if c.get("note"):
        line += f" {str(c['note'])[0].upper()}{str(c['note'])[1:]}."
    return line


def system_line(results: dict) -> str:
    system = results.get("system")
    if not isinstance(system, dict) or not system:
        system = {k: results.get(k) for k in ("torch", "device") if results.get(k)}
    parts = [f"{k}: {v}" for k, v in system.items()]
    if results.get("date"):
        parts.append(f"run {results['date']}")
    return " · ".join(parts) or "system not recorded"


def budget_line(results: dict) -> str:
    memory_budget = results.get("memory_budget_bytes")
    reuse = (
        f" {results['reuse_note'][0].upper()}{results['reuse_note'][1:]}."
        if results.get("reuse_note")
        else ""
    )
    return (
        f"Recipe {results.get('recipe', 'n/a')} on {results.get('device', 'n/a')}"
        f"{_processes(results)}. "
        f"The search took {fmt_float(results.get('elapsed_s'), 0)} s of a "
        f"{fmt_float(results.get('time_budget_s'), 0)} s budget; memory budget: "
        f"{'none' if memory_budget is None else fmt_bytes(memory_budget)}; planned run: "
        f"{fmt_int(results.get('planned_steps'))} steps, {_source(results)} (a candidate is kept "
        "only if the whole job, one-time costs such as compilation included, is faster); "
        f"loss tolerance: {fmt_pct(results.get('loss_tolerance'))}." + reuse
    )


def _source(results: dict) -> str:
    source = str(results.get("planned_steps_source") or "source not recorded")
    return f"assumed ({source})" if results.get("planned_steps_assumed") else f"from {source}"


def _processes(results: dict) -> str:
    count = results.get("processes") or 1
    return f", {count} processes under torchrun (rank 0's measurements)" if count > 1 else ""


def loader_line(results: dict) -> str:
    loader = results.get("loader")
    if not isinstance(loader, dict):
        return "The input pipeline was not measured."
    chosen = loader.get("chosen")
    settings = ", ".join(f"{k}={v}" for k, v in chosen.items()) if isinstance(chosen, dict) else ""
    reason = str(loader.get("reason") or "").strip().rstrip(".")
    said = str(loader.get("verdict", "n/a"))
    # The reason may open with the verdict itself ("compute-bound: ..."): said once.
    reason = reason.removeprefix(said).lstrip(":,; ") if reason.startswith(said) else reason
    verdict = f"Verdict: {said}" + (f", {reason}" if reason else "")
    return f"{verdict}. Chosen settings: {settings or 'none'}."


def batch_line(results: dict) -> str:
    """The batch finder's choice in one line ("" without --find-batch)."""
    batch = results.get("batch")
    return str(batch.get("summary") or "") if isinstance(batch, dict) else ""


def batch_notes(results: dict) -> list[str]:
    """What the batch finder kept and changed, one sentence each."""
    batch = results.get("batch")
    notes = batch.get("notes") if isinstance(batch, dict) else None
    return [str(note) for note in notes] if isinstance(notes, list) else []
