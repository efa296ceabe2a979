"""The report's sentences: the headline, the confirmation, the system, the budgets, the loader.

Each is one line of plain text built from the results, shared by the terminal table (whose
caption is the headline) and the markdown and HTML reports.
"""

from __future__ import annotations

from torchturbo.tune.fields import (
    BASELINE_LABEL,
    fmt_bytes,
    fmt_float,
    fmt_int,
    fmt_pct,
    fmt_rate,
    fmt_x,
    num,
    ratio,
)


def headline(results: dict) -> str:
    """The one number a user came for, with its unit; says plainly when it is not confirmed."""
    unit = str(results.get("unit") or "throughput")
    confirmed = num(results.get("confirmed_ratio"))
    if confirmed is None:
        best = num(results.get("best_throughput"))
        searched = fmt_x(ratio(best, num(results.get("baseline_throughput"))))
        return f"Not confirmed: the search measured {searched} over {BASELINE_LABEL}, {unit}"
    if not results.get("adopted"):
        return (
            f"Nothing beat {BASELINE_LABEL}: keep the defaults "
            f"(confirmation measured {confirmed:.2f}x, {unit})"
        )
    return f"Confirmed {confirmed:.2f}x over {BASELINE_LABEL}, {unit}"


def confirmation_line(results: dict) -> str:
    unit = str(results.get("unit") or "throughput")
    search = (
        f"Search: {fmt_rate(results.get('baseline_throughput'))} → "
        f"{fmt_rate(results.get('best_throughput'))} {unit}."
    )
    c = results.get("confirmation")
    if not isinstance(c, dict):
        return search
    return (
        f"Final confirmation run, baseline and chosen interleaved: "
        f"{fmt_float(c.get('baseline_step_ms'), 1)} ms → {fmt_float(c.get('best_step_ms'), 1)} "
        f"ms per step (noise {fmt_pct(c.get('noise'))}, {fmt_int(c.get('repeats'))} repeats). "
        + search
    )


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
    return (
        f"Recipe {results.get('recipe', 'n/a')} on {results.get('device', 'n/a')}"
        f"{_processes(results)}. "
        f"The search took {fmt_float(results.get('elapsed_s'), 0)} s of a "
        f"{fmt_float(results.get('time_budget_s'), 0)} s budget; memory budget: "
        f"{'none' if memory_budget is None else fmt_bytes(memory_budget)}; planned run: "
        f"{fmt_int(results.get('planned_steps'))} steps (one-time costs such as compilation are "
        f"weighed against it); loss tolerance: {fmt_pct(results.get('loss_tolerance'))}."
    )


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
    verdict = f"Verdict: {loader.get('verdict', 'n/a')}" + (f", {reason}" if reason else "")
    return f"{verdict}. Chosen settings: {settings or 'none'}."
