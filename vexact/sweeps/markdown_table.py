"""The one writer of GitHub-flavoured Markdown tables: the sweep report's table.md and the benchmark tables that the
README shows (``python -m benchmarks.tables``) both go through ``markdown_table``, so every table vexact writes has
the same layout and escaping."""

from __future__ import annotations

from collections.abc import Sequence

ALIGN = {"left": ":---", "right": "---:", None: "---"}
"""Column alignment -> its separator cell."""


def _cell(text: object) -> str:
    """A cell's text on one line, with ``|`` escaped so that it cannot end the cell."""
    return " ".join(str(text).split("\n")).replace("|", "\\|")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                   align: Sequence[str | None] | None = None) -> str:
    """``headers`` and ``rows`` as a Markdown table (no trailing newline). ``align``: per column ``"left"``,
    ``"right"`` or None (the renderer's default), all None when not given. Every row must have one cell per header."""
    align = list(align) if align is not None else [None] * len(headers)
    if len(align) != len(headers):
        raise ValueError(f"markdown_table: {len(align)} alignments for {len(headers)} columns")
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"markdown_table: a row has {len(row)} cells for {len(headers)} columns: {list(row)!r}")
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |",
             "|" + "|".join(ALIGN[a] for a in align) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
