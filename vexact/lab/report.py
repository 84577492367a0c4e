"""Summarise a ``vexact sweep`` directory: per-group table, per-point CSV, and plots.

A *group* is one magnitude setting: all points sharing the values of every grid key except
``seed``. ``write_report(sweep_dir)`` writes everything into ``SWEEP_DIR/report/``:

    summary.csv                 one row per point (overrides, status, every collapse field)
    table.json / table.md       one row per group (realised mismatch, collapse rate, ...)
    reward_curves.png           eval reward vs step, one line per point (colour + marker = group, line style = seed)
    mismatch_vs_step.png        rollout-correction k3 KL vs step (log y)
    collapse_vs_magnitude.png   collapse step vs realised k3 KL (log x)
    outcome_vs_realised_k3.png  collapse rate and final reward vs realised k3 KL (log x)
    dose_response.json / .png   collapse probability vs realised k3 KL and the fitted 50% threshold
                                (``vexact/lab/dose_response.py``)
    dynamics.json               does the realised k3 grow during runs, and what it moves with
                                (``vexact/lab/dynamics.py``)

"Peak reward" and "final reward" share one definition (``reward_summary``): the series the collapse detector
judges, smoothed as it smooths it; the tables say so in a footnote. Printed tables fit the terminal without ever
cutting a number (``print_table``). A single run directory is reported by ``vexact/lab/run_report.py``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

from ..metric_keys import EVAL_REWARD_MEAN, K3_KL, REWARD_MEAN
from ..rl.atomic import publish, write_json_atomic, write_text_atomic
from ..rl.collapse import trailing_mean
from ..rl.config import CollapseSection, dotted_items
from ..rl.metrics_log import decode_non_finite, read_metrics
from .markdown_table import markdown_table as write_markdown_table

SEED_KEY = "seed"
RESULT_STATUSES = ("completed", "stopped")  # points that ran to a verdict (the collapse-rate denominator)
REPORT_DIR = "report"


# ----------------------------------------------------------------------------- loading


@dataclass
class PointData:
    """One sweep point: its overrides, status, summary.json (or None) and metrics.jsonl lines; ``damage`` says
    what could not be read (an unparsable summary.json, a damaged metrics.jsonl), empty when nothing."""

    name: str
    dir: Path
    overrides: dict[str, Any]
    status: str
    error: str | None = None
    summary: dict[str, Any] | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    damage: list[str] = field(default_factory=list)

    @property
    def collapse(self) -> dict[str, Any]:
        """The summary's collapse dict ({} when the point has no summary)."""
        return (self.summary or {}).get("collapse") or {}

    @property
    def has_result(self) -> bool:
        return self.status in RESULT_STATUSES and self.summary is not None

    @property
    def run_length(self) -> int:
        """Steps the point ran: summary's steps_completed, else the metrics history length."""
        steps = (self.summary or {}).get("steps_completed")
        if isinstance(steps, (int, float)) and math.isfinite(steps):
            return int(steps)
        return max((int(m["step"]) + 1 for m in self.metrics if _is_num(m.get("step"))), default=0)


@dataclass
class SweepData:
    """A loaded sweep: its name, grid, the non-seed ``group_keys`` and every point (failed ones included)."""

    path: Path
    name: str
    grid: dict[str, list[Any]]
    group_keys: list[str]
    points: list[PointData]
    curves: list[str] | None = None  # the sweep file's ``curves`` (dose-response split), None when not given

    def group_values(self, point: PointData) -> tuple[Any, ...]:
        return tuple(point.overrides.get(k) for k in self.group_keys)

    def group_label(self, values: tuple[Any, ...]) -> str:
        if not self.group_keys:
            return "all"
        return ", ".join(f"{k}={_fmt_value(v)}" for k, v in zip(self.group_keys, values))

    def groups(self) -> list[tuple[tuple[Any, ...], list[PointData]]]:
        """(group values, points) in grid order; groups not in the grid come last, in order of appearance."""
        by_key: dict[str, tuple[tuple[Any, ...], list[PointData]]] = {}
        for p in self.points:
            values = self.group_values(p)
            by_key.setdefault(_freeze(values), (values, []))[1].append(p)
        order = sorted(enumerate(by_key.values()), key=lambda item: (self._grid_index(item[1][0]), item[0]))
        return [group for _, group in order]

    def _grid_index(self, values: tuple[Any, ...]) -> tuple[int, ...]:
        index = []
        for key, value in zip(self.group_keys, values):
            options = [_freeze(v) for v in self.grid.get(key, [])]
            index.append(options.index(_freeze(value)) if _freeze(value) in options else len(options))
        return tuple(index)


def read_sweep_results(sweep_dir: str | Path) -> SweepData:
    """Read sweep.json plus every point's summary.json and metrics.jsonl (missing files are tolerated)."""
    sweep_dir = Path(sweep_dir)
    spec_path = sweep_dir / "sweep.json"
    if not spec_path.is_file():
        raise ValueError(f"{sweep_dir} is not a sweep directory: {spec_path} not found")
    try:
        spec = json.loads(spec_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{spec_path} is not valid JSON: {e}") from e
    if not isinstance(spec, dict) or not isinstance(spec.get("points"), list):
        raise ValueError(f"{spec_path} is not a sweep spec (no 'points' list)")

    grid = spec.get("grid") or {}
    points = []
    for entry in spec["points"]:
        name = str(entry.get("name", ""))
        point_dir = Path(entry.get("dir") or Path("points") / name)
        point_dir = point_dir if point_dir.is_absolute() else sweep_dir / point_dir
        status, error = entry.get("status"), entry.get("error")
        if status == "failed" and str(error or "").startswith("RunLocked"):
            # failed only because another process held its directory then: what that process finished counts
            status = error = None
        points.append(read_point(point_dir, name, dict(entry.get("overrides") or {}), status, error))
    if grid:
        group_keys = [k for k in grid if k != SEED_KEY]
    else:  # no grid recorded: group by every override except the seed
        group_keys = list(dict.fromkeys(k for p in points for k in p.overrides if k != SEED_KEY))
    curves = spec.get("curves")
    return SweepData(path=sweep_dir, name=str(spec.get("name") or sweep_dir.name), grid=grid,
                     group_keys=group_keys, points=points, curves=list(curves) if isinstance(curves, list) else None)


def read_point(point_dir: Path, name: str, overrides: dict[str, Any] | None = None, status: str | None = None,
               error: str | None = None) -> PointData:
    """One run directory (a sweep point, or a single ``vexact run``): its summary.json and metrics.jsonl.

    The one reader behind both the sweep report and the single-run report (``run_report.py``), so a run reads
    the same wherever it is reported from. ``status`` defaults to the summary's, else "pending". Missing files are
    no damage (a point not run yet, a run still going); a file that is there but cannot be read is: it is left out
    (summary None, metrics []) and named in ``damage``. metrics.jsonl is read by ``metrics_log.read_metrics``
    (a torn last line is left out, any other bad line is damage)."""
    damage = []
    summary = None
    summary_path = point_dir / "summary.json"
    if summary_path.is_file():
        try:
            summary = decode_non_finite(json.loads(summary_path.read_bytes()))
            if not isinstance(summary, dict):
                raise ValueError(f"a JSON {type(summary).__name__}, not an object")
        except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            summary = None
            damage.append(f"{summary_path.name}: not a readable run summary ({_first_line(e)})")
    try:
        metrics = read_metrics(point_dir / "metrics.jsonl")
    except (OSError, ValueError) as e:  # MetricsDamaged names the file and line
        metrics = []
        damage.append(_first_line(e).replace(str(point_dir) + "/", ""))
    status = status or (summary or {}).get("status") or "pending"
    claimed = (summary or {}).get("steps_completed")
    if summary is not None and summary.get("status") in RESULT_STATUSES and not metrics and not damage \
            and isinstance(claimed, int) and claimed > 0:  # a finished run's log is final: it cannot be empty
        damage.append(f"metrics.jsonl holds no steps, but summary.json says {claimed} were completed")
    return PointData(name=name, dir=point_dir, overrides=dict(overrides or {}), status=str(status), error=error,
                     summary=summary, metrics=metrics, damage=damage)


def _damage_list(damaged: list[PointData]) -> str:
    return "; ".join(f"{p.name or p.dir} ({', '.join(p.damage)})" for p in damaged)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines() or [type(err).__name__])[0][:200]


def damaged_points_error(where: Path, damaged: list[PointData]) -> ValueError:
    """One error naming every damaged or unreadable point and what is wrong with it."""
    return ValueError(f"{where}: {len(damaged)} damaged or unreadable point{'s' * (len(damaged) != 1)}: "
                      f"{_damage_list(damaged)}. "
                      "Repair or move them away, or pass --skip-damaged to report without them")


# ----------------------------------------------------------------------------- tables


def reward_summary(point: PointData) -> dict[str, Any]:
    """Peak and final reward under **one** definition: the series the collapse detector judges (its ``metric``,
    ``eval/reward_mean`` by default) smoothed the way it smooths it (trailing mean of ``smoothing`` points).

    ``peak`` is the highest smoothed value and ``final`` the last, so final <= peak always holds. (The collapse
    summary's ``final_reward`` is the last *raw* value, which can sit above the smoothed peak.) Without a metrics
    history only the summary's ``peak_reward`` (already smoothed) is known and ``final`` is None.
    Returns {metric, smoothing, peak, peak_step, final, final_step, points}."""
    criteria = point.collapse.get("criteria") or {}
    defaults = CollapseSection()
    metric = criteria.get("metric") or defaults.metric
    smoothing = criteria.get("smoothing")
    smoothing = int(smoothing) if _is_num(smoothing) and smoothing >= 1 else defaults.smoothing
    pairs = sorted((s, v) for s, v in zip(*_series(point, metric)) if math.isfinite(v))
    out: dict[str, Any] = {"metric": metric, "smoothing": smoothing, "peak": None, "peak_step": None,
                           "final": None, "final_step": None, "points": len(pairs)}
    if not pairs:
        peak = point.collapse.get("peak_reward")
        if _is_num(peak) and math.isfinite(peak):
            out.update(peak=float(peak), peak_step=point.collapse.get("peak_step"))
        return out
    smoothed = trailing_mean([v for _, v in pairs], smoothing)
    best = max(range(len(smoothed)), key=smoothed.__getitem__)  # first occurrence, like the detector
    out.update(peak=smoothed[best], peak_step=_as_step(pairs[best][0]), final=smoothed[-1],
               final_step=_as_step(pairs[-1][0]))
    return out


def reward_definition(points: list[PointData]) -> str:
    """The footnote that says what "peak reward" / "final reward" are (from the points' collapse criteria)."""
    specs = sorted({(r["metric"], r["smoothing"]) for r in (reward_summary(p) for p in points)})
    if not specs:
        d = CollapseSection()
        specs = [(d.metric, d.smoothing)]
    what = " or ".join(f"{m} as a trailing mean of {k} evaluation points" if k > 1 else f"{m} (unsmoothed)"
                       for m, k in specs)
    return (f"peak / final reward (smoothed): {what} -- the series and smoothing the collapse detector uses; "
            "peak = its highest value, final = its last value (so final <= peak)")


def _as_step(step: float) -> int | float:
    return int(step) if float(step).is_integer() else step


def group_table(data: SweepData) -> list[dict[str, Any]]:
    """One row per group, in grid order. Statistics use the points with a result (completed or stopped).

    ``seeds`` counts those points; ``failed`` the points whose run failed; ``collapse_rate`` is
    ``collapsed / seeds`` (None when no point has a result).
    """
    rows = []
    for values, points in data.groups():
        done = [p for p in points if p.has_result]
        collapsed = [p for p in done if p.collapse.get("collapsed") is True]
        row: dict[str, Any] = dict(zip(data.group_keys, values))
        row.update({
            "group": data.group_label(values),
            "points": len(points),
            "seeds": len(done),
            "failed": sum(p.status == "failed" for p in points),
            "incomplete": sum(not p.has_result and p.status != "failed" for p in points),  # pending, ...
            "collapsed": len(collapsed),
            "realised_k3_kl": _mean(p.collapse.get("mean_k3_kl") for p in done),
            "realised_abs_dlogp": _mean(p.collapse.get("mean_abs_dlogp") for p in done),
            "collapse_rate": len(collapsed) / len(done) if done else None,
            "median_collapse_step": _median(p.collapse.get("collapse_step") for p in collapsed),
            # runs that fell below the drop but ended before the detector's patience ran out (a late drop, or a run
            # too short to confirm it): not collapses, and not survivals either; None when no run of the sweep has one
            "unconfirmed": sum(p.collapse.get("collapse_unconfirmed_step") is not None for p in done
                               if p not in collapsed),
            "peak_reward": _mean(reward_summary(p)["peak"] for p in done),  # one definition: reward_summary
            "final_reward": _mean(reward_summary(p)["final"] for p in done),
            "length_surge_lead_median": _median(p.collapse.get("length_surge_lead") for p in done),
            "surge_before_collapse": sum(p.collapse.get("length_surge_lead") is not None for p in collapsed),
            "lr_decay_triggered": _count_triggered(done),
            "lr_trigger_step_median": _median(_lr_schedule(p).get("trigger_step") for p in done),
        })
        rows.append(row)
    return rows


def _lr_schedule(point: PointData) -> dict[str, Any]:
    return (point.summary or {}).get("lr_schedule") or {}


def _count_triggered(points: list[PointData]) -> int | None:
    """How many points' triggered LR schedule fired; None when no point has a triggered schedule."""
    triggered = [p for p in points if "trigger_step" in _lr_schedule(p)]
    return sum(_lr_schedule(p)["trigger_step"] is not None for p in triggered) if triggered else None


def write_summary_csv(data: SweepData, path: str | Path) -> Path:
    """One row per point: name, group, overrides, status, error, run length, every collapse field (flat) and
    ``peak_reward_smoothed`` / ``final_reward_smoothed`` (the tables' definition; collapse's ``final_reward`` is
    the raw last value)."""
    rows = []
    for p in data.points:
        row: dict[str, Any] = {"name": p.name, "group": data.group_label(data.group_values(p))}
        row.update(p.overrides)
        summary = p.summary or {}
        row.update({"status": p.status, "error": p.error, "reason": summary.get("reason"),
                    "steps_completed": summary.get("steps_completed")})
        row.update(dotted_items(p.collapse))
        if p.summary is not None:  # the table's definition (reward_summary), next to the collapse summary's raw final
            reward = reward_summary(p)
            row.update(peak_reward_smoothed=reward["peak"], final_reward_smoothed=reward["final"])
        rows.append(row)
    columns = list(dict.fromkeys(k for row in rows for k in row)) or ["name", "status"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns, restval="")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _csv_cell(v) for k, v in row.items()})
    return write_text_atomic(path, text.getvalue())


def _csv_cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return json.dumps(v)
    return v


_COLUMNS = [  # (row key, header, abbreviation for narrow terminals, formatter)
    ("seeds", "seeds", "n", lambda r: str(r["seeds"])),
    ("realised_k3_kl", "realised k3 KL", "k3", lambda r: _fmt_sci(r["realised_k3_kl"])),
    ("realised_abs_dlogp", "realised |Δlogp|", "|Δlp|", lambda r: _fmt_sci(r["realised_abs_dlogp"])),
    ("collapse_rate", "collapse rate", "coll", lambda r: f"{r['collapsed']}/{r['seeds']}" if r["seeds"] else "—"),
    ("median_collapse_step", "median collapse step", "c.step", lambda r: _fmt_step(r["median_collapse_step"])),
    # shown only when some run dropped without confirmation:
    ("unconfirmed", "dropped, unconfirmed at the end", "unconf",
     lambda r: "—" if r.get("unconfirmed") is None else f"{r['unconfirmed']}/{r['seeds']}"),
    ("peak_reward", "peak reward (smoothed)", "peak", lambda r: _fmt_float(r["peak_reward"])),
    ("final_reward", "final reward (smoothed)", "final", lambda r: _fmt_float(r["final_reward"])),
    ("length_surge_lead_median", "surge lead", "lead", lambda r: _fmt_step(r["length_surge_lead_median"])),
    ("surge_before_collapse", "surge before collapse", "surge",
     lambda r: f"{r['surge_before_collapse']}/{r['collapsed']}" if r["collapsed"] else "—"),
    # shown only when some group has a triggered LR schedule:
    ("lr_decay_triggered", "LR decay fired", "LR", lambda r: "—" if r.get("lr_decay_triggered") is None
     else f"{r['lr_decay_triggered']}/{r['seeds']}"),
    ("lr_trigger_step_median", "median trigger step", "t.step", lambda r: _fmt_step(r.get("lr_trigger_step_median"))),
]
_OPTIONAL = {"lr_decay_triggered", "lr_trigger_step_median", "unconfirmed"}


def _shown(value: Any, key: str) -> bool:
    """Whether an optional column's cell asks for the column: any LR-schedule value, a non-zero unconfirmed count."""
    return bool(value) if key == "unconfirmed" else value is not None


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


def _group_columns(rows: list[dict[str, Any]], group_keys: list[str]) -> list[TextColumn]:
    """The group table's columns (shared by the terminal and Markdown tables)."""
    show_failed = any(r.get("failed") for r in rows)
    columns = [c for c in _COLUMNS[1:] if c[0] not in _OPTIONAL or any(_shown(r.get(c[0]), c[0]) for r in rows)]
    tails = [k.rsplit(".", 1)[-1] for k in group_keys]
    out = [TextColumn(k, [_fmt_value(r.get(k)) for r in rows], short=tail if tails.count(tail) == 1 else k,
                      justify="left", style="cyan") for k, tail in zip(group_keys, tails)]
    if not group_keys:
        out.append(TextColumn("group", [str(r.get("group", "all")) for r in rows], justify="left", style="cyan"))
    key, header, short, fmt = _COLUMNS[0]
    out.append(TextColumn(header, [fmt(r) for r in rows], short=short))
    if show_failed:
        out.append(TextColumn("failed", [str(r.get("failed", 0)) for r in rows], short="fail"))
    out += [TextColumn(header, [fmt(r) for r in rows], short=short) for _, header, short, fmt in columns]
    return out


def _table_cells(rows: list[dict[str, Any]], group_keys: list[str]) -> tuple[list[str], list[list[str]]]:
    """Headers and formatted cells (one list per row) of the group table."""
    columns = _group_columns(rows, group_keys)
    return [c.header for c in columns], [list(cells) for cells in zip(*(c.cells for c in columns))]


def _row_group_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The group keys of rows from ``group_table`` (the keys before the fixed ``group`` column)."""
    if not rows:
        return []
    keys = list(rows[0])
    return keys[:keys.index("group")] if "group" in keys else []


def render_table(rows: list[dict[str, Any]], console: Console | None = None, title: str = "sweep",
                 notes: list[str] | None = None) -> Table:
    """Print the group rows, fitted to the console's width (see ``print_table``), then ``notes`` (default: what
    peak / final reward mean); returns the (first) Table printed."""
    notes = [reward_definition([])] if notes is None else notes
    return print_table(console or Console(), title, _group_columns(rows, _row_group_keys(rows)), notes)


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
    table = Table(title=title, **options)
    for c, h, w in zip(columns, headers, widths):
        table.add_column(h, justify=c.justify, style=c.style, width=w, overflow="fold")
    for cells in zip(*(c.cells for c in columns)):
        table.add_row(*cells)
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
        table = Table(title=title + part, show_header=False)
        table.add_column(justify="left", width=min(label_w, max(console.width - 7, 1)), overflow="fold")
        for i in chunk:
            table.add_column(justify="right", width=min(row_w[i], max(console.width - label_w - 7, 1)),
                             overflow="fold")
        for j, c in enumerate(columns):
            table.add_row(c.header, *(rows[i][j] for i in chunk), style=c.style,
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


def markdown_table(rows: list[dict[str, Any]], title: str | None = None, notes: list[str] | None = None) -> str:
    """The group rows as a GitHub-flavoured Markdown table (group keys left-aligned, numbers right-aligned),
    followed by ``notes`` (default: what peak / final reward mean)."""
    group_keys = _row_group_keys(rows)
    headers, body = _table_cells(rows, group_keys)
    n_keys = max(len(group_keys), 1)
    lines = [f"### {title}", ""] if title else []
    lines.append(write_markdown_table(headers, body, ["left" if i < n_keys else "right" for i in range(len(headers))]))
    notes = [reward_definition([])] if notes is None else notes
    if notes:
        lines += [""] + notes
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- plots


SEED_LINESTYLES: tuple[Any, ...] = ("-", "--", ":", "-.", (0, (6, 2, 1, 2, 1, 2)), (0, (1, 1)), (0, (9, 3)),
                                    (0, (3, 1, 1, 1)))
GROUP_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<", ">", "p", "d", "H", "8")


@dataclass(frozen=True)
class GroupStyle:
    """How one group is drawn in every sweep plot: its own colour and marker (seeds differ by line style)."""

    colour: Any
    marker: str
    linewidth: float
    markersize: float
    zorder: float


def distinct_colours(n: int) -> list[Any]:
    """``n`` colours that are told apart at a glance: a qualitative palette, never a scale (with a scale, two
    close magnitudes got two near-identical greens); the legend carries the order."""
    import matplotlib

    if n <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(n)]
    if n <= 20:  # the strong half of tab20 first, then the light half
        return [matplotlib.colormaps["tab20"](2 * i if i < 10 else 2 * (i - 10) + 1) for i in range(n)]
    return [matplotlib.colormaps["hsv"](i / n) for i in range(n)]


def group_styles(n: int) -> list[GroupStyle]:
    """One style per group, in group order. Earlier groups are drawn wider, with larger markers, *underneath*
    later ones, so groups whose results coincide (a remedy that changes nothing, like ``none`` and ``token_tis``)
    show as nested outlines instead of one hiding the other."""
    colours = distinct_colours(n)
    styles = []
    for i in range(n):
        t = (n - 1 - i) / max(n - 1, 1)  # 1 for the first group, 0 for the last
        styles.append(GroupStyle(colour=colours[i], marker=GROUP_MARKERS[i % len(GROUP_MARKERS)],
                                 linewidth=1.1 + 2.4 * t, markersize=4.5 + 5.5 * t, zorder=2.0 + i / max(n, 1)))
    return styles


def seed_linestyles(data: SweepData) -> dict[str, Any]:
    """Line style per seed (frozen seed value -> style), seeds in grid order, so seeds of a group are told apart."""
    seeds = list(data.grid.get(SEED_KEY) or [])
    seeds += sorted({p.overrides.get(SEED_KEY) for p in data.points} - set(seeds), key=str)
    return {_freeze(s): SEED_LINESTYLES[i % len(SEED_LINESTYLES)] for i, s in enumerate(seeds)}


def plot_sweep(data: SweepData, out_dir: str | Path) -> list[Path]:
    """Write reward_curves.png, mismatch_vs_step.png, collapse_vs_magnitude.png and outcome_vs_realised_k3.png
    (``sweep_figures``); returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [_save(fig, out_dir / name) for name, fig in sweep_figures(data).items()]


def sweep_figures(data: SweepData) -> dict[str, Any]:
    """The sweep plots as matplotlib Figures, by file name (tests inspect their artists).

    Every plot draws a group in one colour and marker (``group_styles``) and a seed in one line style
    (``seed_linestyles``), with the legend outside the axes so it never covers data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    groups = data.groups()
    style_of_group = {_freeze(values): s for (values, _), s in zip(groups, group_styles(len(groups)))}
    style = lambda p: style_of_group[_freeze(data.group_values(p))]  # noqa: E731
    linestyle_of_seed = seed_linestyles(data)
    dash = lambda p: linestyle_of_seed.get(_freeze(p.overrides.get(SEED_KEY)), "-")  # noqa: E731
    label_of = {_freeze(values): data.group_label(values) for values, _ in groups}
    seeds_shown = {_freeze(p.overrides.get(SEED_KEY)) for p in data.points if p.metrics}

    def legend_handles(keys: set[str], seeds: bool = True) -> list[Any]:
        """Group entries (colour + marker; a line only where lines are drawn) and, for lines, seed entries."""
        handles = [Line2D([], [], color=s.colour, marker=s.marker, lw=2 if seeds else 0, ms=7, label=label_of[k])
                   for k, s in style_of_group.items() if k in keys]
        if seeds and len(seeds_shown) > 1:
            handles += [Line2D([], [], color="black", ls=ls, lw=1.5, label=f"seed {json.loads(k)}")
                        for k, ls in linestyle_of_seed.items() if k in seeds_shown]
        return handles

    figures = {}

    # reward curves ------------------------------------------------------------------------
    metric = EVAL_REWARD_MEAN
    if not any(_is_num(m.get(metric)) for p in data.points for m in p.metrics):
        metric = REWARD_MEAN  # no eval steps at all: fall back to the training reward
    fig, ax = plt.subplots(figsize=(10, 5.5))
    drawn: set[str] = set()
    collapse_marks = False
    for p in data.points:
        steps, values = _series(p, metric)
        if not steps:
            continue
        s = style(p)
        ax.plot(steps, values, color=s.colour, ls=dash(p), lw=s.linewidth, marker=s.marker, ms=s.markersize,
                markevery=_mark_every(len(steps)), alpha=0.9, zorder=s.zorder)
        drawn.add(_freeze(data.group_values(p)))
        cstep = p.collapse.get("collapse_step") if p.collapse.get("collapsed") else None
        if _is_num(cstep):
            ax.plot([cstep], [_value_at(steps, values, cstep)], marker="X", ms=11, mew=1.2, color=s.colour,
                    markeredgecolor="black", linestyle="none", zorder=10)
            collapse_marks = True
    handles = legend_handles(drawn)
    if collapse_marks:
        handles.append(Line2D([], [], marker="X", ms=10, color="white", markeredgecolor="black", linestyle="none",
                              label="collapse step"))
    ax.set_title(f"{data.name}: {metric} vs step\n(one line per point: colour and marker = group, "
                 "line style = seed)")
    ax.set_xlabel("RL step")
    ax.set_ylabel(metric + (" (clean evaluation)" if metric.startswith("eval/") else " (training rollouts)"))
    _finish(ax, handles)
    figures["reward_curves.png"] = fig

    # mismatch vs step -----------------------------------------------------------------------
    fig, ax = plt.subplots(figsize=(10, 5.5))
    drawn = set()
    zero_groups = []
    for values, points in groups:
        key = _freeze(values)
        for p in points:
            steps, ks = _series(p, K3_KL)
            keep = [(s, k) for s, k in zip(steps, ks) if k > 0 and math.isfinite(k)]
            if keep:
                s = style(p)
                ax.plot(*zip(*keep), color=s.colour, ls=dash(p), lw=s.linewidth * 0.8, marker=s.marker,
                        ms=s.markersize * 0.8, markevery=_mark_every(len(keep)), alpha=0.9, zorder=s.zorder)
                drawn.add(key)
        if key not in drawn and any(_series(p, K3_KL)[0] for p in points):
            zero_groups.append(label_of[key])
    handles = legend_handles(drawn)
    handles += [Line2D([], [], color="none", label=f"{label}: k3 KL = 0 throughout (not drawable on a log axis)")
                for label in zero_groups]
    ax.set_title(f"{data.name}: realised mismatch vs step\n(one line per point: colour and marker = group, "
                 "line style = seed)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("k3 KL between rollout and training log-probs\n(log scale; zero values skipped)")
    if drawn:
        ax.set_yscale("log")
    _finish(ax, handles)
    figures["mismatch_vs_step.png"] = fig

    # collapse vs magnitude --------------------------------------------------------------------
    fig, ax = plt.subplots(figsize=(10, 5.5))
    pts = [(p, p.collapse.get("mean_k3_kl")) for p in data.points if p.has_result]
    pts = [(p, k) for p, k in pts if _is_num(k) and not math.isnan(k) and k >= 0]
    floor = _log_floor(k for _, k in pts)
    top = max((p.run_length for p, _ in pts), default=0)
    drawn = set()
    stacked: dict[tuple[float, float], int] = {}
    for p, k in pts:
        s = style(p)
        x = floor if k == 0 else k
        collapsed = p.collapse.get("collapsed") is True and _is_num(p.collapse.get("collapse_step"))
        y = p.collapse["collapse_step"] if collapsed else p.run_length
        stacked[(x, y)] = stacked.get((x, y), 0) + 1
        ax.scatter([x], [y], s=(s.markersize * 1.5) ** 2, marker=s.marker, zorder=s.zorder + 1, linewidths=1.8,
                   edgecolors=[s.colour], facecolors=[s.colour] if collapsed else "none")
        drawn.add(_freeze(data.group_values(p)))
    for (x, y), n in stacked.items():
        if n > 1:  # identical points (e.g. the seeds of a zero-mismatch group) would hide each other
            ax.annotate(f"×{n}", (x, y), xytext=(9, -13), textcoords="offset points", fontsize=8)
    handles = legend_handles(drawn, seeds=False)
    if pts:
        handles += [Line2D([], [], marker="o", ms=8, color="black", linestyle="none",
                           label="filled: collapsed (y = collapse step)"),
                    Line2D([], [], marker="o", ms=8, markerfacecolor="none", markeredgecolor="black",
                           linestyle="none", label="hollow: no collapse (y = run length)")]
        ax.axhline(top, color="grey", lw=0.8, ls=":", zorder=1)
        ax.set_ylim(0, max(top, 1) * 1.08)
    if any(k == 0 for _, k in pts):
        ax.axvline(floor, color="grey", lw=0.8, ls="--", zorder=1)
        handles.append(Line2D([], [], color="grey", lw=0.8, ls="--", label=f"zero mismatch, drawn at {floor:.0e}"))
    _log_x(ax)
    ax.set_title(f"{data.name}: when runs collapsed vs their realised mismatch (one marker per run)")
    ax.set_xlabel(REALISED_K3_WORDS)
    ax.set_ylabel("collapse step, or run length without collapse (RL steps)")
    _finish(ax, handles)
    figures["collapse_vs_magnitude.png"] = fig
    figures["outcome_vs_realised_k3.png"] = _outcome_vs_k3(data, group_table(data), style_of_group, label_of)
    return figures


REALISED_K3_WORDS = ("realised mismatch: k3 KL between rollout and training log-probs, mean over the run's steps "
                     "(log scale)")


def _outcome_vs_k3(data: SweepData, rows: list[dict[str, Any]], style_of_group: dict[str, GroupStyle],
                   label_of: dict[str, str]) -> Any:
    """outcome_vs_realised_k3.png: collapse rate (per group) and final reward (per run and group mean) against
    realised k3 -- the table's ``realised_k3_kl``, the run mean of ``rollout_corr/k3_kl`` (collapse.mean_k3_kl)."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True)
    by_group = {_freeze(values): points for values, points in data.groups()}
    xs = [r["realised_k3_kl"] for r in rows if r["realised_k3_kl"] is not None]
    xs += [p.collapse.get("mean_k3_kl") for pts in by_group.values() for p in pts if p.has_result]
    floor = _log_floor(x for x in xs if _is_num(x))
    place = lambda k: floor if k == 0 else k  # noqa: E731
    handles, any_rate, any_reward, zero = [], False, False, False
    for row in rows:
        key = _freeze(tuple(row.get(k) for k in data.group_keys))
        s = style_of_group.get(key)
        k3 = row["realised_k3_kl"]
        if s is None or k3 is None or not math.isfinite(k3):
            continue
        zero = zero or k3 == 0
        handles.append(Line2D([], [], color=s.colour, marker=s.marker, lw=0, ms=8, label=label_of[key]))
        if row["collapse_rate"] is not None:
            top.scatter([place(k3)], [row["collapse_rate"]], s=(s.markersize * 1.5) ** 2, marker=s.marker,
                        color=s.colour, zorder=s.zorder + 1, edgecolors="black", linewidths=0.6)
            top.annotate(f"{row['collapsed']}/{row['seeds']}", (place(k3), row["collapse_rate"]),
                         xytext=(8, 5), textcoords="offset points", fontsize=7, color=s.colour)
            any_rate = True
        for p in by_group[key]:
            final, k = reward_summary(p)["final"], p.collapse.get("mean_k3_kl")
            if p.has_result and final is not None and _is_num(k) and math.isfinite(k) and k >= 0:
                bottom.scatter([place(k)], [final], s=(s.markersize * 0.9) ** 2, marker=s.marker,
                               facecolors="none", edgecolors=[s.colour], linewidths=1.2, zorder=s.zorder)
                any_reward = True
        if row["final_reward"] is not None:
            bottom.scatter([place(k3)], [row["final_reward"]], s=(s.markersize * 1.5) ** 2, marker=s.marker,
                           color=s.colour, edgecolors="black", linewidths=0.6, zorder=s.zorder + 1)
    if any_reward:
        handles += [Line2D([], [], marker="o", ms=8, color="black", lw=0, label="filled: group (mean over seeds)"),
                    Line2D([], [], marker="o", ms=6, markerfacecolor="none", markeredgecolor="black", lw=0,
                           label="hollow: one run")]
    if zero:
        for ax in (top, bottom):
            ax.axvline(floor, color="grey", lw=0.8, ls="--", zorder=1)
        handles.append(Line2D([], [], color="grey", lw=0.8, ls="--", label=f"zero mismatch, drawn at {floor:.0e}"))
    top.set_ylim(-0.1, 1.15)
    top.set_ylabel("collapse rate\n(fraction of seeds that collapsed)")
    top.set_title(f"{data.name}: outcome vs realised mismatch")
    bottom.set_ylabel("final reward (smoothed)")
    bottom.set_xlabel(REALISED_K3_WORDS)
    if any_rate or any_reward:
        _log_x(bottom)
    _finish(top, handles if any_rate else [])
    _finish(bottom, [], legend=False)
    return fig


def _log_x(ax: Any) -> None:
    """A log x axis over the plotted points; a decade either side when they share one x (every run at zero
    mismatch), and linear when nothing is plotted (a log axis needs a positive range)."""
    xs = [float(x) for c in ax.collections for x, _ in c.get_offsets() if x > 0]
    if not xs:
        return
    if min(xs) == max(xs):
        ax.set_xlim(xs[0] / 10, xs[0] * 10)
    ax.set_xscale("log")


def _log_floor(values: Any) -> float:
    """Where a zero is drawn on a log axis: a decade below the smallest positive value."""
    positive = [v for v in values if 0 < v < math.inf]
    return min(positive) / 10 if positive else 1e-12


def _mark_every(n: int) -> int:
    """Markers on about 15 points of a line: enough to tell groups apart, few enough to see the line."""
    return max(1, n // 15)


def _series(p: PointData, key: str) -> tuple[list[float], list[float]]:
    pairs = [(float(m["step"]), float(m[key])) for m in p.metrics if _is_num(m.get("step")) and _is_num(m.get(key))]
    pairs = [(s, v) for s, v in pairs if not math.isnan(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _value_at(steps: list[float], values: list[float], step: float) -> float:
    """The series linearly interpolated at ``step`` (clamped to its ends), so a marker sits on the line."""
    if step <= steps[0]:
        return values[0]
    for (s0, v0), (s1, v1) in zip(zip(steps, values), zip(steps[1:], values[1:])):
        if s0 <= step <= s1:
            return v0 if s1 == s0 else v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    return values[-1]


def _finish(ax: Any, handles: list[Any], legend: bool = True) -> None:
    """Legend outside the axes (right), so it never covers data; "no data" when there is nothing to show."""
    if handles and legend:
        ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
                  frameon=False)
    elif not handles and not ax.has_data():
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", fontsize=14, color="grey")
    ax.grid(True, which="major", alpha=0.3)


def _save(fig: Any, path: Path) -> Path:
    # "tight" keeps the outside legend in the image
    publish(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- report


def write_report(sweep_dir: str | Path, console: Console | None = None, skip_damaged: bool = False) -> dict[str, Any]:
    """Load the sweep, write SWEEP_DIR/report/{summary.csv,table.json,table.md,*.png}, print the table.

    A damaged or unreadable point (``PointData.damage``) is a ValueError naming every such point, before anything
    is written -- unless ``skip_damaged``: then they are left out of every table and plot, and named in the printed
    output and under table.md. Prints "report written to ..." once, naming the files (callers print nothing more
    about it). Returns ``{"rows": group rows, "files": [Path, ...], "skipped": [damaged point names]}``.
    """
    console = console or Console()
    data = read_sweep_results(sweep_dir)
    damaged = [p for p in data.points if p.damage]
    if damaged and not skip_damaged:
        raise damaged_points_error(data.path, damaged)
    data.points = [p for p in data.points if not p.damage]
    out = data.path / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    rows = group_table(data)
    files = [write_summary_csv(data, out / "summary.csv")]
    write_json_atomic(out / "table.json", rows, sort_keys=False)
    notes = [reward_definition(data.points)]
    if damaged:
        notes.append(f"Left out (damaged or unreadable, --skip-damaged): {_damage_list(damaged)}.")
    write_text_atomic(out / "table.md", markdown_table(rows, title=data.name, notes=notes))
    files += [out / "table.json", out / "table.md"]
    from .dose_response import dose_response, plot_dose_response, threshold_words  # they build on this module
    from .dynamics import mismatch_dynamics

    doses = dose_response(data)
    dynamics = mismatch_dynamics(data)
    write_json_atomic(out / "dose_response.json", doses, sort_keys=False)
    write_json_atomic(out / "dynamics.json", dynamics, sort_keys=False)
    files += [out / "dose_response.json", out / "dynamics.json"]
    try:
        files += plot_sweep(data, out)
        files.append(plot_dose_response(doses, out / "dose_response.png", data.name))
    except ImportError as e:
        console.print(f"[yellow]plots skipped: {e}[/]")
    render_table(rows, console, title=data.name, notes=notes)
    _render_dynamics(dynamics, console)
    for curve in doses["curves"]:
        console.print(f"dose-response {curve['curve']}: {threshold_words(curve['threshold'])}")
        console.print(f"  {curve['threshold']['note']}", soft_wrap=True)
    from .scaling import write_scaling  # issue O: threshold vs horizon (scaling.json / .png)

    scaling_files, scaling_text = write_scaling(data, out)
    files += scaling_files
    console.print(scaling_text, markup=False, soft_wrap=True)
    failed = [p for p in data.points if p.status == "failed"]
    for p in failed:
        console.print(f"[red]failed:[/] {p.name}" + (f" -- {p.error}" if p.error else ""))
    for p in damaged:
        console.print(f"skipped damaged point {p.name}: {', '.join(p.damage)}", markup=False, highlight=False,
                      soft_wrap=True)
    written_line(console, out, files)
    return {"rows": rows, "files": files, "skipped": [p.name for p in damaged]}


def written_line(console: Console, out: Path, files: list[Path]) -> None:
    """The one line that says where a report went (the CLI prints no second one)."""
    names = ", ".join(f.name if f.parent == out else str(f) for f in files)
    console.print(f"report written to {out}: {names}", markup=False, highlight=False, soft_wrap=True)


def _render_dynamics(dynamics: list[dict[str, Any]], console: Console) -> None:
    """The mismatch-dynamics table, for groups with a positive realised k3 (nothing when none has one)."""
    rows = [d for d in dynamics if d.get("runs")]
    if not rows:
        return
    corr = lambda d, k: "—" if d["corr"][k] is None else f"{d['corr'][k]:+.2f}"  # noqa: E731
    columns = [TextColumn("group", [d["group"] for d in rows], justify="left", wrap=True, style="cyan"),
               TextColumn("runs", [str(d["runs"]) for d in rows], short="n"),
               TextColumn("k3 early", [_fmt_sci(d["k3_early"]) for d in rows], short="early"),
               TextColumn("k3 late", [_fmt_sci(d["k3_late"]) for d in rows], short="late"),
               TextColumn("growing", [f"{d['runs_growing']}/{d['runs']}" for d in rows], short="grew"),
               TextColumn("corr entropy", [corr(d, "entropy") for d in rows], short="c.ent"),
               TextColumn("corr grad norm", [corr(d, "grad_norm") for d in rows], short="c.gn"),
               TextColumn("corr length", [corr(d, "response_length") for d in rows], short="c.len")]
    print_table(console, "mismatch during the run (corr = Pearson of log k3 with the metric over steps)", columns)


# ----------------------------------------------------------------------------- helpers


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(values: Any) -> list[float]:
    return [float(v) for v in values if _is_num(v) and not math.isnan(v)]


def _mean(values: Any) -> float | None:
    vals = _finite(values)
    return sum(vals) / len(vals) if vals else None


def _median(values: Any) -> float | None:
    vals = _finite(values)
    return statistics.median(vals) if vals else None


def _freeze(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return "—" if v is None else str(v)


def _fmt_sci(v: float | None) -> str:
    if v is None:
        return "—"
    return "0" if v == 0 else f"{v:.1e}"


def _fmt_float(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


def _fmt_step(v: float | None) -> str:
    if v is None:
        return "—"
    return str(int(v)) if float(v).is_integer() else f"{v:.1f}"
