"""Final tables at 80 columns: split into parts that repeat the label column, nothing cut."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table
from test_tune_report import full_results

from torchturbo.output.table_fit import fit_table, print_table
from torchturbo.output.tables import print_rows, rows_table
from torchturbo.trials.variants import VariantResult
from torchturbo.tune.report.write import incremental_table


def _printed(table: Table, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), record=True)
    print_table(console, table)
    return console.export_text()


def _cells(table: Table) -> list[str]:
    return [str(c) for column in table.columns for c in [column.header, *column.cells]]


def _variant(name: str, ratio: float, comm: int | None = None) -> VariantResult:
    return VariantResult(
        variant=name,
        throughput=1234.5 * ratio,
        unit="samples/s",
        ratio=ratio,
        step_ms_median=177.7 / ratio,
        step_ms_spread=0.03,
        mfu=0.123,
        peak_memory_bytes=520 * 2**20,
        peak_memory_kind="CPU resident-set high-water mark",
        activation_bytes=81 * 2**20,
        loss_first=2.303,
        loss_last=0.512,
        first_step_s=12.34,
        notes={},
        comm_bytes_per_step=comm,
        comm_ms_per_step=None if comm is None else 3.2,
    )


def test_the_tune_table_at_80_columns_keeps_every_header_and_number_whole() -> None:
    table = incremental_table(full_results())
    text = _printed(table, 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    for word in " ".join(_cells(table)).split():
        assert word in text
    # Two parts, each led by the configuration column.
    assert text.count("configuration") == 2 and text.count("+ channels_last") == 2


def test_negative_control_rich_alone_cuts_the_same_table() -> None:
    console = Console(width=80, file=io.StringIO(), record=True)
    console.print(incremental_table(full_results()))
    assert "…" in console.export_text()


def test_a_wide_terminal_gets_one_table() -> None:
    parts = fit_table(incremental_table(full_results()), 200)
    assert len(parts) == 1 and len(parts[0].columns) == 8


def test_parts_keep_the_order_title_and_caption() -> None:
    table = incremental_table(full_results())
    parts = fit_table(table, 80)
    headers = [str(c.header) for part in parts for c in part.columns[1:]]
    assert headers == [str(c.header) for c in table.columns[1:]]
    assert parts[0].title == table.title and parts[-1].caption == table.caption
    assert all(p.title is None for p in parts[1:]) and parts[0].caption is None


def test_the_bench_table_at_80_columns_when_piped() -> None:
    rows = [_variant("baseline", 1.0, comm=2**20), _variant("ddp[fp16].toml", 1.8, comm=2**19)]
    out = io.StringIO()
    print_rows("torchturbo bench: vision", rows, console=Console(file=out, width=80))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80 and "…" not in text
    assert "ddp[fp16].toml" in text  # a name is not markup
    for word in " ".join(_cells(rows_table("t", rows))).split():
        assert word in text


def test_a_piped_console_is_80_columns_wide(monkeypatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    assert Console(file=io.StringIO()).width == 80


def test_a_long_label_wraps_and_the_numbers_beside_it_stay_whole() -> None:
    """A memory plan's label is most of 80 columns: it wraps within half the width, and each
    part still holds numbers (not one column per part, its numbers folded over two lines)."""
    label = "+ plan: ckpt 5 blocks (transformer.h.0..transformer.h.5) + micro-batch 2 x2"
    table = Table(title="tune")
    for header in ("configuration", "tokens/s", "vs previous row", "step ms", "peak memory"):
        table.add_column(header)
    table.add_row("baseline (fp32 eager)", "698", "", "727.9", "456.3 MiB")
    table.add_row(label, "630", "0.90x (0.62-1.32x)", "806.6", "n/a")
    text = _printed(table, 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    for figure in ("698", "630", "0.90x", "(0.62-1.32x)", "727.9", "806.6", "456.3", "MiB"):
        assert figure in text.split()
    assert text.count("configuration") <= 2  # not one part per column
    assert len(fit_table(table, 80)[0].columns) == 4  # the label and three figures
