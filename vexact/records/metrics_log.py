"""The one reader of a run's metrics.jsonl, and the one table of how NaN/Inf are spelled in it.

Everything that reads metrics.jsonl goes through ``read_metrics``: the trainer (collapse checks, the summary),
resume (``MetricsWriter`` keeps the lines before the checkpoint), ``vexact report`` (sweeps and single runs), the
live views rebuilt from the log (TensorBoard, W&B), and whatever watches a run from outside. They all get the same
rows, or the same error:

- **A torn last line** -- the last line has no newline: the writer puts each row in one ``write`` of the line plus
  its newline, so a line without one was cut by a kill or is still being written -- is left out, silently, whether
  or not the part that is there happens to parse. A blank line carries nothing and is skipped. A finished run's log
  is final, though (its summary is written after the log is closed): holding fewer rows than its summary's
  ``steps_completed`` -- a torn last line, lines lost -- is damage (``check_finished``).
- **Damage anywhere else** -- a complete line that is not a JSON object -- is ``MetricsDamaged`` (a ValueError) naming
  the file and the line number. Nothing is skipped silently: the caller decides (resume and run refuse; ``vexact
  report`` names the damaged point and stops unless told ``--skip-damaged``).
- **NaN/Inf** are written by ``json_safe`` as the strings "nan", "inf", "-inf". Reading turns every spelling in
  ``NON_FINITE`` (any case) back into a float, and so do ``decode_non_finite`` / ``non_finite_value`` for anyone
  who holds a value from elsewhere (summary.json). JSON's own ``NaN`` / ``Infinity`` tokens parse as floats too.
  ``scalars`` gives a row's numbers as the live views plot them, by the same table.
- **Renamed keys** (``vexact.metric_keys.RENAMED_METRICS``) read under their names now, from a file written before
  the rename as from one that carries both names (the deprecation period's copy), so a report of old runs and of
  new ones names one key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..metric_keys import current_names

NON_FINITE: dict[str, float] = {"nan": math.nan, "+nan": math.nan, "-nan": math.nan, "inf": math.inf,
                                "+inf": math.inf, "-inf": -math.inf, "infinity": math.inf, "+infinity": math.inf,
                                "-infinity": -math.inf}
"""Every accepted spelling of a non-finite value, lower case (matched case-insensitively); the writer uses
``str(float)``: "nan", "inf", "-inf"."""


class MetricsDamaged(ValueError):
    """A complete line of metrics.jsonl that is not a JSON object: the log is damaged there."""

    def __init__(self, path: Path, line: int, why: str):
        super().__init__(f"{path}:{line}: {why}; the metrics log is damaged")
        self.path, self.line, self.why = path, line, why


def non_finite_value(text: str) -> float | None:
    """The float a NaN/Inf spelling stands for (``NON_FINITE``), else None."""
    return NON_FINITE.get(text.strip().lower())


def decode_non_finite(value: Any) -> Any:
    """``value`` with every NaN/Inf string (at any depth) turned back into a float."""
    if isinstance(value, str):
        number = non_finite_value(value)
        return value if number is None else number
    if isinstance(value, dict):
        return {k: decode_non_finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_non_finite(v) for v in value]
    return value


def non_finite_string(value: Any) -> str | None:
    """The first string in ``value`` (at any depth) that ``decode_non_finite`` reads as NaN/Inf, else None: text
    the log cannot keep as text, for a writer of values it did not compute to refuse."""
    if isinstance(value, str):
        return value if non_finite_value(value) is not None else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = non_finite_string(item)
        if found is not None:
            return found
    return None


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of one metrics row under their JSONL keys, as floats; ``step`` (the x axis) and anything
    non-numeric are left out. NaN/Inf are kept -- a diverged run is an outcome to see -- whether they come as
    floats (a live step) or as json_safe's strings "nan"/"inf"/"-inf" (a row read back from metrics.jsonl), so a
    replayed row and a live one give the same values."""
    out = {}
    for key, value in row.items():
        if key == "step":
            continue
        if isinstance(value, (bool, int, float)):
            out[key] = float(value)
        elif isinstance(value, str) and non_finite_value(value) is not None:
            out[key] = non_finite_value(value)
    return out


def complete_lines(text: str) -> list[str]:
    """The lines of ``text`` that end in a newline (a torn last line is dropped), without their newlines."""
    lines = text.split("\n")
    lines.pop()  # "" after the final newline, or the torn last line
    return lines


def parse_line(path: Path, number: int, line: str) -> dict | None:
    """One complete line as a row (None for a blank line); ``MetricsDamaged`` when it is not a JSON object."""
    if not line.strip():
        return None
    try:
        line.encode("utf-8")  # read with surrogateescape: bytes that are not UTF-8 fail here
    except UnicodeEncodeError:
        raise MetricsDamaged(path, number, "not a JSON line (not UTF-8 text)") from None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise MetricsDamaged(path, number, f"not a JSON line ({e.msg})") from None
    except RecursionError:
        raise MetricsDamaged(path, number, "not a JSON line (nested too deeply)") from None
    if not isinstance(row, dict):
        raise MetricsDamaged(path, number, f"expected a JSON object per line, got {type(row).__name__}")
    return current_names(decode_non_finite(row))


def parse_lines(path: Path, lines: list[str]) -> list[dict]:
    """Rows of complete lines (numbered from 1), by the rules in the module docstring."""
    rows = []
    for number, line in enumerate(lines, start=1):
        row = parse_line(path, number, line)
        if row is not None:
            rows.append(row)
    return rows


def check_finished(path: str | Path, rows: int, steps_completed: int) -> None:
    """The log at ``path`` of a run whose summary says it finished after ``steps_completed`` steps, read as ``rows``
    rows: ``MetricsDamaged`` naming the file and line where it holds fewer. A kill cannot do that (the summary is
    written after the log is closed), so a torn last line there is damage, not a step in progress. More rows are
    no damage: a finished run being extended appends to its log before it writes its summary again."""
    if rows >= steps_completed:
        return
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8", errors="surrogateescape")
    except FileNotFoundError:
        text = ""
    line = text.count("\n") + 1  # the torn last line, or the first line missing
    torn = "a torn last line (no newline), " if text and not text.endswith("\n") else ""
    raise MetricsDamaged(path, line, f"{torn}{rows} steps logged, but summary.json says the run finished after "
                                     f"{steps_completed}")


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl ([] when the file does not exist): a torn last line left out, NaN/Inf strings
    as floats, any other line that is not a JSON object ``MetricsDamaged`` naming the file and line. Bytes that are
    not UTF-8 count as damage on their line."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_bytes().decode("utf-8", errors="surrogateescape")
    return parse_lines(path, complete_lines(text))
