"""Summarise a ``vexact sweep`` directory: per-group table, per-point CSV, and plots.

A *group* is one magnitude setting: all points sharing the values of every grid key except
``seed``. ``write_report(sweep_dir)`` writes everything into ``SWEEP_DIR/report/``:

    summary.csv                 one row per point (overrides, status, every collapse field)
    table.json / table.md       one row per group (realised mismatch, collapse rate, ...)
    reward_curves.png           eval reward vs step, one line per point, coloured by group
    mismatch_vs_step.png        rollout-correction k3 KL vs step (log y)
    collapse_vs_magnitude.png   collapse step vs realised k3 KL (log x)
    dose_response.json / .png   collapse probability vs realised k3 KL and the fitted 50% threshold
                                (``vexact/lab/dose_response.py``)
    dynamics.json               does the realised k3 grow during runs, and what it moves with
                                (``vexact/lab/dynamics.py``)
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..rl.config import dotted_items
from ..rl.runlog import json_safe

SEED_KEY = "seed"
RESULT_STATUSES = ("completed", "stopped")  # points that ran to a verdict (the collapse-rate denominator)
REPORT_DIR = "report"
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf,
               "infinity": math.inf, "-infinity": -math.inf}


# ----------------------------------------------------------------------------- loading


@dataclass
class PointData:
    """One sweep point: its overrides, status, summary.json (or None) and metrics.jsonl lines."""

    name: str
    dir: Path
    overrides: dict[str, Any]
    status: str
    error: str | None = None
    summary: dict[str, Any] | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)

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
        summary = _read_json(point_dir / "summary.json")
        status = entry.get("status") or (summary or {}).get("status") or "pending"
        points.append(PointData(name=name, dir=point_dir, overrides=dict(entry.get("overrides") or {}),
                                status=str(status), error=entry.get("error"), summary=summary,
                                metrics=_read_jsonl(point_dir / "metrics.jsonl")))
    if grid:
        group_keys = [k for k in grid if k != SEED_KEY]
    else:  # no grid recorded: group by every override except the seed
        group_keys = list(dict.fromkeys(k for p in points for k in p.overrides if k != SEED_KEY))
    curves = spec.get("curves")
    return SweepData(path=sweep_dir, name=str(spec.get("name") or sweep_dir.name), grid=grid,
                     group_keys=group_keys, points=points, curves=list(curves) if isinstance(curves, list) else None)


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return _decode_non_finite(json.loads(path.read_text()))
    except json.JSONDecodeError:
        return None


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(_decode_non_finite(json.loads(line)))
        except json.JSONDecodeError:  # a line cut short by an interrupt
            continue
    return rows


def _decode_non_finite(value: Any) -> Any:
    """Undo runlog's encoding of NaN/Inf as strings."""
    if isinstance(value, str) and value.lower() in _NON_FINITE:
        return _NON_FINITE[value.lower()]
    if isinstance(value, dict):
        return {k: _decode_non_finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_non_finite(v) for v in value]
    return value


# ----------------------------------------------------------------------------- tables


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
            "peak_reward": _mean(p.collapse.get("peak_reward") for p in done),
            "final_reward": _mean(p.collapse.get("final_reward") for p in done),
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
    """One row per point: name, group, overrides, status, error, run length and every collapse field (flat)."""
    rows = []
    for p in data.points:
        row: dict[str, Any] = {"name": p.name, "group": data.group_label(data.group_values(p))}
        row.update(p.overrides)
        summary = p.summary or {}
        row.update({"status": p.status, "error": p.error, "reason": summary.get("reason"),
                    "steps_completed": summary.get("steps_completed")})
        row.update(dotted_items(p.collapse))
        rows.append(row)
    columns = list(dict.fromkeys(k for row in rows for k in row)) or ["name", "status"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_cell(v) for k, v in row.items()})
    return path


def _csv_cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return json.dumps(v)
    return v


_COLUMNS = [  # (row key, header, formatter)
    ("seeds", "seeds", lambda r: str(r["seeds"])),
    ("realised_k3_kl", "realised k3 KL", lambda r: _fmt_sci(r["realised_k3_kl"])),
    ("realised_abs_dlogp", "realised |Δlogp|", lambda r: _fmt_sci(r["realised_abs_dlogp"])),
    ("collapse_rate", "collapse rate", lambda r: f"{r['collapsed']}/{r['seeds']}" if r["seeds"] else "—"),
    ("median_collapse_step", "median collapse step", lambda r: _fmt_step(r["median_collapse_step"])),
    ("peak_reward", "peak reward", lambda r: _fmt_float(r["peak_reward"])),
    ("final_reward", "final reward", lambda r: _fmt_float(r["final_reward"])),
    ("length_surge_lead_median", "surge lead", lambda r: _fmt_step(r["length_surge_lead_median"])),
    ("surge_before_collapse", "surge before collapse",
     lambda r: f"{r['surge_before_collapse']}/{r['collapsed']}" if r["collapsed"] else "—"),
    # shown only when some group has a triggered LR schedule:
    ("lr_decay_triggered", "LR decay fired", lambda r: "—" if r.get("lr_decay_triggered") is None
     else f"{r['lr_decay_triggered']}/{r['seeds']}"),
    ("lr_trigger_step_median", "median trigger step", lambda r: _fmt_step(r.get("lr_trigger_step_median"))),
]
_OPTIONAL = {"lr_decay_triggered", "lr_trigger_step_median"}


def _table_cells(rows: list[dict[str, Any]], group_keys: list[str]) -> tuple[list[str], list[list[str]]]:
    """Headers and formatted cells shared by the rich and Markdown tables."""
    show_failed = any(r.get("failed") for r in rows)
    columns = [c for c in _COLUMNS[1:] if c[0] not in _OPTIONAL or any(r.get(c[0]) is not None for r in rows)]
    headers = list(group_keys) or ["group"]
    headers += [h for _, h, _ in _COLUMNS[:1]] + (["failed"] if show_failed else []) + [h for _, h, _ in columns]
    body = []
    for r in rows:
        cells = [_fmt_value(r.get(k)) for k in group_keys] if group_keys else [str(r.get("group", "all"))]
        cells += [_COLUMNS[0][2](r)] + ([str(r.get("failed", 0))] if show_failed else [])
        cells += [fmt(r) for _, _, fmt in columns]
        body.append(cells)
    return headers, body


def _row_group_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The group keys of rows from ``group_table`` (the keys before the fixed ``group`` column)."""
    if not rows:
        return []
    keys = list(rows[0])
    return keys[:keys.index("group")] if "group" in keys else []


def render_table(rows: list[dict[str, Any]], console: Console | None = None, title: str = "sweep") -> Table:
    """Print the group rows as a rich Table titled with the sweep name; returns the Table."""
    headers, body = _table_cells(rows, _row_group_keys(rows))
    n_keys = max(len(_row_group_keys(rows)), 1)
    table = Table(title=title)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i < n_keys else "right", style="cyan" if i < n_keys else None)
    for cells in body:
        table.add_row(*cells)
    (console or Console()).print(table)
    return table


def markdown_table(rows: list[dict[str, Any]], title: str | None = None) -> str:
    """The group rows as a GitHub-flavoured Markdown table (group keys left-aligned, numbers right-aligned)."""
    group_keys = _row_group_keys(rows)
    headers, body = _table_cells(rows, group_keys)
    n_keys = max(len(group_keys), 1)
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = [f"### {title}", ""] if title else []
    lines.append("| " + " | ".join(esc(h) for h in headers) + " |")
    lines.append("|" + "|".join(":---" if i < n_keys else "---:" for i in range(len(headers))) + "|")
    lines += ["| " + " | ".join(esc(c) for c in cells) + " |" for cells in body]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- plots


def plot_sweep(data: SweepData, out_dir: str | Path) -> list[Path]:
    """Write reward_curves.png, mismatch_vs_step.png and collapse_vs_magnitude.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = data.groups()
    if "variant" in data.group_keys and len(groups) <= 10:  # named remedies: distinct colours, not a scale
        cmap = plt.get_cmap("tab10")
        colours = {_freeze(values): cmap(i) for i, (values, _) in enumerate(groups)}
    else:  # magnitudes: an ordered colour scale
        cmap = plt.get_cmap("viridis")
        colours = {_freeze(values): cmap(0.8 * i / max(len(groups) - 1, 1)) for i, (values, _) in enumerate(groups)}
    colour_of = lambda p: colours[_freeze(data.group_values(p))]  # noqa: E731
    label_of = {_freeze(values): data.group_label(values) for values, _ in groups}
    written = []

    # reward curves ------------------------------------------------------------------------
    metric = "eval/reward_mean"
    if not any(_is_num(m.get(metric)) for p in data.points for m in p.metrics):
        metric = "reward/mean"  # no eval steps at all: fall back to the training reward
    fig, ax = plt.subplots(figsize=(9, 5.5))
    labelled: set[str] = set()
    any_line = False
    for p in data.points:
        steps, values = _series(p, metric)
        if not steps:
            continue
        key = _freeze(data.group_values(p))
        ax.plot(steps, values, color=colour_of(p), alpha=0.85, lw=1.4, marker="." if len(steps) < 40 else None,
                label=None if key in labelled else label_of[key])
        labelled.add(key)
        any_line = True
        cstep = p.collapse.get("collapse_step") if p.collapse.get("collapsed") else None
        if _is_num(cstep):
            ax.plot([cstep], [_value_at(steps, values, cstep)], marker="x", ms=9, mew=2, color=colour_of(p),
                    linestyle="none")
    if any(p.collapse.get("collapsed") and _is_num(p.collapse.get("collapse_step")) for p in data.points):
        ax.plot([], [], marker="x", color="black", linestyle="none", label="collapse step")
    ax.set_title(f"{data.name}: {metric} vs step (one line per point, seeds share a colour)")
    ax.set_xlabel("RL step")
    ax.set_ylabel(metric + (" (clean evaluation)" if metric.startswith("eval/") else " (training rollouts)"))
    _finish(ax, any_line)
    written.append(_save(fig, out_dir / "reward_curves.png"))

    # mismatch vs step -----------------------------------------------------------------------
    fig, ax = plt.subplots(figsize=(9, 5.5))
    labelled = set()
    zero_groups = []
    for values, points in groups:
        key = _freeze(values)
        drawn = False
        for p in points:
            steps, ks = _series(p, "rollout_corr/k3_kl")
            keep = [(s, k) for s, k in zip(steps, ks) if k > 0 and math.isfinite(k)]
            if keep:
                ax.plot(*zip(*keep), color=colours[key], alpha=0.85, lw=1.2,
                        label=None if key in labelled else label_of[key])
                labelled.add(key)
                drawn = True
        if not drawn and any(_series(p, "rollout_corr/k3_kl")[0] for p in points):
            zero_groups.append(label_of[key])
    for label in zero_groups:
        ax.plot([], [], color="none", label=f"{label}: k3 KL = 0 throughout (not drawable on log axis)")
    ax.set_title(f"{data.name}: rollout-correction k3 KL vs step (one line per point)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("rollout_corr/k3_kl (log scale; non-positive values skipped)")
    if labelled:
        ax.set_yscale("log")
    _finish(ax, bool(labelled) or bool(zero_groups))
    written.append(_save(fig, out_dir / "mismatch_vs_step.png"))

    # collapse vs magnitude --------------------------------------------------------------------
    fig, ax = plt.subplots(figsize=(9, 5.5))
    pts = [(p, p.collapse.get("mean_k3_kl")) for p in data.points if p.has_result]
    pts = [(p, k) for p, k in pts if _is_num(k) and not math.isnan(k) and k >= 0]
    positive = [k for _, k in pts if 0 < k < math.inf]
    floor = min(positive) / 10 if positive else 1e-12
    top = max((p.run_length for p, _ in pts), default=0)
    labelled = set()
    stacked: dict[tuple[float, float], int] = {}
    for p, k in pts:
        key = _freeze(data.group_values(p))
        x = floor if k == 0 else k
        collapsed = p.collapse.get("collapsed") is True and _is_num(p.collapse.get("collapse_step"))
        y = p.collapse["collapse_step"] if collapsed else p.run_length
        stacked[(x, y)] = stacked.get((x, y), 0) + 1
        ax.scatter([x], [y], s=70, zorder=3, linewidths=1.8, edgecolors=colours[key],
                   facecolors=colours[key] if collapsed else "none",
                   label=None if key in labelled else label_of[key])
        labelled.add(key)
    for (x, y), n in stacked.items():
        if n > 1:  # identical points (e.g. the seeds of a zero-mismatch group) would hide each other
            ax.annotate(f"×{n}", (x, y), xytext=(7, -12), textcoords="offset points", fontsize=8)
    if pts:
        ax.scatter([], [], s=70, facecolors="black", edgecolors="black", label="collapsed (y = collapse step)")
        ax.scatter([], [], s=70, facecolors="none", edgecolors="black", linewidths=1.8,
                   label="no collapse (y = run length)")
        ax.axhline(top, color="grey", lw=0.8, ls=":", zorder=1)
        ax.set_ylim(0, max(top, 1) * 1.08)
    if any(k == 0 for _, k in pts):
        ax.axvline(floor, color="grey", lw=0.8, ls="--", zorder=1)
        ax.plot([], [], color="grey", lw=0.8, ls="--", label=f"k3 KL = 0, drawn at floor {floor:.0e}")
    ax.set_xscale("log")
    ax.set_title(f"{data.name}: collapse step vs realised mismatch (one marker per point)")
    ax.set_xlabel("realised k3 KL per point (collapse.mean_k3_kl, log scale)")
    ax.set_ylabel("collapse step (RL step)")
    _finish(ax, bool(pts))
    written.append(_save(fig, out_dir / "collapse_vs_magnitude.png"))
    plt.close("all")
    return written


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


def _finish(ax: Any, has_data: bool) -> None:
    if has_data:
        ax.legend(fontsize=8, loc="best", framealpha=0.85)
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", fontsize=14, color="grey")
    ax.grid(True, which="major", alpha=0.3)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# ----------------------------------------------------------------------------- report


def write_report(sweep_dir: str | Path, console: Console | None = None) -> dict[str, Any]:
    """Load the sweep, write SWEEP_DIR/report/{summary.csv,table.json,table.md,*.png}, print the table.

    Returns ``{"rows": group rows, "files": [Path, ...]}``.
    """
    console = console or Console()
    data = read_sweep_results(sweep_dir)
    out = data.path / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    rows = group_table(data)
    files = [write_summary_csv(data, out / "summary.csv")]
    (out / "table.json").write_text(json.dumps(json_safe(rows), indent=2) + "\n")
    (out / "table.md").write_text(markdown_table(rows, title=data.name))
    files += [out / "table.json", out / "table.md"]
    from .dose_response import dose_response, plot_dose_response, threshold_words  # they build on this module
    from .dynamics import mismatch_dynamics

    doses = dose_response(data)
    dynamics = mismatch_dynamics(data)
    (out / "dose_response.json").write_text(json.dumps(json_safe(doses), indent=2) + "\n")
    (out / "dynamics.json").write_text(json.dumps(json_safe(dynamics), indent=2) + "\n")
    files += [out / "dose_response.json", out / "dynamics.json"]
    try:
        files += plot_sweep(data, out)
        files.append(plot_dose_response(doses, out / "dose_response.png", data.name))
    except ImportError as e:
        console.print(f"[yellow]plots skipped: {e}[/]")
    render_table(rows, console, title=data.name)
    _render_dynamics(dynamics, console)
    for curve in doses["curves"]:
        console.print(f"dose-response {curve['curve']}: {threshold_words(curve['threshold'])}")
        console.print(f"  {curve['threshold']['note']}", soft_wrap=True)
    failed = [p for p in data.points if p.status == "failed"]
    for p in failed:
        console.print(f"[red]failed:[/] {p.name}" + (f" -- {p.error}" if p.error else ""))
    console.print(f"report written to {out}")
    return {"rows": rows, "files": files}


def _render_dynamics(dynamics: list[dict[str, Any]], console: Console) -> None:
    """The mismatch-dynamics table, for groups with a positive realised k3 (nothing when none has one)."""
    rows = [d for d in dynamics if d.get("runs")]
    if not rows:
        return
    table = Table(title="mismatch during the run (corr = Pearson of log k3 with the metric over steps)")
    for h in ("group", "runs", "k3 early", "k3 late", "growing", "corr entropy", "corr grad norm", "corr length"):
        table.add_column(h, justify="left" if h == "group" else "right")
    corr = lambda d, k: "—" if d["corr"][k] is None else f"{d['corr'][k]:+.2f}"  # noqa: E731
    for d in rows:
        table.add_row(d["group"], str(d["runs"]), _fmt_sci(d["k3_early"]), _fmt_sci(d["k3_late"]),
                      f"{d['runs_growing']}/{d['runs']}", corr(d, "entropy"), corr(d, "grad_norm"),
                      corr(d, "response_length"))
    console.print(table)


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
