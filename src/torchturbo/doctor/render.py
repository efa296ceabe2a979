"""Print a Diagnosis in the terminal: the checklist grouped as in the article, then the profile
it was judged from (step breakdown, top operators, memory, verdict, trace)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from torchturbo.doctor.diagnosis import CHECKLIST, Diagnosis
from torchturbo.measure.device_busy import regime_words
from torchturbo.measure.footprint import describe
from torchturbo.output.tables import format_bytes

#: The narrowest terminal that gets the estimated gain as a column of its own: in 80 columns a
#: fourth column leaves each a dozen characters and cuts intervals short ("(1.25-…").
WIDE = 100

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
    console.print(_items_table(diagnosis, console.width))
    console.print(_breakdown_table(diagnosis))
    console.print(_operators_table(diagnosis))
    console.print(
        f"[bold]peak memory[/] {format_bytes(diagnosis.peak_memory_bytes)} "
        f"({diagnosis.peak_memory_kind})"
    )
    if diagnosis.memory_estimate is not None:
        for line in describe(diagnosis.memory_estimate):
            console.print(Text(line))
    elif diagnosis.memory_estimate_note:
        console.print(Text(diagnosis.memory_estimate_note))
    share = diagnosis.breakdown["input_wait"] / diagnosis.step_seconds
    console.print(
        f"[bold]verdict[/] {diagnosis.bound}: input wait is {share:.0%} of a "
        f"{diagnosis.step_seconds * 1e3:.1f} ms step"
    )
    if diagnosis.device_busy is not None:
        console.print(
            Text.assemble(
                ("device ", "bold"), regime_words(diagnosis.device_busy, diagnosis.step_seconds)
            )
        )
    recommended = [i.name for i in diagnosis.items if i.state == "recommended"]
    if recommended:
        console.print(f"[bold]recommended[/] {', '.join(recommended)}")
    _print_levers(diagnosis, console)
    if diagnosis.trace_path is not None:  # a path to copy: never wrapped
        console.print(
            f"[bold]trace[/] {diagnosis.trace_path} (open in https://ui.perfetto.dev or "
            "chrome://tracing)",
            soft_wrap=True,
        )


def _print_levers(diagnosis: Diagnosis, console: Console) -> None:
    """The levers by their one figure: measured here where the doctor timed them, else
    expected (``doctor.levers``)."""
    useful = [lever for lever in diagnosis.levers if lever.expected_gain is not None]
    if useful:
        console.print(
            "[bold]levers by gain[/], measured here where timed, else expected from the facts "
            "(torchturbo tune measures the expected ones, most promising first):"
        )
    # A grid, so that a lever's text wraps under itself rather than under its number.
    levers = Table.grid(padding=(0, 1))
    levers.add_column(justify="right", no_wrap=True)
    levers.add_column(overflow="fold")
    for rank, lever in enumerate(useful, 1):
        figure = f"{lever.expected_gain:.2f}x" if lever.measured else f"~{lever.expected_gain:.2f}x"
        text = f"{lever.name} {figure}: {lever.evidence}"
        levers.add_row(f"  {rank}.", Text(text))
    for lever in diagnosis.levers:
        if lever.expected_gain is None:
            text = f"cannot help here: {lever.name}: {lever.evidence}"
            levers.add_row(Text("  -", style="dim"), Text(text, style="dim"))
    console.print(levers)


def _items_table(diagnosis: Diagnosis, width: int) -> Table:
    """One section per group, headed by its name, so the evidence gets the width. Below
    :data:`WIDE` columns the estimated gain goes under the evidence instead of beside it."""
    wide = width >= WIDE
    table = Table(
        title=(
            f"torchturbo doctor: {diagnosis.workload} on {diagnosis.device} "
            f"({diagnosis.elapsed_s:.1f} s)"
        ),
        expand=True,
    )
    table.add_column("item", max_width=18)
    table.add_column("state", no_wrap=True)
    table.add_column("evidence", ratio=3, overflow="fold")
    if wide:
        table.add_column("estimated gain", ratio=1, overflow="fold")
    for group, names in CHECKLIST.items():
        table.add_row(f"[bold]{group}[/]")
        items = [i for i in diagnosis.items if i.group == group]
        for index, item in enumerate(items):
            evidence = Text(item.evidence)
            cells: list[str | Text] = [item.name, f"[{_STATE_STYLES[item.state]}]{item.state}[/]"]
            if wide:
                cells += [evidence, Text(item.estimated_gain or "")]
            else:
                if item.estimated_gain:
                    evidence.append(f"\nestimated gain: {item.estimated_gain}", style="bold")
                cells.append(evidence)
            table.add_row(*cells, end_section=index == len(names) - 1)
    return table


def _breakdown_table(diagnosis: Diagnosis) -> Table:
    title = "step breakdown (no profiler attached)"
    table = Table(title=title, min_width=len(title) + 4)
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
