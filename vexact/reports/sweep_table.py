"""A sweep's tables: one row per group (``group_table``: realised mismatch, collapse rate, peak and final reward,
...), printed, as Markdown (``group_markdown``) and as JSON, and one CSV row per point (``write_summary_csv``).

"Peak reward" and "final reward" share one definition (``reward_summary``): the series the collapse detector
judges, smoothed as it smooths it; the tables say so in a footnote.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..records.atomic import write_text_atomic
from ..rl.collapse import trailing_mean
from ..rl.config import dotted_items
from ..rl.config_schema import CollapseSection
from ..sweeps.markdown_table import markdown_table
from ..sweeps.sweep_data import PointData, SweepData, is_num, mean, median, metric_series
from ..sweeps.text_table import TextColumn, fmt_float, fmt_sci, fmt_step, fmt_value, print_table


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
    smoothing = int(smoothing) if is_num(smoothing) and smoothing >= 1 else defaults.smoothing
    pairs = sorted((s, v) for s, v in zip(*metric_series(point, metric)) if math.isfinite(v))
    out: dict[str, Any] = {"metric": metric, "smoothing": smoothing, "peak": None, "peak_step": None,
                           "final": None, "final_step": None, "points": len(pairs)}
    if not pairs:
        peak = point.collapse.get("peak_reward")
        if is_num(peak) and math.isfinite(peak):
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
            "realised_k3_kl": mean(p.collapse.get("mean_k3_kl") for p in done),
            "realised_abs_dlogp": mean(p.collapse.get("mean_abs_dlogp") for p in done),
            "collapse_rate": len(collapsed) / len(done) if done else None,
            "median_collapse_step": median(p.collapse.get("collapse_step") for p in collapsed),
            # runs that fell below the drop but ended before the detector's patience ran out (a late drop, or a run
            # too short to confirm it): not collapses, and not survivals either; None when no run of the sweep has one
            "unconfirmed": sum(p.dropped_unconfirmed for p in done),
            "peak_reward": mean(reward_summary(p)["peak"] for p in done),  # one definition: reward_summary
            "final_reward": mean(reward_summary(p)["final"] for p in done),
            "length_surge_lead_median": median(p.collapse.get("length_surge_lead") for p in done),
            "surge_before_collapse": sum(p.collapse.get("length_surge_lead") is not None for p in collapsed),
            "lr_decay_triggered": _count_triggered(done),
            "lr_trigger_step_median": median(_lr_schedule(p).get("trigger_step") for p in done),
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
    ("realised_k3_kl", "realised k3 KL", "k3", lambda r: fmt_sci(r["realised_k3_kl"])),
    ("realised_abs_dlogp", "realised |Δlogp|", "|Δlp|", lambda r: fmt_sci(r["realised_abs_dlogp"])),
    ("collapse_rate", "collapse rate", "coll", lambda r: f"{r['collapsed']}/{r['seeds']}" if r["seeds"] else "—"),
    ("median_collapse_step", "median collapse step", "c.step", lambda r: fmt_step(r["median_collapse_step"])),
    # shown only when some run dropped without confirmation:
    ("unconfirmed", "dropped, unconfirmed at the end", "unconf",
     lambda r: "—" if r.get("unconfirmed") is None else f"{r['unconfirmed']}/{r['seeds']}"),
    ("peak_reward", "peak reward (smoothed)", "peak", lambda r: fmt_float(r["peak_reward"])),
    ("final_reward", "final reward (smoothed)", "final", lambda r: fmt_float(r["final_reward"])),
    ("length_surge_lead_median", "surge lead", "lead", lambda r: fmt_step(r["length_surge_lead_median"])),
    ("surge_before_collapse", "surge before collapse", "surge",
     lambda r: f"{r['surge_before_collapse']}/{r['collapsed']}" if r["collapsed"] else "—"),
    # shown only when some group has a triggered LR schedule:
    ("lr_decay_triggered", "LR decay fired", "LR", lambda r: "—" if r.get("lr_decay_triggered") is None
     else f"{r['lr_decay_triggered']}/{r['seeds']}"),
    ("lr_trigger_step_median", "median trigger step", "t.step", lambda r: fmt_step(r.get("lr_trigger_step_median"))),
]
_OPTIONAL = {"lr_decay_triggered", "lr_trigger_step_median", "unconfirmed"}


def _shown(value: Any, key: str) -> bool:
    """Whether an optional column's cell asks for the column: any LR-schedule value, a non-zero unconfirmed count."""
    return bool(value) if key == "unconfirmed" else value is not None


def _group_columns(rows: list[dict[str, Any]], group_keys: list[str]) -> list[TextColumn]:
    """The group table's columns (shared by the terminal and Markdown tables)."""
    show_failed = any(r.get("failed") for r in rows)
    columns = [c for c in _COLUMNS[1:] if c[0] not in _OPTIONAL or any(_shown(r.get(c[0]), c[0]) for r in rows)]
    tails = [k.rsplit(".", 1)[-1] for k in group_keys]
    out = [TextColumn(k, [fmt_value(r.get(k)) for r in rows], short=tail if tails.count(tail) == 1 else k,
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


def group_markdown(rows: list[dict[str, Any]], title: str | None = None, notes: list[str] | None = None) -> str:
    """The group rows as a GitHub-flavoured Markdown table (group keys left-aligned, numbers right-aligned),
    followed by ``notes`` (default: what peak / final reward mean)."""
    group_keys = _row_group_keys(rows)
    headers, body = _table_cells(rows, group_keys)
    n_keys = max(len(group_keys), 1)
    lines = [f"### {title}", ""] if title else []
    lines.append(markdown_table(headers, body, ["left" if i < n_keys else "right" for i in range(len(headers))]))
    notes = [reward_definition([])] if notes is None else notes
    if notes:
        lines += [""] + notes
    return "\n".join(lines) + "\n"
