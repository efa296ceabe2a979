"""The report's tables as rows of strings: incremental, per stage and per candidate.

Rows are plain strings so that one source feeds the terminal table (rich), the markdown and the
HTML, and the three never disagree. Header templates hold ``{unit}`` for the results' throughput
unit; :func:`header_row` fills it in.
"""

from __future__ import annotations

from torchturbo.tune.fields import (
    BASELINE_LABEL,
    adopted_rows,
    baseline_candidate,
    dropped,
    fmt_bytes,
    fmt_float,
    fmt_int,
    fmt_interval,
    fmt_parity,
    fmt_rate,
)

INCREMENTAL_HEADERS = (
    "configuration",
    "stage",
    "{unit}",
    "vs previous row",
    "step ms",
    "peak memory",
    "one-time s",
    "break-even steps",
)


def incremental_rows(results: dict) -> list[tuple[str, ...]]:
    """The baseline, then each adoption the confirmation kept, in the order it was adopted.

    Every figure on a row comes from the confirmation, which timed all these configs in the
    same rounds: a row's throughput over the row above's is its ratio, and the last row over
    the first is the confirmed ratio under the table. Peak memory, one-time cost and break-even
    are the row's adoption's (the search measured them). Without a confirmation (nothing was
    adopted) the baseline's own measurement is the only row.
    """
    confirmation = results.get("confirmation")
    chained = confirmation.get("rows") if isinstance(confirmation, dict) else None
    base = baseline_candidate(results)
    if not chained:
        return [
            (
                f"baseline ({BASELINE_LABEL})",
                "",
                fmt_rate(results.get("baseline_throughput")),
                "",
                fmt_float(base.get("step_ms"), 1),
                fmt_bytes(base.get("memory_bytes")),
                fmt_float(base.get("one_time_s"), 1),
                "",
            )
        ]
    adopted = {str(c.get("name")): c for c in adopted_rows(results)}
    rows: list[tuple[str, ...]] = []
    for i, row in enumerate(chained):
        names = str(row.get("name") or "").removeprefix("+ ").split(" + ")
        search = adopted.get(names[-1], base if i == 0 else {})
        rows.append(
            (
                str(row.get("name") or ""),
                str(row.get("stage") or ""),
                fmt_rate(row.get("throughput")),
                fmt_interval(row) if i else "",
                fmt_float(row.get("step_ms"), 1),
                fmt_bytes(search.get("memory_bytes")),
                fmt_float(search.get("one_time_s"), 1) if i else "",
                fmt_int(search.get("break_even_steps")) if i else "",
            )
        )
    return rows


CANDIDATE_HEADERS = (
    "stage",
    "candidate",
    "verdict",
    "measured against",
    "ratio (interval)",
    "rounds",
    "{unit}",
    "step ms",
    "peak memory",
    "one-time s",
    "break-even steps",
    "loss vs reference",
    "reason",
)


def candidate_rows(results: dict) -> list[tuple[str, ...]]:
    """Every candidate in the article's stage order, with the one measurement that decided it."""
    gone = dropped(results)
    rows: list[tuple[str, ...]] = []
    for c in results.get("candidates") or []:
        if c.get("stage") == "baseline":
            continue
        verdict = str(c.get("verdict") or "")
        reason = str(c.get("reason") or "")
        if c.get("name") in gone:
            reason += "; dropped: the confirmation did not reproduce it"
        if c.get("reused"):
            reason += " (reused from the previous run)"
        rows.append(
            (
                str(c.get("stage") or ""),
                str(c.get("name") or ""),
                verdict,
                str(c.get("against") or ""),
                fmt_interval(c),
                fmt_int(c.get("rounds")) if c.get("rounds") else "",
                fmt_rate(c.get("throughput")),
                fmt_float(c.get("step_ms"), 1),
                fmt_bytes(c.get("memory_bytes")),
                fmt_float(c.get("one_time_s"), 2),
                fmt_int(c.get("break_even_steps")),
                fmt_parity(c.get("parity")),
                reason,
            )
        )
    return rows


def header_row(template: tuple[str, ...], results: dict) -> tuple[str, ...]:
    unit = str(results.get("unit") or "throughput")
    return tuple(h.format(unit=unit) for h in template)


BATCH_HEADERS = ("micro-batch", "step footprint", "within the budget")


def batch_rows(results: dict) -> list[tuple[str, ...]]:
    """The batch finder's measurements (``--find-batch``), smallest micro-batch first: each
    size's measured step footprint (the largest rank's under torchrun) and whether it fit."""
    batch = results.get("batch")
    probes = batch.get("probes") if isinstance(batch, dict) else None
    if not isinstance(probes, list):
        return []
    return [
        (fmt_int(p.get("size")), fmt_bytes(p.get("bytes")), "yes" if p.get("fits") else "no")
        for p in sorted(probes, key=lambda p: p.get("size") or 0)
        if isinstance(p, dict)
    ]
