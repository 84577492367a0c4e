"""``vexact sweep SWEEP.yaml``: a base config plus a grid, one run directory per point.

A sweep file::

    name: noise_sweep
    base: zero_mismatch.yaml          # a run config, relative to this file
    set: {inject.mode: logit_noise}   # overrides applied to every point (optional)
    grid:                             # the cartesian product of these is run
      inject.sigma: [0, 1.0, 2.0]       # the mode's knob (inject.value: the old spelling)
      seed: [0, 1, 2]
    output_dir: runs/sweeps/noise_sweep   # optional; default runs/sweeps/<name>

Optional ``variants`` name bundles of overrides that belong together (a remedy = a correction method plus an
LR schedule, say); every variant is crossed with the grid, and the point records ``variant: <name>``, which
the report groups by like a grid key::

    variants:
      none: {}
      tis_lr_decay: {correction.method: token_tis, lr_schedule.kind: length_triggered}

Optional ``curves`` names the grid keys (``variant`` included) that split the dose-response fit of ``vexact report``
into curves (``dose_response.json``): ``curves: [algorithm.old_logprobs]`` fits one collapse-vs-mismatch curve per
old-log-prob mode over every source and magnitude. Default: every non-seed grid key outside ``inject.*``.

Optional ``plugins`` lists modules to import before the points are validated (outside modes, tasks, schedules:
``vexact.rl.plugins``); they join each point's own ``plugins``, so every worker process imports them too.

Every point's config is built and validated before anything runs. Points run in grid order,
sequentially or in ``--jobs N`` worker processes. The sweep is resumable: a point whose
``summary.json`` says completed/stopped is skipped, an unfinished one resumes from its last
checkpoint; ``sweep.json`` is rewritten atomically after every point, so Ctrl-C loses nothing
finished. A point that fails records its error and the sweep goes on.

Failure behaviour. Every problem with the input is one error line (a ``ValueError``) naming the file, before any
work: an unreadable or malformed sweep file or base config (YAML errors with line and column), a key given twice in
the sweep file, a ``grid`` that is not a mapping of non-empty lists, duplicate grid values (``seed: [0, 0]``), two
points that would share a run directory (point names replace unsafe characters with ``_``, so ``a/b`` and ``a_b``
collide), two points with the same run config (``optimizer.lr: [1e-3, 0.001]``), an output path that exists as a
file, a damaged ``summary.json``. Worker processes die with the sweep's main process, however it dies
(``PR_SET_PDEATHSIG`` on Linux), so a killed sweep leaves nothing running that could write next to a re-run. The
trainer holds an exclusive lock on its run directory for the whole run (``vexact.records.runlog.run_lock``); the
sweep checks that lock just before it starts a point, and a point whose directory is in use by another vexact
process is recorded as failed with that message (no ``error.txt`` is written into the other process's directory)
and the sweep goes on. A worker that dies abruptly (killed, out of memory) fails the points running at that moment;
the sweep goes on in fresh workers.
(All in ``tests/map/test_sweep_faults.py``.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import os
import re
import signal
import traceback
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console
from rich.markup import escape

from ..cli_base import stop_on_sigterm, stop_signal, stopped_by
from ..engine.devices import worker_device
from ..progress import Progress, StepReporter
from ..records import CONFIG_FILE, FINISHED_STATUSES, RUN_FILES, SUMMARY_FILE, is_run_dir
from ..records.atomic import ENVIRONMENT_ERRNOS, write_json_atomic, write_text_atomic
from ..records.runlog import RunLocked, run_lock
from ..rl.config import ConfigError, config_changes, config_from_dict, config_hash, read_yaml, show_value
from ..rl.config_schema import MEMORY_KEYS, RunConfig
from ..rl.config_spellings import KEY_ALIASES, RENAMED_KEYS
from ..rl.lifetime import die_with_parent
from ..rl.plugins import load_plugins
from ..rl.schedules import steps_change_problem
from ..rl.validate import build, parse_yaml, plain
from . import EXECUTORS, MAX_JOBS

FINISHED = FINISHED_STATUSES  # stopped = the run ended itself (NaN, exactness) -- an outcome


@dataclass
class SweepFile:
    """The keys of a sweep file, checked by the run config's validator (``vexact.rl.validate.build``: unknown keys,
    types); the sweep's own rules (non-empty grid lists, no duplicate values, keys the sweep sets per point, plain
    names) are ``load_sweep_spec``'s, which knows the file's path for its messages."""

    grid: dict[str, list[Any]] | None = None  # dotted config key -> values (required: checked by _check_grid)
    name: str | None = None  # the folder runs/sweeps/<name> (default: the file's stem)
    base: str | dict[str, Any] | None = None  # a run config file (relative to the sweep file) or a mapping
    set: dict[str, Any] | None = None  # dotted config keys every point sets
    variants: dict[str, dict[str, Any]] | None = None  # name -> a bundle of dotted keys (grid key 'variant')
    curves: list[str] | None = None  # grid keys that split the dose-response fit
    output_dir: str | None = None
    plugins: list[str] | None = None  # modules every point imports first (vexact.rl.plugins); added to the base's


SWEEP_KEYS = {f.name for f in dataclasses.fields(SweepFile)}
VARIANT_KEY = "variant"
PER_POINT_KEYS = ("name", "output_dir")  # set by the sweep for every point
MAX_POINTS = 10_000  # a grid this large is a typo (a long list where a short one was meant), not an experiment
MAX_NAME_BYTES = 255  # a point name is a folder name
WORKER_DIED = ("a worker process died abruptly (killed by a signal, or out of memory) while this point ran; the "
               "points running at that moment are recorded as failed, and a re-run resumes them")


@dataclass
class SweepPoint:
    name: str
    overrides: dict[str, Any]
    config: RunConfig

    @property
    def run_dir(self) -> Path:
        return Path(self.config.output_dir)


@dataclass
class SweepSpec:
    name: str
    grid: dict[str, list]
    output_dir: Path
    points: list[SweepPoint]
    variants: dict[str, dict] | None = None
    curves: list[str] | None = None  # grid keys that split the dose-response fit (None: the report's default)
    overrides: list[str] = dataclasses.field(default_factory=list)  # the command line's --set KEY=VALUE, in order


def _format_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def point_name(overrides: dict[str, Any]) -> str:
    """'inject.value=0.5,seed=1' -- also the point's folder name (unsafe characters replaced)."""
    text = ",".join(f"{k}={_format_value(v)}" for k, v in overrides.items())
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)


def _where(path: Path) -> str:
    return f" (in sweep file '{path}')"


def _check_overrides(mapping: dict | None, key: str, path: Path) -> dict:
    """A mapping of dotted config keys to values (``set`` or one variant; its type checked by ``SweepFile``); None
    is an empty one."""
    where = _where(path)
    if mapping is None:
        return {}
    for k in mapping:
        if not isinstance(k, str) or not k:
            raise ConfigError(f"expected dotted config keys (strings), got the key {show_value(k)}{where}", key)
        if k in PER_POINT_KEYS:
            raise ConfigError(f"'{k}' is set by the sweep for every point (points/<point name>); use the sweep's own "
                              f"'{k}'{where}", f"{key}.{k}")
    return mapping


def _same(a: Any, b: Any) -> bool:
    """Equal as grid values: 1 and 1.0 are the same value, 1 and true are not."""
    return (isinstance(a, bool), a) == (isinstance(b, bool), b)


def _check_grid(grid: dict[str, list] | None, path: Path) -> dict[str, list]:
    """The sweep's rules for a grid whose types ``SweepFile`` checked: given, non-empty lists, distinct values."""
    where = _where(path)
    if not grid:
        raise ConfigError(f"expected a mapping of dotted config keys to non-empty lists of values, got "
                          f"{show_value(grid)}{where}", "grid")
    for key, values in grid.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"expected dotted config keys (strings), got the key {show_value(key)}{where}", "grid")
        if key in PER_POINT_KEYS:
            raise ConfigError(f"'{key}' is set by the sweep for every point (points/<point name>){where}",
                              f"grid.{key}")
        if not values:
            raise ConfigError(f"expected a non-empty list of values, got {show_value(values)}{where}", f"grid.{key}")
        for i, value in enumerate(values):
            if any(_same(value, earlier) for earlier in values[:i]):
                raise ConfigError(f"duplicate value {show_value(value)} in sweep file '{path}' (each point needs its "
                                  "own run directory)", f"grid.{key}")
    return grid


def _check_plain(value: Any, key: str, path: Path) -> None:
    """sweep.json records grid values and variants: they must be plain JSON-able YAML (no dates, sets, binary)."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"only numbers, strings, booleans, null, lists and mappings are allowed ({e})"
                          f"{_where(path)}", key) from None


def _canonical_key(key: str) -> str:
    """vexact's spelling of a dotted config key (a renamed key's new name, verl's spelling mapped)."""
    key = key.strip()
    key = RENAMED_KEYS[key].new if key in RENAMED_KEYS else key
    return KEY_ALIASES.get(key, key)


def _check_command_line_sets(overrides: list[str], grid: dict[str, list], variants: dict[str, dict] | None,
                             path: Path) -> None:
    """``vexact sweep --set KEY=VALUE`` changes the base of every point: a key the sweep sets per point (a grid key,
    a variant's key, name, output_dir) would be overridden there, so it is refused instead of ignored."""
    per_point = {_canonical_key(k): f"a grid key of sweep file '{path}'" for k in grid if k != VARIANT_KEY}
    for vname, bundle in (variants or {}).items():
        per_point.update({_canonical_key(k): f"set by variant {vname!r} of sweep file '{path}'" for k in bundle})
    per_point.update({k: "set by the sweep for every point (points/<point name>; --output-dir moves them)"
                      for k in PER_POINT_KEYS})
    for item in overrides:
        key = _canonical_key(item.partition("=")[0])
        if key in per_point:
            raise ConfigError(f"--set {item}: '{key}' is {per_point[key]}, so it differs per point; change it "
                              "there, not with --set")


def load_sweep_spec(path: str | Path, output_dir: str | Path | None = None,
                    overrides: Iterable[str] = ()) -> SweepSpec:
    """Read and validate a sweep file; every point's config is validated here, before any work.

    ``overrides``: ``vexact sweep --set KEY=VALUE`` items, applied to every point's config after the file's ``base``
    and ``set`` and before its variant and grid values (a key those set per point is refused).
    Every problem is one ConfigError naming the sweep file (and the base config file, when that is the problem)."""
    path = Path(path)
    overrides = list(overrides)
    where = _where(path)
    raw = read_yaml(path, "sweep file")
    if not isinstance(raw, dict):
        raise ConfigError(f"sweep file '{path}' must contain a mapping with keys {', '.join(sorted(SWEEP_KEYS))}, "
                          f"got {type(raw).__name__}: {show_value(raw)}")
    bad_key = next((k for k in raw if not isinstance(k, str)), None)
    if bad_key is not None:
        raise ConfigError(f"unknown key (known keys: {', '.join(sorted(SWEEP_KEYS))}){where}", str(bad_key))
    try:  # the run config's validator: unknown keys and the type of every value
        spec = plain(build(SweepFile, raw))
    except ConfigError as err:
        raise ConfigError(f"{err.problem}{where}", err.key) from None
    name = spec.get("name") or path.stem
    if name in (".", "..") or "/" in name or "\\" in name:
        raise ConfigError(f"expected a plain name (it names the folder runs/sweeps/<name>), got "
                          f"{show_value(name)}{where}", "name")
    base = spec.get("base")
    if base is None:  # refused below, once the grid's own problems are reported (a file without content is refused)
        base_dict: dict = {}
    elif isinstance(base, dict):
        base_dict = base
    elif base:
        base_path = (path.parent / base).resolve()
        base_dict = read_yaml(base_path, "base config", f" (named in sweep file '{path}')")
        if base_dict is None:  # an empty file: all defaults
            base_dict = {}
        if not isinstance(base_dict, dict):
            raise ConfigError(f"base config '{base_path}' (named in sweep file '{path}') must contain a mapping of "
                              f"config keys, got {type(base_dict).__name__}: {show_value(base_dict)}")
    else:  # an empty string
        raise ConfigError(f"expected the path of a run config (relative to the sweep file) or a mapping, got "
                          f"{show_value(base)}{where}", "base")
    plugins = spec.get("plugins") or []
    try:  # before the points are validated: their keys may name what the plugins register
        load_plugins(plugins)
    except ConfigError as err:
        raise ConfigError(f"{err.problem}{where}", err.key) from None
    common = _check_overrides(spec.get("set"), "set", path)
    grid = _check_grid(spec.get("grid"), path)
    _check_plain(grid, "grid", path)
    variants = spec.get("variants")
    if variants is not None:
        if not variants:
            raise ConfigError(f"expected a mapping of variant names to mappings of dotted keys to values, got "
                              f"{show_value(variants)}{where}", "variants")
        for vname, bundle in variants.items():
            if not isinstance(vname, str) or not vname:
                raise ConfigError(f"variant names must be non-empty strings, got {show_value(vname)}{where}",
                                  "variants")
            variants[vname] = _check_overrides(bundle, f"variants.{vname}", path)
        _check_plain(variants, "variants", path)
        if VARIANT_KEY in grid:
            raise ConfigError(f"{VARIANT_KEY!r} is set by 'variants'; remove it from the grid{where}", "grid")
        grid = {VARIANT_KEY: list(variants), **grid}
    curves = spec.get("curves")
    if curves is not None:
        stray = [k for k in curves if k not in grid]
        if stray:
            raise ConfigError(f"{stray[0]!r} is not a grid key (grid keys: {', '.join(grid)}){where}", "curves")
    _check_command_line_sets(overrides, grid, variants, path)
    spec_out = spec.get("output_dir")
    out = Path(output_dir or spec_out or Path("runs") / "sweeps" / name)
    n_points = 1
    for values in grid.values():
        n_points *= len(values)
    if n_points > MAX_POINTS:
        raise ConfigError(f"the grid has {n_points} points (more than {MAX_POINTS}); check its lists{where}", "grid")

    points = []
    dirs: dict[str, str] = {}  # folder name -> the point that has it
    runs: dict[str, str] = {}  # the point's run config (its name and output_dir apart) -> the point that has it
    for combo in itertools.product(*grid.values()):
        overrides_of_point = dict(zip(grid.keys(), combo))
        pname = point_name(overrides_of_point)
        label = ",".join(f"{k}={_format_value(v)}" for k, v in overrides_of_point.items())
        if pname in dirs:
            raise ConfigError(f"sweep file '{path}': points {dirs[pname]} and {label} would share the run directory "
                              f"{out / 'points' / pname} (characters other than letters, digits and ._=,+- become "
                              "_ in folder names); rename a value or variant")
        dirs[pname] = label
        if len(pname.encode()) > MAX_NAME_BYTES:
            raise ConfigError(f"sweep file '{path}': point {pname[:60]}... has a name of {len(pname.encode())} "
                              f"bytes, too long for its folder (at most {MAX_NAME_BYTES}); use shorter grid values")
        config_overrides = dict(overrides_of_point)
        origin = {k: f"the grid's {k}" for k in config_overrides}  # where each key's value comes from, for errors
        if variants is not None:
            vname = config_overrides.pop(VARIANT_KEY)
            origin.update({k: f"variants.{vname}.{k}" for k in variants[vname]})
            config_overrides = {**variants[vname], **config_overrides}
        per_point = {**config_overrides, "output_dir": str(out / "points" / pname), "name": f"{name}/{pname}"}
        if plugins:  # the sweep's plugins join the point's own (from the base, set or a variant)
            own = {**common, **per_point}.get("plugins", base_dict.get("plugins"))
            per_point["plugins"] = list(dict.fromkeys([*(own if isinstance(own, list) else []), *plugins]))
        # later items win: the sweep's live-view default, the file's set, the command line's --set, the point's own
        items = ["logging.live=false", *_items(common), *overrides, *_items(per_point)]
        origins = ["the sweep's default logging.live=false", *(f"set.{k}" for k in common),
                   *(f"--set {item}" for item in overrides),
                   *(origin.get(k, f"the sweep's {k} of point {pname}") for k in per_point)]
        try:
            # in a sweep file inject.value names the mode's knob, whatever the mode, and the points' folders (so
            # sweeps written before the per-mode names resume): it is read without the run config's warning
            cfg = config_from_dict(base_dict, items, origins, quiet={"inject.value"})
        except ConfigError as err:
            raise ConfigError(f"sweep point {pname} of '{path}': {err}") from None
        run = config_hash({k: v for k, v in cfg.to_dict().items() if k not in PER_POINT_KEYS})
        if run in runs:  # values spelled two ways (1e-3 and 0.001, fp32 and float32), variants that set the same
            raise ConfigError(f"sweep file '{path}': points {runs[run]} and {label} are the same run config (one "
                              "value spelled two ways, or variants that set the same keys), so they would run the "
                              "same experiment twice; remove one")
        runs[run] = label
        points.append(SweepPoint(pname, overrides_of_point, cfg))
    if base is None:
        raise ConfigError(f"no base config: give 'base: RUN.yaml' (a run config, relative to the sweep file) or a "
                          f"mapping of config keys ('base: {{}}' for every default){where}", "base")
    return SweepSpec(name, {k: list(v) for k, v in grid.items()}, out, points, variants, curves, overrides)


def select_points(spec: SweepSpec, only: list[str] | None, names: list[str] | None = None) -> list[SweepPoint]:
    """The points a ``--only KEY=V1,V2`` / ``--point NAME`` round runs (every point when both are empty).

    An adaptive bracket runs part of a grid first (say the two largest magnitudes) and the rest later into the same
    directory: finished points are skipped either way. Each ``only`` item names one grid key (``variant`` included)
    and the values to keep, as they are written in point names; a point runs when every named key has one of its
    values. ``names``: points by their full names (as ``sweep.json`` and the point folders spell them), for a round
    that is no cross product of values (one dose of one correction and another seed of another, in one call)."""
    candidates = _points_named(spec, names) if names else spec.points
    wanted: dict[str, set[str]] = {}
    for item in only or []:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise ValueError(f"--only {item!r}: expected KEY=VALUE[,VALUE...], e.g. --only inject.value=0.1,0.3")
        if key not in spec.grid:
            raise ValueError(f"--only {item!r}: {key!r} is not a grid key of sweep {spec.name} "
                             f"(grid keys: {', '.join(spec.grid)})")
        known = [_format_value(v) for v in spec.grid[key]]
        chosen = [v.strip() for v in values.split(",")]
        stray = [v for v in chosen if v not in known]
        if stray:
            raise ValueError(f"--only {item!r}: {stray[0]!r} is not a value of grid key {key!r} "
                             f"(values: {', '.join(known)})")
        wanted.setdefault(key, set()).update(chosen)
    return [p for p in candidates if all(_format_value(p.overrides[k]) in values for k, values in wanted.items())]


def _points_named(spec: SweepSpec, names: list[str]) -> list[SweepPoint]:
    """``spec``'s points named in ``names``, in grid order; a name of no point is one error, showing the form."""
    known, wanted = {p.name for p in spec.points}, set(names)
    for name in names:
        if name not in known:
            raise ValueError(f"--point {name!r}: no point of sweep {spec.name} has this name (names list every grid "
                             f"key in order, as sweep.json does, e.g. {spec.points[0].name!r})")
    return [p for p in spec.points if p.name in wanted]


def _items(settings: dict[str, Any]) -> list[str]:
    """``{dotted key: value}`` as ``KEY=VALUE`` override items (values in YAML flow style)."""
    return [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
            for k, v in settings.items()]


def _extendable(point: SweepPoint) -> bool:
    """A completed point whose run went to its planned end while the sweep's config now asks for more steps: it is
    resumed with ``steps`` grown (as ``vexact run DIR --resume --set steps=N --allow-change steps``), which gives
    the bits of a run of N steps from the start, its log included (the shorter run's off-schedule final evaluation
    is taken back from its row). A
    point whose LR schedule spans the run's steps (cosine without ``lr_schedule.total_steps``) would not: the sweep
    refuses it before anything runs (``_check_started_points``), leaving its finished run as it is. A run that ended
    early (a confirmed collapse with ``collapse.stop_on_collapse``) keeps its outcome."""
    try:
        summary = json.loads((point.run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return False
    planned, done = summary.get("steps_planned"), summary.get("steps_completed")
    return isinstance(planned, int) and planned == done and point.config.steps > planned


def point_status(point: SweepPoint) -> str:
    summary = point.run_dir / SUMMARY_FILE
    if summary.exists():
        try:
            status = json.loads(summary.read_text()).get("status", "pending")
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"{summary} is not a readable run summary ({type(e).__name__}: {e}); move the folder "
                             f"{point.run_dir} away to run the point again") from None
        return status if isinstance(status, str) else "interrupted"
    return "pending" if not point.run_dir.exists() else "interrupted"


def _check_output_dirs(spec: SweepSpec) -> None:
    """Before anything runs: the sweep's folders are folders (or absent), the output directory holds no other
    sweep (a sweep.json of another name), and sweep.json can be written."""
    for folder in (spec.output_dir, spec.output_dir / "points", *(p.run_dir for p in spec.points)):
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"sweep {spec.name}: {folder} exists and is not a directory; move it away or choose "
                             "another output_dir")
    if is_run_dir(spec.output_dir) and not (spec.output_dir / "sweep.json").is_file():
        # a single run's folder: the sweep's files and points would be mixed into it (and vexact report would
        # then read it as a sweep, not as the run)
        raise ValueError(f"sweep {spec.name}: {spec.output_dir} is a run's directory (it holds "
                         f"{' and '.join(name for name in RUN_FILES if (spec.output_dir / name).is_file())}); "
                         "choose another output_dir")
    held = _recorded_sweep_name(spec.output_dir)
    if held is not None and held != spec.name:
        # its sweep.json would be replaced and its points left unlisted beside the new ones. The same name is the
        # same sweep, resumed or edited: _check_recorded_overrides and _check_started_points judge that.
        raise ValueError(f"sweep {spec.name}: {spec.output_dir} holds sweep {held} (its sweep.json); choose another "
                         "--output-dir for this sweep")


def _recorded_sweep_name(output_dir: Path) -> str | None:
    """The name in ``output_dir``'s sweep.json; None where there is none, or it cannot be read (rewritten later)."""
    try:
        name = json.loads((output_dir / "sweep.json").read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def _write_index(spec: SweepSpec, statuses: dict[str, str], errors: dict[str, str | None]) -> None:
    spec.output_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(spec.output_dir / "sweep.json", {
        "name": spec.name,
        "grid": spec.grid,
        "variants": spec.variants,
        "curves": spec.curves,
        "set": spec.overrides,
        "points": [{"name": p.name, "dir": f"points/{p.name}", "overrides": p.overrides,
                    "status": statuses[p.name], "error": errors.get(p.name)} for p in spec.points],
    })


@contextlib.contextmanager
def sweep_lock(spec: SweepSpec) -> Iterator[None]:
    """Hold the sweep directory for a whole ``run_sweep`` (``run_lock`` on ``output_dir``: released by the OS however
    the process ends). A second sweep into the same directory -- the same command run twice at once -- is refused
    with one error naming the holder, instead of starting the points the first one runs (which it would find
    locked and record as failed)."""
    with run_lock(spec.output_dir, who=f"sweep {spec.name}", again="a sweep runs once at a time (re-running the "
                  "same command afterwards resumes anything unfinished)"):
        yield


def _sets(items: list[str]) -> dict[str, Any]:
    """--set items as {vexact's key: parsed value}, so that spellings of one setting compare equal."""
    parsed = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            value = parse_yaml(raw)
        except yaml.YAMLError:
            value = raw
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string; the config reads it as 0.001
            with contextlib.suppress(ValueError):
                value = float(value)
        parsed[_canonical_key(key)] = value
    return parsed


def _check_recorded_overrides(spec: SweepSpec) -> None:
    """A sweep whose points have started is resumed with the command line's --set it was started with (recorded in
    sweep.json): another --set would give its points another config than the one their runs began with. ``steps``
    may differ: more steps extend the finished points (as an edited sweep file's would)."""
    try:
        recorded = json.loads((spec.output_dir / "sweep.json").read_text()).get("set") or []
    except (OSError, ValueError, AttributeError):  # no sweep.json yet (or an unreadable one: rewritten below)
        return
    def compared(items: list[str]) -> dict[str, Any]:  # steps may grow: the sweep extends finished points then
        return {k: v for k, v in _sets(items).items() if k != "steps"}

    if not isinstance(recorded, list) or compared([str(x) for x in recorded]) == compared(spec.overrides):
        return
    if all(not p.run_dir.exists() for p in spec.points):  # nothing started: nothing to mix with
        return
    was = " ".join(f"--set {x}" for x in recorded) or "no --set"
    now = " ".join(f"--set {x}" for x in spec.overrides) or "no --set"
    raise ValueError(f"sweep {spec.name} in {spec.output_dir} was started with {was}, and is now given {now}: its "
                     "points would resume with another config; repeat the first command's --set to resume it, or "
                     "choose another --output-dir for the new settings")


RESUMED_POINT_CHANGES = ("steps", "threads", *MEMORY_KEYS)
"""Config keys a started point's run may be resumed with changed (``_run_point``'s ``allow_changes``): more steps
extend a finished point, and a memory knob changes no bit; nor does ``threads`` (``RESUME_SAFE_KEYS``), which a
point that leaves it unset has in its config.yaml when its share of the cores under ``--jobs`` capped it, so a
re-run with other ``--jobs`` resumes it."""


def _check_started_points(spec: SweepSpec) -> None:
    """Before anything runs: every point already started in the output directory gets the config its run began with
    (its config.yaml), but for ``RESUMED_POINT_CHANGES``. An edited sweep file or base config would otherwise skip
    the finished points, whose results the report then labels with the new settings, and fail the started ones."""
    for point in spec.points:
        saved = point.run_dir / CONFIG_FILE
        if not saved.is_file():
            continue
        try:
            changes = config_changes(saved, point.config)
        except ConfigError:  # a damaged config.yaml: the point's own resume says so, as for a single run
            continue
        refused = {k: v for k, v in changes.items() if k not in RESUMED_POINT_CHANGES}
        if refused:
            diff = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
            raise ValueError(f"sweep {spec.name} in {spec.output_dir}: point {point.name} was started with another "
                             f"config ({diff}; its run's {saved}): the sweep file or its base config changed since; "
                             "restore them to resume this sweep, or choose another --output-dir for the new settings")
        # a started point resumed, or a finished one extended, with other steps: its LR schedule must not follow them
        problem = "steps" in changes and steps_change_problem(point.config.lr_schedule, *changes["steps"])
        if problem:
            raise ValueError(f"sweep {spec.name} in {spec.output_dir}: point {point.name} cannot go on with steps "
                             f"{problem}; restore steps to resume this sweep, or choose another --output-dir for "
                             "the new steps (a fresh sweep there runs every point from the start)")


def _worker_init(parent_pid: int) -> None:
    """Runs first in every worker process: die with the sweep's main process, however that dies (SIGKILL too), and
    take SIGTERM as Ctrl-C (the worker is vexact's own process, never a launcher's rank): a point stopped by the
    sweep's forwarded signal, or by a SIGTERM sent to the whole process group (``timeout``, a job scheduler),
    records itself as interrupted.

    ``die_with_parent`` needs the spawning thread to live as long as the parent: ProcessPoolExecutor spawns its
    workers from the thread that calls ``submit`` (here the sweep's, alive until the pool is shut down)."""
    die_with_parent(parent_pid)
    stop_on_sigterm(handle=True)


def _run_point(config: dict, resume: bool, threads: int | None) -> dict:
    """Run one point (in this process or a worker). Returns its summary, or the error. ``threads``: the most torch
    threads a point that leaves ``threads`` unset may use (its share of the cores under ``--jobs``, the CPUs its Ray
    task asked for); None: the run's default."""
    from ..rl.trainer import Trainer, default_threads  # imported here: workers are spawned fresh

    log = io.StringIO()  # the run's own log, not shown; its warm-start lines go back to the sweep
    try:
        cfg = config_from_dict(config)
        if threads and cfg.threads is None and threads < default_threads(cfg):
            # in the config, not torch.set_num_threads: the Trainer sets the config's count, else its default (every
            # core for a large model), and N workers would each take every core
            cfg = dataclasses.replace(cfg, threads=threads)
        if cfg.device.startswith("cuda:"):  # Triton launches on the process's current GPU: the worker's own
            torch.cuda.set_device(torch.device(cfg.device))
        summary = Trainer(cfg, Console(file=log, width=10_000, color_system=None)).run(
            resume=resume, allow_changes=RESUMED_POINT_CHANGES if resume else ())
        return {"status": summary["status"], "error": None, "warm_start": _warm_start_lines(log),
                "signal": summary.get("signal")}
    except KeyboardInterrupt as stop:
        return {"status": "interrupted", "error": None, "signal": stop_signal(stop).name}
    except RunLocked as err:  # another process took the directory after the sweep's own check
        return _locked(err)
    except Exception as err:  # a failing point is recorded; the sweep goes on
        return {"status": "failed", "error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}",
                "warm_start": _warm_start_lines(log)}


def _warm_start_lines(log: io.StringIO) -> list[str]:
    """What the point's run said about its warm start (trained it, waited for another point, loaded it): the sweep
    prints these under the point's line, so its log shows which point trained a shared warm start."""
    return [line.strip() for line in log.getvalue().splitlines() if line.startswith("warm start:")]


def _locked(err: RunLocked) -> dict:
    return {"status": "failed", "error": f"RunLocked: {err}", "locked": True}


def _check_lock(point: SweepPoint) -> dict | None:
    """The failure to record if another process holds the point's run directory, else None.

    Only a check: the trainer takes the lock itself for the whole run (flock is not re-entrant across opens, so the
    sweep must not hold it then). A directory that does not exist yet cannot be locked, and is not created here."""
    if not point.run_dir.is_dir():
        return None
    try:
        with run_lock(point.run_dir):
            pass
    except RunLocked as err:
        return _locked(err)
    except OSError:  # cannot even open the lock file: the trainer meets the same problem, and that is recorded
        return None
    return None


def run_sweep(spec: SweepSpec, jobs: int = 1, console: Console | None = None, executor: str = "local",
              address: str | None = None, quiet: bool = False, only: list[str] | None = None,
              names: list[str] | None = None) -> dict[str, str]:
    """Run every unfinished point (of ``select_points(spec, only, names)``); returns {point name: status}.

    ``executor``: ``local`` (this process, or ``jobs`` worker processes) or ``ray`` (one Ray task per point on
    the cluster at ``address``, or on a private loopback-only instance; ``vexact/sweeps/ray_executor.py``).
    Progress goes to ``console`` (``vexact.progress``: a bar on a terminal, a ``[k/N]`` line per point otherwise);
    ``quiet``: only failed points are printed. The sweep directory is locked for the call (``sweep_lock``)."""
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; expected {' or '.join(EXECUTORS)}")
    if address and executor != "ray":
        raise ValueError("--address is the Ray cluster to use: it needs --executor ray")
    if not 1 <= jobs <= MAX_JOBS:
        raise ValueError(f"--jobs {jobs}: expected 1 to {MAX_JOBS} worker processes")
    if jobs > 1 and executor == "ray":  # Ray runs as many points at once as its nodes' CPUs hold
        raise ValueError(f"--jobs {jobs} is the number of local worker processes: with --executor ray, Ray decides "
                         "how many points run at once (each asks for its threads' CPUs)")
    console = console or Console()
    selected = select_points(spec, only, names)
    _check_output_dirs(spec)
    with sweep_lock(spec):
        return _run_locked(spec, jobs, console, executor, address, quiet, selected)


def _run_locked(spec: SweepSpec, jobs: int, console: Console, executor: str, address: str | None,
                quiet: bool, selected: list[SweepPoint]) -> dict[str, str]:
    _check_recorded_overrides(spec)
    _check_started_points(spec)
    statuses = {p.name: point_status(p) for p in spec.points}
    errors: dict[str, str | None] = {}
    try:
        _write_index(spec, statuses, errors)
    except OSError as e:
        if e.errno in ENVIRONMENT_ERRNOS:  # the machine's failure (disk full, ...): not the sweep's input
            raise
        raise ValueError(f"sweep {spec.name}: cannot write {spec.output_dir / 'sweep.json'}: "
                         f"{e.strerror or e}") from None
    here = _identity(spec.output_dir)

    def still_there() -> None:
        """The sweep directory removed (or replaced) during the sweep: stop, rather than make it again point by
        point with a sweep.json that lists results which went with it."""
        if _identity(spec.output_dir) != here:
            raise ValueError(f"sweep {spec.name}: {spec.output_dir} was removed during the sweep, and the results "
                             "in it with it; re-running the sweep runs its points again")

    extend = [p for p in selected if statuses[p.name] == "completed" and _extendable(p)]
    todo = [p for p in selected if statuses[p.name] not in FINISHED or p in extend]
    done_before = len(selected) - len(todo)
    # plain text: the sweep's name is the user's, and may hold brackets rich would read as markup
    say = (lambda text: None) if quiet else (lambda text: console.print(text, markup=False, highlight=False))
    if len(selected) < len(spec.points):
        say(f"sweep {spec.name}: --only selects {len(selected)} of {len(spec.points)} points")
    if done_before:
        say(f"sweep {spec.name}: {done_before} of {len(selected)} points already finished, skipped")
    if extend:
        say(f"sweep {spec.name}: {len(extend)} finished point(s) ran fewer steps than the sweep now asks "
            f"({extend[0].config.steps}); they are extended from their last checkpoint")
    threads = max(1, torch.get_num_threads() // jobs) if jobs > 1 else None
    progress = Progress(console, f"sweep {spec.name}", len(selected), done=done_before, quiet=quiet)

    def finish(point: SweepPoint, result: dict) -> None:
        still_there()
        statuses[point.name] = result["status"]
        errors[point.name] = result["error"]
        if result["error"] and not result.get("locked"):  # a locked directory belongs to another process
            try:
                point.run_dir.mkdir(parents=True, exist_ok=True)
                write_text_atomic(point.run_dir / "error.txt", result["error"])
            except OSError:  # the error is in sweep.json all the same
                pass
        _write_index(spec, statuses, errors)
        if not quiet:  # the warm start came first in the point's run: its lines come before the point's outcome
            for said in result.get("warm_start") or []:
                console.print(f"  {point.name} {said}", markup=False, highlight=False, soft_wrap=True)
        line = escape(f"{point.name}: {result['status']}")  # the progress line is markup (red for a failure)
        if result.get("locked"):
            line = f"[red]{line}[/] ({escape(result['error'].removeprefix('RunLocked: '))})"
        elif result["status"] == "failed":
            line = f"[red]{line}[/] (see {escape(str(point.run_dir / 'error.txt'))})"
        progress.advance(line, always=result["status"] == "failed")

    with progress:
        if executor == "ray":
            from . import ray_executor

            ray_executor.run_points(todo, finish, _check_lock, address, _run_point,
                                    on_running=lambda names: progress.running(", ".join(names)))
        elif jobs <= 1:
            for point in todo:
                still_there()
                progress.running(point.name)
                resume = point.run_dir.exists()
                result = _check_lock(point) or _run_point(point.config.to_dict(), resume, None)
                finish(point, result)
                if result["status"] == "interrupted":  # the point ran here: the signal it recorded is the sweep's
                    raise stopped_by(result.get("signal") or "SIGINT")
        else:
            _run_parallel(todo, jobs, threads, finish, progress)
    return statuses


def _identity(directory: Path) -> tuple[int, int] | None:
    """``directory``'s (device, inode); None when it is gone."""
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def point_config(point: SweepPoint, slot: int, device_count: int | None = None) -> dict:
    """The config a worker in ``slot`` runs ``point`` with: on a machine with several GPUs a ``cuda`` point runs on
    GPU ``slot mod device_count`` (``worker_device``), so the ``--jobs`` workers each have their own; otherwise the
    point's config as it is (the CPU's bits unchanged)."""
    config = point.config.to_dict()
    config["device"] = worker_device(config["device"], slot, device_count)
    return config


def _new_pool(jobs: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"), initializer=_worker_init,
                               initargs=(os.getpid(),))


def _run_parallel(todo: list[SweepPoint], jobs: int, threads: int | None, finish, progress: StepReporter) -> None:
    pending = list(todo)
    running: dict[Future, SweepPoint] = {}
    slots: dict[Future, int] = {}  # the worker slot (0 .. jobs - 1) each running point holds: its GPU
    pool = _new_pool(jobs)
    try:
        while pending or running:
            while pending and len(running) < jobs:
                point = pending.pop(0)
                resume = point.run_dir.exists()
                locked = _check_lock(point)
                if locked:
                    finish(point, locked)
                    continue
                slot = min(set(range(jobs)) - set(slots.values()))
                try:
                    future = pool.submit(_run_point, point_config(point, slot), resume, threads)
                    running[future], slots[future] = point, slot
                except BrokenProcessPool:  # a worker died while idle; the running points' futures say so too
                    pending.insert(0, point)
                    if running:
                        break
                    pool.shutdown(wait=True)
                    pool = _new_pool(jobs)
            if not running:
                continue
            progress.running(", ".join(p.name for p in running.values()))
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            results = {future: _result(future) for future in done}
            if any(result is None for result in results.values()):
                # The pool is broken: it fails every running future and stops its other workers. Record them all
                # and go on with the remaining points in fresh workers.
                done, _ = wait(running)
                results = {future: _result(future) or {"status": "failed", "error": WORKER_DIED} for future in done}
                pool.shutdown(wait=True)
                pool = _new_pool(jobs)
            for future, result in results.items():
                slots.pop(future, None)
                finish(running.pop(future), result)
    except KeyboardInterrupt as stop:
        _interrupt_workers(pool, stop_signal(stop))
        pool.shutdown(wait=False, cancel_futures=True)
        _record_stopped(running, finish)
        raise
    finally:
        pool.shutdown(wait=True)


def _record_stopped(running: dict[Future, SweepPoint], finish) -> None:
    """The points running when the sweep was stopped, recorded (sweep.json, the report) as their workers left them:
    each records itself as interrupted on the signal passed on, as a sequential sweep records the point it stopped.
    A point whose worker never started it stays pending."""
    done, _ = wait(running)
    for future in done:
        if not future.cancelled():
            finish(running[future], _result(future) or {"status": "interrupted", "error": None})


def _interrupt_workers(pool: ProcessPoolExecutor, sig: signal.Signals) -> None:
    """Pass the signal that stopped the sweep (SIGINT or SIGTERM) on to its workers. Ctrl-C in a terminal reaches
    every process of the group, but a signal sent to the sweep alone (``kill``, a job scheduler) does not: without
    this, the sweep would wait for every running point to finish before it stops. Each worker's point records
    itself as interrupted (a worker takes SIGTERM as Ctrl-C: ``_worker_init``)."""
    for process in list((pool._processes or {}).values()):  # noqa: SLF001 -- the executor exposes no worker list
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, sig)


def _result(future: Future) -> dict | None:
    """A finished point's result; None if its worker process died."""
    try:
        return future.result()
    except BrokenProcessPool:
        return None
