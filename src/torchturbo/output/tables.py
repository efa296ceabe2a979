"""Terminal tables for measured rows (rich), and the number formats every report shares."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from torchturbo.output.table_fit import print_table


def format_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


#: Marks an MFU above 100%, which only an under-measured peak can produce; explained once below
#: a table by :data:`OVER_PEAK_NOTE`.
OVER_PEAK_MARK = "*"
OVER_PEAK_NOTE = (
    f"{OVER_PEAK_MARK} MFU above 100%: the peak was under-measured (measured while the machine "
    "was busy, or a FLOP count above the maths done)"
)


def format_mfu(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.1f}%" + (OVER_PEAK_MARK if value > 1 else "")


def peak_notes(rows: Sequence[Any]) -> list[str]:
    """One line per distinct peak that the rows' MFU is stated against, naming its rows, plus
    the note for an MFU above 100% when a row has one."""
    variants_by_peak: dict[tuple[str, bool], list[str]] = {}
    for row in rows:
        if row.mfu_peak:
            key = (row.mfu_peak, row.mfu_peak_flops is not None)
            variants_by_peak.setdefault(key, []).append(row.variant)
    lines = [
        f"MFU of {', '.join(variants)}: {'against' if known else 'n/a,'} {peak}"
        for (peak, known), variants in variants_by_peak.items()
    ]
    if any(row.mfu is not None and row.mfu > 1 for row in rows):
        lines.append(OVER_PEAK_NOTE)
    return lines


def rows_table(title: str, rows: Sequence[Any]) -> Table:
    """One row per variant: ratio first, because that is the number that holds across runs."""
    table = Table(title=title)
    communicates = any(r.comm_bytes_per_step is not None for r in rows)
    # The unit goes into the header when every row shares it, so the column stays narrow.
    units = {r.unit for r in rows}
    shared_unit = units.pop() if len(units) == 1 else None
    headers = [
        "variant",
        "ratio",
        shared_unit or "throughput",
        "step ms\n± IQR",
        "MFU",
        "step memory",
        "activations",
        "loss\nfirst → last",
        "first step s",
    ]
    padded = any(r.padding is not None for r in rows)
    if padded:
        headers.append("padding")
    if communicates:
        headers += ["comm per step", "comm ms per step"]
    for header in headers:
        table.add_column(header, justify="left" if header == "variant" else "right")
    for r in rows:
        cells = [
            r.variant,
            f"{r.ratio:.2f}x",
            f"{r.throughput:,.0f}" + ("" if shared_unit else f" {r.unit}"),
            f"{r.step_ms_median:.1f} ± {100 * r.step_ms_spread:.0f}%",
            format_mfu(r.mfu),
            format_bytes(r.peak_memory_bytes),
            format_bytes(r.activation_bytes),
            f"{r.loss_first:.3f} → {r.loss_last:.3f}",
            f"{r.first_step_s:.2f}",
        ]
        if padded:
            cells.append("n/a" if r.padding is None else f"{100 * r.padding:.0f}%")
        if communicates:
            ms = r.comm_ms_per_step
            cells += [format_bytes(r.comm_bytes_per_step), "n/a" if ms is None else f"{ms:.1f}"]
        # Text cells: a variant named after a file like "ddp[1].toml" is not rich markup.
        table.add_row(*(Text(cell) for cell in cells))
    return table


def print_rows(title: str, rows: Sequence[Any], console: Console | None = None) -> None:
    """The table, in parts that fit the console's width (80 columns when piped), then notes."""
    console = console or Console()
    print_table(console, rows_table(title, rows))
    variants_by_note: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        for note in row.notes.items():
            variants_by_note.setdefault(note, []).append(row.variant)
    for (technique, reason), variants in variants_by_note.items():
        who = "every variant" if len(variants) == len(rows) > 1 else ", ".join(variants)
        console.print(
            Text(f"{who}: {technique} not applied: {reason}", style="dim"), soft_wrap=True
        )
    for line in peak_notes(rows):
        console.print(Text(line, style="dim"), soft_wrap=True)
    kinds = sorted({row.peak_memory_kind for row in rows})
    console.print(
        Text(f"step memory: {'; '.join(kinds)} (docs/measurement.md)", style="dim"), soft_wrap=True
    )
