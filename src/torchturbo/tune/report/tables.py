"""The report's tables as rows of strings: incremental, per stage and per candidate.

Rows are plain strings so that one source feeds the terminal table (rich), the markdown and the
HTML, and the three never disagree. Header templates hold ``{unit}`` for the results' throughput
unit; :func:`header_row` fills it in.
"""

from __future__ import annotations

from collections.abc import Iterable

from torchturbo.tune.report.fields import (
    BASELINE_LABEL,
    adopted_rows,
    adoption_label,
    baseline_candidate,
    dropped,
    fmt_bytes,
    fmt_float,
    fmt_int,
    fmt_interval,
    fmt_parity,
    fmt_rate,
    num,
    replaced_by,
    replacements,
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


def incremental_figures(results: dict) -> list[dict]:
    """The incremental table's rows as figures: ``label`` (a replacement says what it
    replaced), ``stage``, ``throughput``, the comparison with the row above (``ratio``,
    ``ratio_low``, ``ratio_high``), ``step_ms``, and from the search's measurement of the row's
    adoption ``memory_bytes``, ``one_time_s``, ``break_even_steps``; ``replaced_by`` names the
    later adoption that replaced the row's. The table, the throughput plot and the tests read
    these, so that they show one figure for each config.

    Every figure but the last three comes from the confirmation, which timed all these configs
    in the same rounds: a row's throughput over the row above's is its ratio, and the last row
    over the first is the confirmed ratio under the table. Without a confirmation (nothing was
    adopted) the baseline's own measurement is the only row.
    """
    confirmation = results.get("confirmation")
    chained = confirmation.get("rows") if isinstance(confirmation, dict) else None
    base = baseline_candidate(results)
    if not chained:
        return [
            {
                "label": f"baseline ({BASELINE_LABEL})",
                "stage": "",
                "throughput": results.get("baseline_throughput"),
                "step_ms": base.get("step_ms"),
                "memory_bytes": base.get("memory_bytes"),
                "one_time_s": base.get("one_time_s"),
            }
        ]
    adopted = {str(c.get("name")): c for c in adopted_rows(results)}
    replaced, successors = replacements(results), replaced_by(results)
    figures: list[dict] = []
    for i, row in enumerate(chained):
        name = str(row.get("name") or "")
        names = _adoption_names(name.removeprefix("+ "), adopted)
        search = adopted.get(names[-1], base if i == 0 else {})
        if i and name.startswith("+ "):
            name = "+ " + " + ".join(adoption_label(n, results, replaced) for n in names)
        figures.append(
            {
                **{k: row.get(k) for k in ("ratio", "ratio_low", "ratio_high") if i},
                "label": name,
                "stage": str(row.get("stage") or ""),
                "throughput": row.get("throughput"),
                "step_ms": row.get("step_ms"),
                "memory_bytes": search.get("memory_bytes"),
                "one_time_s": search.get("one_time_s") if i else None,
                "break_even_steps": search.get("break_even_steps") if i else None,
                "replaced_by": next((successors[n] for n in names if n in successors), None),
            }
        )
    return figures


def _adoption_names(joined: str, adopted: Iterable[str]) -> list[str]:
    """The adoptions a confirmation row names, joined by " + ": read against the adopted names
    themselves, longest first, since a memory plan's name has " + " inside it ("plan: ckpt
    layers.0 + micro-batch 2 x4 + bf16 optimizer state"); a part no adoption matches is one."""
    known = sorted(adopted, key=len, reverse=True)
    names: list[str] = []
    while joined:
        found = next((n for n in known if joined == n or joined.startswith(n + " + ")), None)
        part = found if found is not None else joined.split(" + ", 1)[0]
        names.append(part)
        joined = joined[len(part) :].removeprefix(" + ")
    return names or [""]


def incremental_rows(results: dict) -> list[tuple[str, ...]]:
    """The baseline, then each adoption the confirmation kept, in the order it was adopted
    (:func:`incremental_figures`, formatted)."""
    rows: list[tuple[str, ...]] = []
    for i, row in enumerate(incremental_figures(results)):
        rows.append(
            (
                row["label"],
                row["stage"],
                fmt_rate(row["throughput"]),
                fmt_interval(row) if i else "",
                fmt_float(row["step_ms"], 1),
                fmt_bytes(row["memory_bytes"]),
                fmt_float(row["one_time_s"], 1) if i or row["one_time_s"] is not None else "",
                fmt_int(row.get("break_even_steps")) if i else "",
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
    gone, successors = dropped(results), replaced_by(results)
    unit = str(results.get("unit") or "")
    rows: list[tuple[str, ...]] = []
    for c in results.get("candidates") or []:
        if c.get("stage") == "baseline":
            continue
        verdict = str(c.get("verdict") or "")
        reason = str(c.get("reason") or "")
        if c.get("name") in gone:
            reason += "; dropped: the confirmation did not reproduce it"
        if c.get("name") in successors and verdict == "adopted":
            reason += f"; replaced by {successors[str(c.get('name'))]} (turbo.toml holds that)"
        if c.get("reused"):
            reason += _reused(c, unit)
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


def _reused(candidate: dict, unit: str) -> str:
    """Where a reused candidate's figures come from: its ratio and throughput were measured in
    the previous run, against that run's reference, not this run's baseline."""
    reference = candidate.get("reference_throughput")
    if num(reference) is None:
        return " (reused from the previous run)"
    against = candidate.get("against") or "its reference"
    return (
        f" (reused from the previous run: measured there at {fmt_rate(candidate.get('throughput'))}"
        f" against {fmt_rate(reference)} {unit} of {against}, not this run's baseline)"
    )


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
