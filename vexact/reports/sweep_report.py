"""Summarise a ``vexact sweep`` directory: per-group table, per-point CSV, and plots.

``write_report(sweep_dir)`` reads the sweep (``sweep_data``) and writes everything into ``SWEEP_DIR/report/``:

    summary.csv                 one row per point (overrides, status, every collapse field)   (``sweep_table``)
    table.json / table.md       one row per group (realised mismatch, collapse rate, ...)     (``sweep_table``)
    reward_curves.png           eval reward vs step, one line per point (colour + marker = group, line style = seed)
    mismatch_vs_step.png        rollout-correction k3 KL vs step (log y)
    collapse_vs_magnitude.png   collapse step vs realised k3 KL (log x)
    outcome_vs_realised_k3.png  collapse rate and final reward vs realised k3 KL (log x)       (``sweep_plots``)
    dose_response.json / .png   collapse probability vs realised k3 KL and the fitted 50% threshold
                                (``vexact/sweeps/dose_response.py``)
    dynamics.json               does the realised k3 grow during runs, and what it moves with
                                (``vexact/sweeps/dynamics.py``)
    scaling.json / .png         the collapse threshold against the response horizon (``vexact/map/scaling_report.py``)
    failures.json               each collapse's failure: length lost, limit overrun or reward lost at intact length
                                (``vexact/sweeps/failure.py``)

and prints the tables (``text_table.print_table``: they fit the terminal without ever cutting a number). A single
run directory is reported by ``vexact/reports/run_report.py``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from ..map.scaling_report import write_scaling
from ..records.atomic import write_json_atomic, write_text_atomic
from ..sweeps.dose_response import dose_response, plot_dose_response, threshold_words
from ..sweeps.dynamics import mismatch_dynamics
from ..sweeps.failure import failure_summary, failure_table, failure_words
from ..sweeps.sweep_data import damage_list, damaged_points_error, read_sweep_results
from ..sweeps.text_table import TextColumn, fmt_sci, print_table
from .sweep_plots import plot_sweep
from .sweep_table import group_markdown, group_table, render_table, reward_definition, write_summary_csv

REPORT_DIR = "report"


def report_folder(parent: Path) -> Path:
    """PARENT/report, made if missing. A file (or anything but a folder) of that name is one error saying what to
    do -- mkdir's own is a bare "File exists: PATH"."""
    out = parent / REPORT_DIR
    if (out.exists() or out.is_symlink()) and not out.is_dir():
        raise ValueError(f"{out} is a file; the report is written into a folder of that name: move the file away "
                         "and run vexact report again")
    out.mkdir(parents=True, exist_ok=True)
    return out


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
    out = report_folder(data.path)
    rows = group_table(data)
    files = [write_summary_csv(data, out / "summary.csv")]
    write_json_atomic(out / "table.json", rows, sort_keys=False)
    notes = [reward_definition(data.points)]
    unfinished = [p for p in data.points if not p.has_result and p.status != "failed"]  # failed ones are named below
    if unfinished:
        counts = Counter(p.status for p in unfinished)
        notes.append(f"{len(unfinished)} of {len(data.points)} points have no result yet "
                     f"({', '.join(f'{n} {status}' for status, n in counts.items())}): the tables cover the points "
                     "that finished; re-running the sweep runs or resumes the others.")
    if damaged:
        notes.append(f"Left out (damaged or unreadable, --skip-damaged): {damage_list(damaged)}.")
    write_text_atomic(out / "table.md", group_markdown(rows, title=data.name, notes=notes))
    files += [out / "table.json", out / "table.md"]
    doses = dose_response(data)
    dynamics = mismatch_dynamics(data)
    write_json_atomic(out / "dose_response.json", doses, sort_keys=False)
    write_json_atomic(out / "dynamics.json", dynamics, sort_keys=False)
    files += [out / "dose_response.json", out / "dynamics.json"]
    try:
        files += plot_sweep(data, out)
        files.append(plot_dose_response(doses, out / "dose_response.png", data.name))
    except ImportError as e:
        console.print(f"[yellow]plots skipped: {escape(str(e))}[/]")
    render_table(rows, console, title=data.name, notes=notes)
    _render_dynamics(dynamics, console)
    for curve in doses["curves"]:
        console.print(f"dose-response {curve['curve']}: {threshold_words(curve['threshold'])}", markup=False)
        console.print(f"  {curve['threshold']['note']}", markup=False, soft_wrap=True)
    failures = failure_table([p for p in data.points if p.has_result])
    write_json_atomic(out / "failures.json", failures, sort_keys=False)
    files.append(out / "failures.json")
    console.print(failure_summary(failures), markup=False, soft_wrap=True)
    for f in failures:
        console.print(f"  {f['point']}: {failure_words(f)}", markup=False, highlight=False, soft_wrap=True)
    scaling_files, scaling_text = write_scaling(data, out)
    files += scaling_files
    console.print(scaling_text, markup=False, soft_wrap=True)
    failed = [p for p in data.points if p.status == "failed"]
    for p in failed:
        console.print(f"[red]failed:[/] {escape(p.name)}" + (f" -- {escape(p.error)}" if p.error else ""))
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
               TextColumn("k3 early", [fmt_sci(d["k3_early"]) for d in rows], short="early"),
               TextColumn("k3 late", [fmt_sci(d["k3_late"]) for d in rows], short="late"),
               TextColumn("growing", [f"{d['runs_growing']}/{d['runs']}" for d in rows], short="grew"),
               TextColumn("corr entropy", [corr(d, "entropy") for d in rows], short="c.ent"),
               TextColumn("corr grad norm", [corr(d, "grad_norm") for d in rows], short="c.gn"),
               TextColumn("corr length", [corr(d, "response_length") for d in rows], short="c.len")]
    print_table(console, "mismatch during the run (corr = Pearson of log k3 with the metric over steps)", columns)
