"""Print a Diagnosis in the terminal: the checklist grouped as in the article, then the profile
it was judged from (step breakdown, top operators, memory, verdict, trace)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from torchturbo.doctor.diagnosis import CHECKLIST, Diagnosis
from torchturbo.report import format_bytes

_STATE_STYLES = {
    "recommended": "bold yellow",
    "within noise": "yellow",
    "applied": "green",
    "ok": "green",
    "not applicable": "dim",
}


def render(diagnosis: Diagnosis, console: Console | None = None) -> None:
    """Print the checklist table, the breakdown, top operators, memory, verdict and trace path."""
    console = console or Console()
    console.print(_items_table(diagnosis))
    console.print(_breakdown_table(diagnosis))
    console.print(_operators_table(diagnosis))
    console.print(
        f"[bold]peak memory[/] {format_bytes(diagnosis.peak_memory_bytes)} "
        f"({diagnosis.peak_memory_kind})"
    )
    share = diagnosis.breakdown["input_wait"] / diagnosis.step_seconds
    console.print(
        f"[bold]verdict[/] {diagnosis.bound}: input wait is {share:.0%} of a "
        f"{diagnosis.step_seconds * 1e3:.1f} ms step"
    )
    recommended = [i.name for i in diagnosis.items if i.state == "recommended"]
    if recommended:
        console.print(f"[bold]recommended[/] {', '.join(recommended)}")
    _print_levers(diagnosis, console)
    if diagnosis.trace_path is not None:
        console.print(
            f"[bold]trace[/] {diagnosis.trace_path} (open in https://ui.perfetto.dev or "
            "chrome://tracing)"
        )


def _print_levers(diagnosis: Diagnosis, console: Console) -> None:
    """The levers by expected gain: the order torchturbo tune measures them in, cost permitting."""
    useful = [lever for lever in diagnosis.levers if lever.expected_gain is not None]
    if useful:
        console.print("[bold]levers by expected gain[/] (torchturbo tune measures them first):")
    for rank, lever in enumerate(useful, 1):
        console.print(Text(f"  {rank}. {lever.name} ~{lever.expected_gain:.2f}x: {lever.evidence}"))
    for lever in diagnosis.levers:
        if lever.expected_gain is None:
            console.print(Text(f"  cannot help here: {lever.name}: {lever.evidence}"), style="dim")


def _items_table(diagnosis: Diagnosis) -> Table:
    """One section per group, headed by its name, so the evidence gets the width."""
    table = Table(
        title=(
            f"torchturbo doctor: {diagnosis.workload} on {diagnosis.device} "
            f"({diagnosis.elapsed_s:.1f} s)"
        ),
        expand=True,
    )
    table.add_column("item", max_width=18)
    table.add_column("state", no_wrap=True)
    table.add_column("evidence", ratio=3)
    table.add_column("estimated gain", ratio=1)
    for group, names in CHECKLIST.items():
        table.add_row(f"[bold]{group}[/]")
        items = [i for i in diagnosis.items if i.group == group]
        for index, item in enumerate(items):
            table.add_row(
                item.name,
                f"[{_STATE_STYLES[item.state]}]{item.state}[/]",
                item.evidence,
                item.estimated_gain or "",
                end_section=index == len(names) - 1,
            )
    return table


def _breakdown_table(diagnosis: Diagnosis) -> Table:
    table = Table(title="step breakdown (no profiler attached)")
    table.add_column("phase")
    table.add_column("ms / step", justify="right")
    table.add_column("share", justify="right")
    total = diagnosis.step_seconds
    for phase, seconds in diagnosis.breakdown.items():
        share = seconds / total if total else 0.0
        table.add_row(phase, f"{seconds * 1e3:.2f}", f"{share:.0%}")
    table.add_row("step", f"{total * 1e3:.2f}", "100%", style="bold")
    return table


def _operators_table(diagnosis: Diagnosis) -> Table:
    table = Table(title="top operators by self time (torch.profiler)")
    table.add_column("operator")
    table.add_column("ms / step", justify="right")
    table.add_column("share", justify="right")
    for name, ms, share in diagnosis.top_operators:
        table.add_row(name, f"{ms:.2f}", f"{share:.0%}")
    return table
