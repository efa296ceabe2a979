"""The report's tables as rows of strings: incremental, per stage and per candidate.

Rows are plain strings so that one source feeds the terminal table (rich), the markdown and the
HTML, and the three never disagree. Header templates hold ``{unit}`` for the results' throughput
unit; :func:`header_row` fills it in.
"""

from __future__ import annotations

from torchturbo.tune.fields import (
    BASELINE_LABEL,
    adopted_candidate,
    baseline_candidate,
    fmt_bytes,
    fmt_float,
    fmt_int,
    fmt_parity,
    fmt_pct,
    fmt_rate,
    fmt_x,
    num,
    ratio,
)

INCREMENTAL_HEADERS = (
    "configuration",
    "stage",
    "{unit}",
    "vs baseline",
    "vs previous row",
    "step ms",
    "peak memory",
    "break-even steps",
)


def incremental_rows(results: dict) -> list[tuple[str, ...]]:
    """Baseline, then each adopted technique in order with the cumulative throughput it reached."""
    baseline = num(results.get("baseline_throughput"))
    base_candidate = baseline_candidate(results)
    rows = [
        (
            f"baseline ({BASELINE_LABEL})",
            "",
            fmt_rate(baseline),
            fmt_x(1.0 if baseline else None),
            "",
            fmt_float(base_candidate.get("step_ms"), 1),
            fmt_bytes(base_candidate.get("memory_bytes")),
            "",
        )
    ]
    # A candidate's "ratio" is measured against the best of its time, interleaved in one run, so
    # the ratio to the baseline is the product of the ratios of the rows so far.
    previous = baseline
    cumulative: float | None = 1.0
    for name in results.get("adopted") or []:
        c = adopted_candidate(results, name)
        throughput = num(c.get("throughput"))
        vs_previous = num(c.get("ratio"))
        if vs_previous is None:
            vs_previous = ratio(throughput, previous)
        cumulative = None if cumulative is None or vs_previous is None else cumulative * vs_previous
        rows.append(
            (
                f"+ {name}",
                str(c.get("stage") or ""),
                fmt_rate(throughput),
                fmt_x(cumulative),
                fmt_x(vs_previous),
                fmt_float(c.get("step_ms"), 1),
                fmt_bytes(c.get("memory_bytes")),
                fmt_int(c.get("break_even_steps")),
            )
        )
        previous = throughput
    return rows


CANDIDATE_HEADERS = (
    "stage",
    "candidate",
    "verdict",
    "{unit}",
    "vs best so far",
    "noise",
    "step ms",
    "peak memory",
    "one-time s",
    "break-even steps",
    "loss vs reference",
    "reason",
)


def candidate_rows(results: dict) -> list[tuple[str, ...]]:
    rows = []
    for c in results.get("candidates") or []:
        vs_best = num(c.get("ratio"))  # measured against the best of its time, same run
        rows.append(
            (
                str(c.get("stage") or ""),
                str(c.get("name") or ""),
                str(c.get("verdict") or ""),
                fmt_rate(c.get("throughput")),
                fmt_x(vs_best),
                fmt_pct(c.get("noise")),
                fmt_float(c.get("step_ms"), 1),
                fmt_bytes(c.get("memory_bytes")),
                fmt_float(c.get("one_time_s"), 2),
                fmt_int(c.get("break_even_steps")),
                fmt_parity(c.get("parity")),
                str(c.get("reason") or ""),
            )
        )
    return rows


STAGE_HEADERS = ("stage", "best after it", "{unit}", "vs baseline", "peak memory", "note")


def stage_rows(results: dict) -> list[tuple[str, ...]]:
    baseline = num(results.get("baseline_throughput"))
    adopted = set(results.get("adopted") or [])
    rows = []
    for s in results.get("stages") or []:
        best = s.get("best")
        if s.get("skipped_reason"):
            note = f"skipped: {s['skipped_reason']}"
        else:
            note = "adopted" if best in adopted else "nothing adopted"
        rows.append(
            (
                str(s.get("stage") or ""),
                str(best or "unchanged"),
                fmt_rate(s.get("throughput")),
                fmt_x(ratio(num(s.get("throughput")), baseline)),
                fmt_bytes(s.get("memory_bytes")),
                note,
            )
        )
    return rows


def header_row(template: tuple[str, ...], results: dict) -> tuple[str, ...]:
    unit = str(results.get("unit") or "throughput")
    return tuple(h.format(unit=unit) for h in template)
