"""Report on one run directory: ``vexact report RUN_DIR`` (a ``vexact run`` output, or one point of a sweep).

The run is read by the sweep report's reader (``sweep_data.read_point``) and its reward summarised by the same
``sweep_table.reward_summary``, so a run shows the same numbers alone as in its sweep's table. Written to
``RUN_DIR/report/``:

    run_curves.png   six panels against the RL step: reward (training rollouts, clean evaluation, and the smoothed
                     series the collapse detector judges), realised mismatch (k3 KL, log y), policy entropy,
                     response length (with the surge threshold), learning rate and grad norm; every panel marks
                     the collapse step, an unconfirmed collapse candidate, the response-length surge and the
                     LR-decay trigger, where the run has them
    report.json      what the terminal table shows, plus each tracked metric's ``series``: the steps logging it,
                     how many were NaN/Inf, and first/last/mean/min/max of its finite values (null when none), and
                     a run's ``failure`` when it collapsed on its reward (``vexact/sweeps/failure.py``: length lost,
                     limit overrun, or reward lost at intact length; null for a collapse on another trigger)

The verdict is summary.json's ``collapse`` (what the trainer decided). A run without summary.json (still running,
or killed) is judged here by ``detect_collapse`` with its config.yaml's ``collapse`` settings, and the report says
so (``collapse_source``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from ..metric_keys import (
    ABS_DLOGP_MEAN,
    CHI2_TOKEN,
    ENTROPY,
    EVAL_REWARD_MEAN,
    GRAD_NORM,
    K3_KL,
    LR,
    LR_SCHEDULE_TRIGGERED,
    RESPONSE_LENGTH_MEAN,
    REWARD_MEAN,
)
from ..records import CONFIG_FILE, RUN_FILES, SUMMARY_FILE, is_run_dir
from ..records.atomic import publish, write_json_atomic
from ..rl.collapse import detect_collapse, trailing_mean
from ..rl.config import load_config
from ..rl.config_schema import CollapseSection, RunConfig
from ..sweeps.failure import failure_of, failure_words
from ..sweeps.sweep_data import PointData, collapse_step_of, damaged_points_error, is_num, metric_series, read_point
from ..sweeps.text_table import TextColumn, fmt_float, fmt_sci, print_table
from .sweep_plots import undrawn_k3_words
from .sweep_report import report_folder, write_report, written_line
from .sweep_table import reward_definition, reward_summary

TRACKED = {  # metric -> what it is, in words (report.json "series", the plot's panels)
    REWARD_MEAN: "training reward (rollouts)",
    EVAL_REWARD_MEAN: "clean evaluation reward",
    K3_KL: "realised k3 KL",
    ABS_DLOGP_MEAN: "realised |Δlogp|",
    CHI2_TOKEN: "chi2_token",
    ENTROPY: "policy entropy",
    RESPONSE_LENGTH_MEAN: "response length",
    LR: "learning rate",
    GRAD_NORM: "grad norm",
}
CHI2_NOTE = ("chi2_token estimates E[ρ²] − 1 (ρ = training / rollout token probability) as mean(ρ²) − 1 over "
             "each batch's tokens. Its expectation is >= 0, but the estimate can come out slightly negative when "
             "the two log-probs nearly agree: read a small negative value as ≈ 0.")


@dataclass
class RunData:
    """One run: the shared ``PointData`` plus its config (None when config.yaml is missing or unreadable)."""

    point: PointData
    config: RunConfig | None
    collapse_source: str
    notes: list[str] = field(default_factory=list)

    @property
    def collapse_settings(self) -> CollapseSection:
        return self.config.collapse if self.config is not None else CollapseSection()


def read_run(run_dir: str | Path) -> RunData:
    """Load a run directory; ValueError when it is not one."""
    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise ValueError(f"{run_dir} is not a run directory: neither {' nor '.join(RUN_FILES)} found")
    notes = []
    config = None
    if (run_dir / CONFIG_FILE).is_file():
        try:
            config = load_config(run_dir / CONFIG_FILE, saved=True)
        except (ValueError, OSError) as e:  # an old or hand-edited config: report without it
            notes.append(f"config.yaml not used ({str(e).splitlines()[0][:160]}); collapse defaults assumed")
    point = read_point(run_dir, name="", status=None)
    notes += [f"left out, damaged (--skip-damaged): {what}" for what in point.damage]
    point.name = str((point.summary or {}).get("name") or (config.name if config else None) or run_dir.name)
    if point.summary is not None and point.summary.get("collapse"):
        source = SUMMARY_FILE
    else:  # no verdict written yet (or none readable): apply the detector to the history so far
        settings = config.collapse if config is not None else CollapseSection()
        damaged = point.summary is None and (run_dir / SUMMARY_FILE).is_file()  # left out above (--skip-damaged)
        point.summary = {**(point.summary or {}), "collapse": detect_collapse(point.metrics, settings)}
        if damaged:  # the run may well have finished: its status is unknown, not "pending"
            point.status = "summary.json damaged"
            source = "recomputed from metrics.jsonl (summary.json damaged)"
        else:
            point.status = point.status if (run_dir / SUMMARY_FILE).is_file() else "no summary.json"
            source = "recomputed from metrics.jsonl (no verdict in summary.json: running, or killed)"
    return RunData(point=point, config=config, collapse_source=source, notes=notes)


def lr_trigger_step(point: PointData) -> int | None:
    """The step a triggered LR schedule fired: summary.json's ``lr_schedule``, else the first logged
    ``lr_schedule/triggered`` = 1 (the trainer logs it from the trigger step on)."""
    schedule = (point.summary or {}).get("lr_schedule") or {}
    if "trigger_step" in schedule:
        return schedule["trigger_step"]
    for step, value in zip(*metric_series(point, LR_SCHEDULE_TRIGGERED)):
        if value >= 1:
            return int(step)
    return None


def _stats(point: PointData, key: str) -> dict[str, Any]:
    """The steps logging ``key`` and how many of them were NaN or ±Inf (counted from the raw rows: a diverged
    metric is an outcome to see), and first/last/mean/min/max of its finite values (None when it has none)."""
    values = metric_series(point, key, keep_nan=True)[1]
    finite = [v for v in values if math.isfinite(v)]
    out: dict[str, Any] = {"steps": len(values), "non_finite": len(values) - len(finite), "first": None,
                           "last": None, "mean": None, "min": None, "max": None}
    if finite:
        out.update(first=finite[0], last=finite[-1], mean=math.fsum(finite) / len(finite), min=min(finite),
                   max=max(finite))
    return out


def run_summary(run: RunData) -> dict[str, Any]:
    """The ``report.json`` object (everything finite or None; keys as documented in the module docstring)."""
    p = run.point
    c = p.collapse
    summary = p.summary or {}
    reward = reward_summary(p)
    schedule = summary.get("lr_schedule") or {}
    return {
        "kind": "run",
        "run": p.name,
        "dir": str(p.dir),
        "status": p.status,
        "reason": summary.get("reason"),
        "steps_completed": p.run_length,
        "steps_planned": summary.get("steps_planned") or (run.config.steps if run.config else None),
        "collapse": {key: c.get(key) for key in ("collapsed", "collapse_step", "collapse_reason",
                                                 "collapse_unconfirmed_step", "length_surge_step",
                                                 "length_surge_lead", "mean_k3_kl", "mean_k3_kl_before_collapse",
                                                 "mean_abs_dlogp", "criteria")},
        "collapse_source": run.collapse_source,
        "failure": failure_of(p),
        "reward": {**reward, "definition": reward_definition([p])},
        "lr_schedule": {"kind": schedule.get("kind") or (run.config.lr_schedule.kind if run.config else None),
                        "trigger_step": lr_trigger_step(p)},
        "series": {key: _stats(p, key) for key in TRACKED},
        "notes": run.notes + [reward_definition([p]), CHI2_NOTE],
    }


def _summary_columns(s: dict[str, Any]) -> list[TextColumn]:
    """The printed table: one line per quantity."""
    c, r, series = s["collapse"], s["reward"], s["series"]
    step = lambda v: "—" if v is None else str(int(v)) if float(v).is_integer() else f"{v:g}"  # noqa: E731

    def first_last(key: str, fmt: Any) -> str:
        st = series[key]
        bad = f"non-finite at {st['non_finite']} of {st['steps']} steps" if st["non_finite"] else ""
        if st["first"] is None:
            return bad or "—"
        return f"{fmt(st['first'])} → {fmt(st['last'])} (min {fmt(st['min'])}, max {fmt(st['max'])}" \
               + (f"; {bad})" if bad else ")")

    verdict = (f"yes, at step {step(c['collapse_step'])} ({c['collapse_reason']})" if c.get("collapsed")
               else "no")
    if not s["collapse_source"].startswith(SUMMARY_FILE):
        verdict += " (judged from metrics.jsonl)"
    surge = step(c.get("length_surge_step"))
    if c.get("length_surge_lead") is not None:
        surge += f" ({step(c['length_surge_lead'])} steps before the collapse)"
    lr = s["lr_schedule"]
    chi2 = series[CHI2_TOKEN]
    rows = [
        ("status", s["status"] + (f": {s['reason']}" if s.get("reason") else "")),
        ("steps", f"{s['steps_completed']}" + (f" of {s['steps_planned']}" if s.get("steps_planned") else "")),
        ("collapsed", verdict),
        ("unconfirmed collapse candidate", step(c.get("collapse_unconfirmed_step"))),
        ("failure", failure_words(s["failure"]) if s.get("failure")
         else f"— (a {c['collapse_reason']} collapse, not a reward drop)" if c.get("collapsed")
         and c.get("collapse_reason") not in (None, "reward_drop") else "—"),
        ("response-length surge", surge),
        ("LR schedule", (lr["kind"] or "—") + (f", decay triggered at step {step(lr['trigger_step'])}"
                                               if lr["trigger_step"] is not None else "")),
        ("peak reward (smoothed)", f"{fmt_float(r['peak'])}" + (f" at step {step(r['peak_step'])}"
                                                                 if r["peak_step"] is not None else "")),
        ("final reward (smoothed)", f"{fmt_float(r['final'])}" + (f" at step {step(r['final_step'])}"
                                                                   if r["final_step"] is not None else "")),
        ("realised k3 KL (run mean)", fmt_sci(c.get("mean_k3_kl"))
         + (f"; before collapse {fmt_sci(c['mean_k3_kl_before_collapse'])}" if c.get("collapsed") else "")),
        ("realised |Δlogp| (run mean)", fmt_sci(c.get("mean_abs_dlogp"))),
        ("chi2_token (run mean) †", "—" if chi2["mean"] is None else f"{chi2['mean']:.3g} (min {chi2['min']:.3g})"),
        ("policy entropy", first_last(ENTROPY, lambda v: f"{v:.3g}")),
        ("response length", first_last(RESPONSE_LENGTH_MEAN, lambda v: f"{v:.3g}")),
        ("learning rate", first_last(LR, lambda v: f"{v:.2e}")),
        ("grad norm", first_last(GRAD_NORM, lambda v: f"{v:.3g}")),
    ]
    return [TextColumn("quantity", [k for k, _ in rows], justify="left", wrap=True, style="cyan"),
            TextColumn("value", [v for _, v in rows], justify="left", wrap=True)]


# ----------------------------------------------------------------------------- plot

PANELS = (  # (title, [(metric, label, style)], log y)
    ("reward", [(REWARD_MEAN, "training reward (rollouts)", {"color": "0.55", "lw": 1.0}),
                (EVAL_REWARD_MEAN, "clean evaluation reward", {"color": "tab:blue", "lw": 1.2, "marker": "o",
                                                                 "ms": 3.5})], False),
    ("realised mismatch: k3 KL, rollout vs training log-probs", [(K3_KL, "k3 KL",
                                                                  {"color": "tab:purple", "lw": 1.2})], True),
    ("policy entropy", [(ENTROPY, "entropy", {"color": "tab:green", "lw": 1.2})], False),
    ("mean response length (tokens)", [(RESPONSE_LENGTH_MEAN, "response length",
                                        {"color": "tab:brown", "lw": 1.2})], False),
    ("learning rate", [(LR, "learning rate", {"color": "black", "lw": 1.2})], False),
    ("grad norm", [(GRAD_NORM, "grad norm", {"color": "tab:olive", "lw": 1.0})], False),
)
MARKERS = {  # event -> (words, line style): drawn as vertical lines on every panel
    "collapse": ("collapse", {"color": "red", "ls": "-", "lw": 1.8}),
    "unconfirmed": ("unconfirmed collapse candidate", {"color": "red", "ls": ":", "lw": 1.5}),
    "surge": ("response-length surge (early warning)", {"color": "darkorange", "ls": "--", "lw": 1.5}),
    "lr_trigger": ("LR decay triggered", {"color": "tab:purple", "ls": "-.", "lw": 1.5}),
}


def run_events(s: dict[str, Any]) -> dict[str, float]:
    """The marked steps of a run summary: event name -> step (events the run does not have are left out)."""
    c = s["collapse"]
    events = {"collapse": collapse_step_of(c),
              "unconfirmed": c.get("collapse_unconfirmed_step"), "surge": c.get("length_surge_step"),
              "lr_trigger": s["lr_schedule"]["trigger_step"]}
    return {k: float(v) for k, v in events.items() if is_num(v)}


def plot_run(run: RunData, s: dict[str, Any], path: str | Path) -> Path:
    """Write run_curves.png (``run_figure``); returns its path."""
    import matplotlib.pyplot as plt

    fig = run_figure(run, s)
    path = Path(path)
    # "tight" keeps the legend below the panels in the image
    publish(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight"))
    plt.close(fig)
    return path


def run_figure(run: RunData, s: dict[str, Any]) -> Any:
    """The run's panels (see the module docstring) as a matplotlib Figure; ``s`` is ``run_summary(run)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    p = run.point
    events = run_events(s)
    fig, axes = plt.subplots(3, 2, figsize=(13, 10), sharex=True)
    handles: dict[str, Any] = {}
    for ax, (title, lines, log) in zip(axes.flat, PANELS):
        drawn = False
        for key, label, style in lines:
            steps, values = metric_series(p, key)
            pairs = [(x, v) for x, v in zip(steps, values) if math.isfinite(v) and (v > 0 or not log)]
            if pairs:
                (line,) = ax.plot(*zip(*pairs), label=label, **style)
                handles.setdefault(label, line)
                drawn = True
        if title == "reward":
            drawn = _reward_extras(ax, p, s, handles) or drawn
        if title.startswith("mean response length"):
            _surge_threshold(ax, p, run.collapse_settings, handles)
        k3 = metric_series(p, K3_KL, keep_nan=True)[1] if log else []
        if log and drawn:
            ax.set_yscale("log")
        elif k3:
            ax.text(0.5, 0.5, undrawn_k3_words(k3), transform=ax.transAxes, ha="center", va="center", color="grey")
        if not drawn and not k3:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="grey")
        for event, step in events.items():
            words, style = MARKERS[event]
            ax.axvline(step, zorder=1, **style)
            handles.setdefault(words, Line2D([], [], **style, label=f"{words} (step {step:g})"))
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("RL step")
    c = s["collapse"]
    verdict = (f"collapsed at step {c['collapse_step']} ({c['collapse_reason']})" if c.get("collapsed")
               else "no collapse")
    fig.suptitle(f"{p.name}: {s['status']}, {s['steps_completed']} steps, {verdict}", fontsize=12)
    fig.legend(handles=list(handles.values()), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=9,
               frameon=False)
    fig.tight_layout()
    return fig


def _reward_extras(ax: Any, p: PointData, s: dict[str, Any], handles: dict[str, Any]) -> bool:
    """The smoothed series collapse is judged on, and its peak (the table's "peak reward")."""
    r = s["reward"]
    steps, values = metric_series(p, r["metric"])
    pairs = sorted((x, v) for x, v in zip(steps, values) if math.isfinite(v))
    if not pairs:
        return False
    smoothed = trailing_mean([v for _, v in pairs], r["smoothing"])
    label = f"{r['metric']}, trailing mean of {r['smoothing']} (judged for collapse)"
    (line,) = ax.plot([x for x, _ in pairs], smoothed, color="navy", lw=2.2, alpha=0.6, label=label)
    handles.setdefault(label, line)
    if r["peak"] is not None and r["peak_step"] is not None:
        (star,) = ax.plot([r["peak_step"]], [r["peak"]], marker="*", ms=14, color="gold", markeredgecolor="black",
                          linestyle="none", zorder=5, label=f"peak reward (smoothed) {r['peak']:.3f}")
        handles.setdefault("peak", star)
    return True


def _surge_threshold(ax: Any, p: PointData, settings: CollapseSection, handles: dict[str, Any]) -> None:
    """The level the response length must exceed to count as a surge (ratio x the first-window baseline)."""
    values = [v for v in metric_series(p, RESPONSE_LENGTH_MEAN)[1] if math.isfinite(v)]
    window = settings.length_surge_window
    if len(values) <= window:
        return
    baseline = sum(values[:window]) / window
    label = f"surge threshold ({settings.length_surge_ratio:g} × mean of the first {window} steps)"
    line = ax.axhline(settings.length_surge_ratio * baseline, color="darkorange", lw=0.9, ls=":", label=label)
    handles.setdefault(label, line)


# ----------------------------------------------------------------------------- report


def write_run_report(run_dir: str | Path, console: Console | None = None, skip_damaged: bool = False) -> dict[str, Any]:
    """Load a run, write RUN_DIR/report/{report.json,run_curves.png}, print the summary table.

    A damaged summary.json or metrics.jsonl is a ValueError naming it, unless ``skip_damaged``: then the report
    is made from what is readable and its notes name what was left out.
    Returns ``{"summary": the report.json object, "files": [Path, ...]}``."""
    console = console or Console()
    run = read_run(run_dir)
    if run.point.damage and not skip_damaged:
        raise damaged_points_error(Path(run_dir), [run.point], single_run=True)
    out = report_folder(run.point.dir)
    s = run_summary(run)
    files = []
    try:
        files.append(plot_run(run, s, out / "run_curves.png"))
    except ImportError as e:
        console.print(f"[yellow]plots skipped: {escape(str(e))}[/]")
    s["files"] = [f.name for f in files] + ["report.json"]
    write_json_atomic(out / "report.json", s, sort_keys=False)
    files.append(out / "report.json")
    notes = ["† " + CHI2_NOTE if n == CHI2_NOTE else n for n in s["notes"]]
    print_table(console, f"run {s['run']}", _summary_columns(s), notes)
    written_line(console, out, files)
    return {"summary": s, "files": files}


def write_any_report(path: str | Path, console: Console | None = None, skip_damaged: bool = False) -> dict[str, Any]:
    """``vexact report PATH``: a sweep directory (sweep.json) gets the sweep report, a run directory
    (metrics.jsonl or summary.json) the single-run report; anything else is one ValueError saying which."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    if (path / "sweep.json").is_file():
        return {"kind": "sweep", **write_report(path, console, skip_damaged)}
    if is_run_dir(path):
        return {"kind": "run", **write_run_report(path, console, skip_damaged)}
    raise ValueError(f"{path} is neither a sweep directory (no sweep.json) nor a run directory (no "
                     f"{' or '.join(RUN_FILES)}): pass a directory written by vexact sweep or vexact run")
