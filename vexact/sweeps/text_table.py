"""Printed tables that fit the terminal without ever cutting a number (``print_table``), and the cell formatters
every report shares."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.table import Table


@dataclass
class TextColumn:
    """One column of a printed table: its header, an abbreviation for narrow terminals, and its formatted cells.

    ``wrap``: the cells are labels that may wrap at spaces; otherwise (numbers) a cell is never wrapped or cut."""

    header: str
    cells: list[str]
    short: str | None = None
    justify: str = "right"
    wrap: bool = False
    style: str | None = None


def print_table(console: Console, title: str, columns: list[TextColumn], notes: list[str] | None = None) -> Table:
    """Print ``columns`` as a table that never truncates a cell, whatever the console's width.

    Layouts, the first that fits: full headers on one line; headers wrapped at spaces; abbreviated headers with a
    legend line; the same with one-space column gaps and no borders; and, when even that is too wide, a vertical
    layout (one column per row of the data, one line per header), split into as many tables as the width needs.
    Every column is given an exact width no smaller than its longest cell, so rich never folds or ellipsises a
    number (it did at 80 columns: "5.2e…"). Returns the first Table printed."""
    notes = list(notes or [])
    width = console.width
    cells_min = [max((_min_cell(cell, c.wrap) for cell in c.cells), default=1) for c in columns]
    full = [max(max((cell_len(cell) for cell in c.cells), default=1), cell_len(c.header)) for c in columns]
    n = len(columns)
    if sum(full) + 3 * n + 1 <= width:
        return _print_rows(console, title, columns, [c.header for c in columns], full, notes)
    headers = [c.header for c in columns]
    mins = [max(m, _longest_word(h)) for m, h in zip(cells_min, headers)]
    if sum(mins) + 3 * n + 1 <= width:
        widths = _spread(headers, mins, width - 3 * n - 1)
        spare = width - 3 * n - 1 - sum(widths)
        for i, c in enumerate(columns):  # what is left lets wrapping label columns wrap less
            if c.wrap and spare > 0:
                grow = min(spare, full[i] - widths[i])
                widths[i] += max(grow, 0)
                spare -= max(grow, 0)
        return _print_rows(console, title, columns, headers, widths, notes)
    shorts = [c.short or c.header for c in columns]
    legend = [f"{s} = {c.header}" for s, c in zip(shorts, columns) if s != c.header]
    notes = (["columns: " + "; ".join(legend)] if legend else []) + list(notes)
    mins = [max(m, _longest_word(h)) for m, h in zip(cells_min, shorts)]
    if sum(mins) + 3 * n + 1 <= width:
        return _print_rows(console, title, columns, shorts, _spread(shorts, mins, width - 3 * n - 1), notes)
    if sum(mins) + n - 1 <= width:
        return _print_rows(console, title, columns, shorts, _spread(shorts, mins, width - n + 1), notes,
                           compact=True)
    return _print_vertical(console, title, columns, notes[1:] if legend else notes)


def _print_rows(console: Console, title: str, columns: list[TextColumn], headers: list[str], widths: list[int],
                notes: list[str], compact: bool = False) -> Table:
    options: dict[str, Any] = {"box": box.SIMPLE_HEAD, "show_edge": False, "padding": (0, 0)} if compact else {}
    # escaped, not markup: titles and cells hold run names, values and errors ("exp[v2]", "[batch, seq, hidden]")
    table = Table(title=escape(title), **options)
    for c, h, w in zip(columns, headers, widths):
        table.add_column(escape(h), justify=c.justify, style=c.style, width=w, overflow="fold")
    for cells in zip(*(c.cells for c in columns)):
        table.add_row(*map(escape, cells))
    console.print(table)
    _print_notes(console, notes)
    return table


def _print_vertical(console: Console, title: str, columns: list[TextColumn], notes: list[str]) -> Table:
    """One line per column (its full header), one column per data row; as many tables as the width needs."""
    rows = list(zip(*(c.cells for c in columns)))
    labels = [c.header for c in columns]
    label_w = max(max((_longest_word(h) for h in labels), default=1), min(max(map(cell_len, labels), default=1), 24))
    row_w = [max(_min_cell(cell, c.wrap) for cell, c in zip(row, columns)) for row in rows]
    chunks: list[list[int]] = []
    for i, w in enumerate(row_w):
        used = label_w + 4 + sum(row_w[j] + 3 for j in chunks[-1]) if chunks else None
        if used is None or used + w + 3 > console.width:
            chunks.append([i])
        else:
            chunks[-1].append(i)
    tables = []
    for k, chunk in enumerate(chunks or [[]]):
        part = f" ({k + 1}/{len(chunks)})" if len(chunks) > 1 else ""
        table = Table(title=escape(title + part), show_header=False)
        table.add_column(justify="left", width=min(label_w, max(console.width - 7, 1)), overflow="fold")
        for i in chunk:
            table.add_column(justify="right", width=min(row_w[i], max(console.width - label_w - 7, 1)),
                             overflow="fold")
        for j, c in enumerate(columns):
            table.add_row(escape(c.header), *(escape(rows[i][j]) for i in chunk), style=c.style,
                          end_section=c.style is not None and (j + 1 == len(columns) or columns[j + 1].style is None))
        console.print(table)
        tables.append(table)
    _print_notes(console, notes)
    return tables[0]


def _print_notes(console: Console, notes: list[str]) -> None:
    for note in notes:
        console.print(note, markup=False, highlight=False, style="dim")


def _spread(headers: list[str], mins: list[int], room: int) -> list[int]:
    """Column widths from ``mins``, widening the columns whose headers wrap onto the most lines while room lasts."""
    widths, spare = list(mins), room - sum(mins)
    while spare > 0:
        best = None
        for i, h in enumerate(headers):
            lines = _wrapped_lines(h, widths[i])
            if lines <= 1:
                continue
            w = widths[i] + 1
            while w <= widths[i] + spare and _wrapped_lines(h, w) >= lines:
                w += 1
            if w <= widths[i] + spare:  # fewest-lines-first, then the cheapest widening
                candidate = (-lines, w - widths[i], i)
                best = candidate if best is None else min(best, candidate)
        if best is None:
            break
        _, cost, i = best
        widths[i] += cost
        spare -= cost
    return widths


def _wrapped_lines(text: str, width: int) -> int:
    return len(textwrap.wrap(text, max(width, 1))) or 1


def _longest_word(text: str) -> int:
    return max((cell_len(w) for w in text.split()), default=1)


def _min_cell(cell: str, wrap: bool) -> int:
    return _longest_word(cell) if wrap else max(cell_len(cell), 1)


# ----------------------------------------------------------------------------- cells


def fmt_value(v: Any) -> str:
    """A grid value as a cell: floats in their shortest form (``%g``), None as an em dash."""
    if isinstance(v, float):
        return f"{v:g}"
    return "—" if v is None else str(v)


def fmt_sci(v: float | None) -> str:
    """Two significant digits in scientific notation (a mismatch), 0 as 0, None as an em dash."""
    if v is None:
        return "—"
    return "0" if v == 0 else f"{v:.1e}"


def fmt_float(v: float | None) -> str:
    """Three decimals (a reward), None as an em dash."""
    return "—" if v is None else f"{v:.3f}"


def fmt_step(v: float | None) -> str:
    """A step (a median may be a half step), None as an em dash."""
    if v is None:
        return "—"
    return str(int(v)) if float(v).is_integer() else f"{v:.1f}"
