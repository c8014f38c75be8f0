"""Rich tables printed whole at any console width: as drawn, compacted, or as a list.

Rich squeezes a table wider than the console by cutting cells (`con… │ 411…`), and a number cut that way is
lost. `print_table` never lets it: the table is drawn at its natural width when that fits the console, else
drawn compact (no outer frame, one space between columns) when that fits, else printed as a list: each row's
first cell as a heading, then its `header: value` pairs packed onto indented lines.

Invariant: every cell's text appears whole (a pair is split only when it alone is wider than the console).
A pipe has no width of its own: rich takes COLUMNS, else 80, so piped output follows the same rule.
"""

from __future__ import annotations

import copy

from rich import box
from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

# Wide enough that a table measured against it is never squeezed: its natural width.
_UNBOUNDED_WIDTH = 1_000_000
_PAIR_GAP = "  "


def natural_width(console: Console, table: Table) -> int:
    """The width `table` takes with no cell wrapped or cut."""
    return Measurement.get(console, console.options.update_width(_UNBOUNDED_WIDTH), table).maximum


def compact(table: Table) -> Table:
    """`table` with a header rule only and one space between columns (same columns and rows)."""
    slim = copy.copy(table)
    slim.box, slim.show_edge, slim.pad_edge = box.SIMPLE_HEAD, False, False
    slim.padding = (0, 0)
    return slim


def _text(console: Console, cell: RenderableType) -> Text:
    if isinstance(cell, Text):
        return cell
    return console.render_str(cell) if isinstance(cell, str) else Text(str(cell))


def _pack(pairs: list[Text], width: int, indent: str) -> list[Text]:
    """`pairs` joined by _PAIR_GAP onto lines of at most `width` cells, each line starting with `indent`."""
    lines: list[Text] = []
    line = Text(indent)
    for pair in pairs:
        if line.plain.strip() and line.cell_len + len(_PAIR_GAP) + pair.cell_len > width:
            lines.append(line)
            line = Text(indent)
        if line.plain.strip():
            line.append(_PAIR_GAP)
        line.append_text(pair)
    if line.plain.strip():
        lines.append(line)
    return lines


def as_list(console: Console, table: Table) -> list[Text]:
    """The list layout of `table`: title, then per row its first cell and the other cells' `header: value`
    pairs (empty cells left out; a header-less table gives `first: value` lines), then the caption."""
    columns = table.columns
    cells = [[_text(console, c) for c in column.cells] for column in columns]
    headers = [_text(console, column.header) for column in columns]
    out = [Text.assemble(_text(console, table.title), style="bold")] if table.title else []
    for row in range(table.row_count):
        first, rest = cells[0][row], [(headers[i], cells[i][row]) for i in range(1, len(columns))]
        rest = [(h, c) for h, c in rest if c.plain.strip()]
        if not table.show_header:
            out.append(Text.assemble(first, ": ", Text(" ").join(c for _, c in rest)) if rest else first.copy())
            continue
        out.append(Text(first.plain.strip(), style="bold"))  # an indented row label would read as a pair
        out += _pack([Text.assemble(h, ": ", c) for h, c in rest], console.width, "  ")
    if table.caption:
        out.append(_text(console, table.caption))
    return out


def print_table(console: Console, table: Table) -> None:
    """Prints `table` with every cell whole: as drawn or compacted when it fits `console`, else as a list."""
    for drawn in (table, compact(table)):
        if natural_width(console, drawn) <= console.width:
            console.print(drawn)
            return
    for line in as_list(console, table):
        line.rstrip()
        console.print(line, overflow="fold")
