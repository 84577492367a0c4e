"""A sweep directory, read: its points (each one run directory), their groups, and the value helpers every report
module shares (``dose_response``, ``dynamics``, ``scaling``, the sweep and single-run reports).

A *group* is one magnitude setting: all points sharing the values of every grid key except ``seed``.
``read_point`` is the one reader of a run directory (summary.json and metrics.jsonl), so a run reads the same
wherever it is reported from.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..records import FINISHED_STATUSES, METRICS_FILE, SUMMARY_FILE
from ..records.json_file import read_json
from ..records.metrics_log import MetricsDamaged, check_finished, decode_non_finite, read_metrics
from ..rl.validate import show_value
from .text_table import fmt_value

SEED_KEY = "seed"
RESULT_STATUSES = FINISHED_STATUSES  # points that ran to a verdict (the collapse-rate denominator)


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
    def collapse_step(self) -> int | float | None:
        """The step the run collapsed at (None when it did not): the end of its "before collapse" window, which
        the collapse summary's ``mean_k3_kl_before_collapse`` (the run's dose) and the horizon it is measured at
        share."""
        return collapse_step_of(self.collapse)

    @property
    def has_result(self) -> bool:
        return self.status in RESULT_STATUSES and self.summary is not None

    @property
    def dropped_unconfirmed(self) -> bool:
        """The run fell below the detector's drop without the patience left to confirm it (a late drop, or a run
        too short): not a collapse, and not a clean survival either."""
        return self.collapse.get("collapse_unconfirmed_step") is not None and self.collapse.get("collapsed") is not True

    @property
    def run_length(self) -> int:
        """Steps the point ran: summary's steps_completed, else the metrics history length."""
        steps = (self.summary or {}).get("steps_completed")
        if isinstance(steps, (int, float)) and math.isfinite(steps):
            return int(steps)
        return max((int(m["step"]) + 1 for m in self.metrics if is_num(m.get("step"))), default=0)


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
        return ", ".join(f"{k}={fmt_value(v)}" for k, v in zip(self.group_keys, values))

    def groups(self) -> list[tuple[tuple[Any, ...], list[PointData]]]:
        """(group values, points) in grid order; groups not in the grid come last, in order of appearance."""
        by_key: dict[str, tuple[tuple[Any, ...], list[PointData]]] = {}
        for p in self.points:
            values = self.group_values(p)
            by_key.setdefault(freeze(values), (values, []))[1].append(p)
        order = sorted(enumerate(by_key.values()), key=lambda item: (self._grid_index(item[1][0]), item[0]))
        return [group for _, group in order]

    def _grid_index(self, values: tuple[Any, ...]) -> tuple[int, ...]:
        index = []
        for key, value in zip(self.group_keys, values):
            options = [freeze(v) for v in self.grid.get(key, [])]
            index.append(options.index(freeze(value)) if freeze(value) in options else len(options))
        return tuple(index)


def collapse_step_of(collapse: dict[str, Any]) -> int | float | None:
    """A collapse summary's collapse step when the run collapsed, else None (a drop the detector never confirmed
    is no collapse)."""
    return collapse.get("collapse_step") if collapse.get("collapsed") else None


def read_sweep_results(sweep_dir: str | Path) -> SweepData:
    """Read sweep.json plus every point's summary.json and metrics.jsonl (missing files are tolerated)."""
    sweep_dir = Path(sweep_dir)
    spec_path = sweep_dir / "sweep.json"
    if not spec_path.is_file():
        raise ValueError(f"{sweep_dir} is not a sweep directory: {spec_path} not found")
    spec = read_json(spec_path, str(spec_path))
    if not isinstance(spec, dict) or not isinstance(spec.get("points"), list):
        raise ValueError(f"{spec_path} is not a sweep spec (no 'points' list)")

    grid = spec.get("grid") or {}
    if not isinstance(grid, dict):  # the groups are read from it: no point can be reported without it
        raise ValueError(f"{spec_path}: field 'grid' is {show_value(grid)}, expected a mapping of each key to a "
                         "list of its values")
    for key, values in grid.items():
        if not isinstance(values, list):
            raise ValueError(f"{spec_path}: field 'grid.{key}' is {show_value(values)}, expected a list of values")
    points = []
    for i, entry in enumerate(spec["points"]):
        problem = _entry_problem(entry)
        if problem is not None:  # a hand-edited entry: damage, so --skip-damaged can leave it out
            name = str(entry.get("name")) if isinstance(entry, dict) and entry.get("name") else f"points[{i}]"
            points.append(PointData(name=name, dir=sweep_dir, overrides={}, status="damaged",
                                    damage=[f"sweep.json points[{i}]: {problem}"]))
            continue
        name = entry.get("name") or ""
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


def _entry_problem(entry: Any) -> str | None:
    """What is wrong with one sweep.json ``points`` entry's shape, in words naming the field; None when nothing."""
    if not isinstance(entry, dict):
        return f"{show_value(entry)}, expected a point entry (a mapping)"
    for key, ok, what in (("name", lambda v: isinstance(v, str), "a string"),
                          ("dir", lambda v: isinstance(v, str), "a path string"),
                          ("overrides", lambda v: isinstance(v, dict), "a mapping of keys to values"),
                          ("status", lambda v: isinstance(v, str), "a string"),
                          ("error", lambda v: isinstance(v, str), "a string")):
        if entry.get(key) is not None and not ok(entry[key]):
            return f"field '{key}' is {show_value(entry[key])}, expected {what} or null"
    return None


def is_num(v: Any) -> bool:
    """An int or float, not a bool (JSON's numbers)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _step_count(v: Any) -> bool:
    return is_num(v) and math.isfinite(v) and v >= 0 and float(v).is_integer()


def _smoothing(v: Any) -> bool:
    return is_num(v) and math.isfinite(v) and v >= 1 and float(v).is_integer()


# The summary.json fields the reports read (the trainer writes them; ``detect_collapse`` the collapse ones), each
# with what it must be when present and not null: a hand edit that breaks one is damage naming the field.
_SUMMARY_FIELDS: tuple[tuple[str, Any, str], ...] = (
    ("name", lambda v: isinstance(v, str), "a string"),
    ("status", lambda v: isinstance(v, str), "a string"),
    ("reason", lambda v: isinstance(v, str), "a string"),
    ("steps_completed", _step_count, "a whole number >= 0"),
    ("steps_planned", _step_count, "a whole number >= 0"),
    ("collapse", lambda v: isinstance(v, dict), "a mapping"),
    ("collapse.collapsed", lambda v: isinstance(v, bool), "true or false"),
    ("collapse.collapse_reason", lambda v: isinstance(v, str), "a string"),
    *((f"collapse.{k}", is_num, "a number") for k in (
        "collapse_step", "collapse_unconfirmed_step", "peak_step", "length_surge_step", "length_surge_lead",
        "peak_reward", "final_reward", "initial_reward", "mean_k3_kl", "mean_k3_kl_before_collapse",
        "mean_abs_dlogp")),
    ("collapse.criteria", lambda v: isinstance(v, dict), "a mapping"),
    ("collapse.criteria.metric", lambda v: isinstance(v, str), "a metric name"),
    ("collapse.criteria.smoothing", _smoothing, "a whole number >= 1"),
    *((f"collapse.criteria.{k}", is_num, "a number") for k in ("drop", "min_peak", "patience")),
    ("lr_schedule", lambda v: isinstance(v, dict), "a mapping"),
    ("lr_schedule.kind", lambda v: isinstance(v, str), "a string"),
    ("lr_schedule.trigger_step", is_num, "a step number"),
)


def summary_problem(summary: dict[str, Any]) -> str | None:
    """The first field of a run summary the reports read whose value has the wrong shape (a hand edit), in words
    naming it; None when every such field is absent, null or of its shape."""
    for dotted, ok, what in _SUMMARY_FIELDS:
        *parents, key = dotted.split(".")
        holder: Any = summary
        for parent in parents:  # a parent of the wrong shape was reported before its children are reached
            holder = holder.get(parent) if isinstance(holder, dict) else None
        if isinstance(holder, dict) and holder.get(key) is not None and not ok(holder[key]):
            return f"field '{dotted}' is {show_value(holder[key])}, expected {what} or null"
    return None


def read_point(point_dir: Path, name: str, overrides: dict[str, Any] | None = None, status: str | None = None,
               error: str | None = None) -> PointData:
    """One run directory (a sweep point, or a single ``vexact run``): its summary.json and metrics.jsonl.

    The one reader behind both the sweep report and the single-run report (``run_report.py``), so a run reads
    the same wherever it is reported from. ``status`` defaults to the summary's, else "pending". Missing files are
    no damage (a point not run yet, a run still going); a file that is there but cannot be read is: it is left out
    (summary None, metrics []) and named in ``damage``. metrics.jsonl is read by ``metrics_log.read_metrics``
    (a torn last line is left out, any other bad line is damage; a finished run's log short of its summary's
    ``steps_completed``, a torn last line too, is damage: ``metrics_log.check_finished``)."""
    damage = []
    summary = None
    summary_path = point_dir / SUMMARY_FILE
    if summary_path.is_file():
        try:
            summary = decode_non_finite(json.loads(summary_path.read_bytes()))
            if not isinstance(summary, dict):
                raise ValueError(f"a JSON {type(summary).__name__}, not an object")
            problem = summary_problem(summary)
            if problem is not None:
                raise ValueError(problem)
        except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            summary = None
            damage.append(f"{summary_path.name}: not a readable run summary ({_first_line(e)})")
    try:
        metrics = read_metrics(point_dir / METRICS_FILE)
    except (OSError, ValueError) as e:  # MetricsDamaged names the file and line
        metrics = []
        damage.append(_first_line(e).replace(str(point_dir) + "/", ""))
    status = status or (summary or {}).get("status") or "pending"
    claimed = (summary or {}).get("steps_completed")
    if summary is not None and summary.get("status") in RESULT_STATUSES and not damage \
            and isinstance(claimed, int) and claimed > 0:  # a finished run's log is final: no step may be missing
        if not metrics:
            damage.append(f"metrics.jsonl holds no steps, but summary.json says {claimed} were completed")
        else:
            try:
                check_finished(point_dir / METRICS_FILE, len(metrics), claimed)
            except MetricsDamaged as e:  # a torn last line: left out by read_metrics, and the step with it
                damage.append(f"{METRICS_FILE}:{e.line}: {e.why}")
    return PointData(name=name, dir=point_dir, overrides=dict(overrides or {}), status=str(status), error=error,
                     summary=summary, metrics=metrics, damage=damage)


def damage_list(damaged: list[PointData]) -> str:
    return "; ".join(f"{p.name or p.dir} ({', '.join(p.damage)})" for p in damaged)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines() or [type(err).__name__])[0][:200]


def damaged_points_error(where: Path, damaged: list[PointData], single_run: bool = False) -> ValueError:
    """One error naming every damaged or unreadable point and what is wrong with it; ``single_run``: ``where`` is
    the one run reported (``vexact report RUN_DIR``), so it speaks of that run, and --skip-damaged reports what is
    readable of it rather than leaving it out."""
    if single_run:
        return ValueError(f"{where}: the run's files are damaged or unreadable: "
                          f"{'; '.join(p for point in damaged for p in point.damage)}. "
                          "Repair them, or pass --skip-damaged to report from what is readable")
    return ValueError(f"{where}: {len(damaged)} damaged or unreadable point{'s' * (len(damaged) != 1)}: "
                      f"{damage_list(damaged)}. "
                      "Repair or move them away, or pass --skip-damaged to report without them")


# ----------------------------------------------------------------------------- values


def metric_series(p: PointData, key: str, keep_nan: bool = False) -> tuple[list[float], list[float]]:
    """(steps, values) of metric ``key`` over the point's metrics lines: the lines holding a number for both, NaN
    values left out unless ``keep_nan`` (infinities kept)."""
    pairs = [(float(m["step"]), float(m[key])) for m in p.metrics if is_num(m.get("step")) and is_num(m.get(key))]
    pairs = [(s, v) for s, v in pairs if keep_nan or not math.isnan(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _finite(values: Any) -> list[float]:
    return [float(v) for v in values if is_num(v) and not math.isnan(v)]


def mean(values: Any) -> float | None:
    """The mean of the numbers among ``values`` (NaN and non-numbers left out); None when there are none."""
    vals = _finite(values)
    return sum(vals) / len(vals) if vals else None


def median(values: Any) -> float | None:
    """The median of the numbers among ``values`` (NaN and non-numbers left out); None when there are none."""
    vals = _finite(values)
    return statistics.median(vals) if vals else None


def freeze(value: Any) -> str:
    """A hashable key for a JSON-like value (a group's values, a seed): equal values, equal keys."""
    return json.dumps(value, sort_keys=True, default=str)
