"""Print a wide rich table in a narrow terminal: columns packed into parts that fit the width.

rich fits an over-wide table by squeezing every column, which truncates headers (``config…``)
and wraps numbers over two lines. Here each column gets the width of its widest cell (its header
may wrap onto two lines), and when the columns do not all fit, the table is printed in parts
that each repeat the first (label) column, so every number stays whole and next to its label.
The label columns take at most half the width: a long label (a memory plan's) wraps onto more
lines rather than leave the numbers beside it no room. Cells print literally: a name like
``compile[bold]`` is not rich markup.

rich has no such layout (its tables only shrink or wrap columns), hence this small module.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.cells import cell_len
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

# Columns are separated by 1 space of padding on each side plus SIMPLE_HEAD's blank divider.
_GAP = 3
# The widest a header may make its column beyond its cells before it wraps onto a second line.
_HEADER_LINES = 2


def print_table(console: Console, table: Table, *, keep: int = 1) -> None:
    """Print ``table`` in as many parts as ``console.width`` needs (see :func:`fit_table`)."""
    for number, part in enumerate(fit_table(table, console.width, keep=keep)):
        if number:
            console.print()
        console.print(part)


def fit_table(table: Table, width: int, *, keep: int = 1) -> list[Table]:
    """``table`` as parts no wider than ``width``, each repeating its first ``keep`` columns.

    Columns keep their order; the title goes on the first part and the caption on the last. A
    column too wide for any part gets a part of its own (rich then wraps its cells).
    """
    columns = table.columns
    cells = [[_text(cell) for cell in column.cells] for column in columns]
    widths = [_column_width(_plain(c.header), cells[i]) for i, c in enumerate(columns)]
    widths = _labels_capped(widths, [_plain(c.header) for c in columns[:keep]], width)
    parts = _pack(widths, width, keep)
    tables = []
    for number, indices in enumerate(parts):
        part = Table(
            title=table.title if number == 0 else None,
            caption=table.caption if number == len(parts) - 1 else None,
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
        )
        for i in indices:
            part.add_column(
                _text(columns[i].header),
                justify=columns[i].justify,
                width=widths[i],
                overflow="fold",
            )
        for row in range(table.row_count):
            part.add_row(*(cells[i][row] for i in indices))
        tables.append(part)
    return tables


def _labels_capped(widths: Sequence[int], headers: Sequence[str], width: int) -> list[int]:
    """``widths`` with the label columns (the first ``len(headers)``) no wider than half of
    ``width`` together, nor narrower than their headers' longest word."""
    capped = list(widths)
    share = max(1, width // 2 // max(1, len(headers)))
    for i, header in enumerate(headers):
        longest_word = max((cell_len(w) for w in header.split()), default=1)
        capped[i] = min(capped[i], max(share, longest_word))
    return capped


def _pack(widths: Sequence[int], width: int, keep: int) -> list[list[int]]:
    """Column indices per part: greedily in order, the first ``keep`` in every part."""
    head = list(range(min(keep, len(widths))))
    parts: list[list[int]] = []
    current = list(head)
    for i in range(len(head), len(widths)):
        if current != head and _span(widths, [*current, i]) > width:
            parts.append(current)
            current = list(head)
        current.append(i)
    parts.append(current)
    return parts


def _span(widths: Sequence[int], indices: Sequence[int]) -> int:
    return sum(widths[i] for i in indices) + _GAP * (len(indices) - 1)


def _column_width(header: str, cells: Sequence[Text]) -> int:
    """The widest cell, or the narrowest width at which the header wraps onto two lines.

    A header with its own line breaks keeps them, and is as wide as its longest line.
    """
    widest_cell = max((cell.cell_len for cell in cells), default=0)
    if "\n" in header:
        return max([widest_cell, *(cell_len(line) for line in header.splitlines())])
    words = header.split()
    narrowest = max([widest_cell, *(cell_len(w) for w in words)])
    for candidate in range(narrowest, cell_len(header) + 1):
        if _wrapped_lines(words, candidate) <= _HEADER_LINES:
            return candidate
    return max(narrowest, cell_len(header))


def _wrapped_lines(words: Sequence[str], width: int) -> int:
    """Lines that greedy word wrapping (rich's) needs for ``words`` at ``width``."""
    lines, used = 1, -1
    for word in words:
        if used >= 0 and used + 1 + cell_len(word) > width:
            lines, used = lines + 1, -1
        used += 1 + cell_len(word)
    return lines


def _text(cell: RenderableType) -> Text:
    return cell if isinstance(cell, Text) else Text(str(cell))


def _plain(header: RenderableType) -> str:
    return header.plain if isinstance(header, Text) else str(header)
