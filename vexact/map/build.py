"""Building a map, and its command line (``python -m vexact.map build-map | sensitivity | shape``).

**Assembling a map** (``build_map``): from sweep directories, whose runs of one (correction, horizon) are merged
into one dose-response fit when their resolved configs agree (``RUN_KEYS`` and ``BOOKKEEPING_KEYS`` aside), and from
``scaling.json`` files, whose curves join horizon by horizon; α is refitted per correction over all its horizons.
Each horizon fitted from runs carries what its collapses were (``failure_kinds``, ``vexact.sweeps.failure``: length
lost, limit overrun, reward lost at intact length) and whether a length surge came first. **The detector's
sensitivity** (``sensitivity``, ``python -m vexact.map sensitivity INPUT...``): the map rebuilt with every run of the
sweep directories judged again from its logged metrics under other recovery windows (``patience``) and drop
fractions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ..records import CONFIG_FILE
from ..records.atomic import write_text_atomic
from ..rl.collapse import detect_collapse
from ..rl.config_schema import MEMORY_KEYS, CollapseSection
from ..rl.horizon_task import horizon_overrides
from ..rl.validate import parse_yaml
from ..sweeps.dose_response import METRIC
from ..sweeps.sweep_data import SEED_KEY, PointData, read_sweep_results
from .fit import fit_curve, fit_law, horizon_order, law_band
from .naming import (
    DEFAULT_CORRECTION,
    correction_from_config,
    correction_names,
    default_config,
    flat_config,
    knob_as_value,
    source_name,
)
from .points import (
    HORIZON_KEY,
    HORIZON_METRIC,
    POLICY_LAG_KEY,
    finite,
    horizon_value,
    interval_text,
    positive,
    sweep_variants,
)
from .scaling_report import failure_lines
from .shapes import compare_shapes
from .verdict import bound_lines, curve_for, fmt_t, load_map, one_run

RUN_KEYS = ("name", "output_dir", SEED_KEY, "inject.value")
"""Config keys that differ between the runs of one dose-response by design: the run's name and directory, its seed
and the injected magnitude."""
BOOKKEEPING_KEYS = ("threads", "warm_start.cache_dir", "logging.checkpoint_every", "logging.live",
                    "logging.backends", "logging.wandb_project", "logging.wandb_mode", "monitor", *MEMORY_KEYS)
"""Config keys that say where a run writes, what it shows while running, how many threads it uses, which sequences
it rescores for its mismatch metrics (``monitor.*``) and whether it recomputes activations to save memory; a run's
bits do not depend on them (``test_activation_checkpointing_changes_no_bit``, ``tests/rl/test_monitor_sampling.py``)."""
HORIZON_SETTINGS = (*horizon_overrides(1), "task.hold_length")
"""The keys that set a horizon of the horizon testbed (the scratchpad length, the room to write it, and whether the
reward holds that length: a free scratchpad shortens under RL, so the longest horizons hold it to keep T near L):
they differ between the horizons of one curve, and nowhere else."""


@dataclasses.dataclass
class _Run:
    """One point of a sweep directory given to build-map, with its resolved config (dotted keys)."""

    sweep: str
    point: PointData
    config: dict[str, Any]


CurveKey = tuple[str, str, int]  # (correction, source, policy lag): one curve of a map


SWEEP_SCOPE = ":"
"""``--only SWEEP:KEY=VALUE[,...]``: the filter binds the runs of the sweep directory named SWEEP only (the tail
map keeps L = 1 and 16 of the tail sweep, whose L = 80 drops are unconfirmed, and L = 80 of the corrections sweep)."""


def _scope_and_key(key: str) -> tuple[str, str]:
    """An ``--only`` key split into (sweep name, config key): ``"SWEEP:task.max_len"`` -> ``("SWEEP",
    "task.max_len")``; an unscoped key's sweep name is ``""``."""
    scope, _, config_key = key.rpartition(SWEEP_SCOPE)
    return scope, config_key


def parse_only(items: list[str] | None) -> dict[str, list[Any]]:
    """``[SWEEP:]KEY=VALUE[,VALUE...]`` items (build-map's ``--only``) as {[SWEEP:]config key: allowed values}, each
    value read as YAML (``1002``, ``true``, ``recompute``); a key that is no run config key is one error naming it.
    With ``SWEEP:`` (a sweep directory's name) the filter binds that sweep's runs only (``SWEEP_SCOPE``)."""
    defaults = default_config()
    wanted: dict[str, list[Any]] = {}
    for item in items or []:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise ValueError(f"--only {item!r}: expected KEY=VALUE[,VALUE...] or SWEEP:KEY=VALUE[,VALUE...], e.g. "
                             "--only task.distractors=1002")
        scope, config_key = _scope_and_key(key)
        if config_key not in defaults:
            raise ValueError(f"--only {item!r}: {config_key!r} is not a run config key")
        if key != config_key and not scope:
            raise ValueError(f"--only {item!r}: no sweep name before {SWEEP_SCOPE!r}")
        wanted.setdefault(key, []).extend(parse_yaml(v.strip()) for v in values.split(","))
    return wanted


def _filters_of(path: Path, only: dict[str, list[Any]] | None) -> dict[str, list[Any]]:
    """The ``only`` filters that bind the runs of sweep directory ``path``: the unscoped ones and those scoped to its
    name, as {config key: values}."""
    filters: dict[str, list[Any]] = {}
    for key, values in (only or {}).items():
        scope, config_key = _scope_and_key(key)
        if not scope or scope == path.name:
            filters.setdefault(config_key, []).extend(values)
    return filters


def _sweep_runs(path: Path, only: dict[str, list[Any]] | None = None, detector: dict[str, Any] | None = None
                ) -> tuple[dict[CurveKey, dict[Any, list[_Run]]], int]:
    """The finished points of one sweep directory as {(correction, source): {horizon value: runs}}, and how many runs
    with router replay were left out; a finished point without its config.yaml, or a sweep without finished runs, is
    one error naming it.

    A point's horizon value is its ``task.max_len`` from the sweep's grid or variant, else from its saved config (a
    sweep that does not vary the horizon gives a curve of one horizon). Runs with ``algorithm.router_replay`` are
    left out: replay removes the routing mismatch, so their realised k3 is another source's (the rest of the
    rollout's mismatch), not the swept one. ``only`` ({config key: values}, ``parse_only``) keeps the runs whose
    saved config holds one of the values at every key: one testbed out of a sweep that varies it (the tail sweep's
    two vocabularies). ``detector`` ({collapse setting: value}, e.g. patience and drop) judges every run again from
    its logged metrics with its own saved ``collapse`` settings so changed (``redetect``)."""
    data = read_sweep_results(path)
    variants = sweep_variants(data)
    only = _filters_of(path, only)
    defaults = default_config()
    out: dict[CurveKey, dict[Any, list[_Run]]] = {}
    replayed = 0
    for p in data.points:
        saved = p.dir / CONFIG_FILE
        if not p.has_result:
            continue  # not finished (never started, running or failed): no dose or outcome to fit
        try:
            loaded = parse_yaml(saved.read_text()) if saved.is_file() else None
        except (OSError, yaml.YAMLError, UnicodeDecodeError) as err:
            raise ValueError(f"'{saved}' cannot be read ({str(err).splitlines()[0]}): build-map compares the "
                             "configs of the runs it merges") from None
        if not isinstance(loaded, Mapping):
            raise ValueError(f"point '{p.name}' of sweep '{path}' has a result but no config.yaml (a mapping) in "
                             f"'{p.dir}': build-map compares the configs of the runs it merges")
        config = knob_as_value(flat_config(loaded))
        if only and any(config.get(key, defaults.get(key)) not in values for key, values in only.items()):
            continue
        if config.get("algorithm.router_replay"):
            replayed += 1
            continue
        if detector:
            redetect(p, loaded, detector)
        value = horizon_value(p, variants)
        value = config.get(HORIZON_KEY) if value is None else value
        if value is None:
            continue
        key = (correction_from_config(loaded, str(saved)), source_name(config, defaults),
               int(config.get(POLICY_LAG_KEY) or 0))
        out.setdefault(key, {}).setdefault(value, []).append(_Run(str(path), p, config))
    if not out:
        kept = f" with {' and '.join(f'{k} in {v}' for k, v in only.items())}" if only else ""
        raise ValueError(f"sweep '{path}' has no finished runs{kept} with a horizon ({HORIZON_KEY}) outside router "
                         "replay: it has no points for a map")
    return out, replayed


def redetect(point: PointData, config: Mapping, settings: dict[str, Any]) -> None:
    """Judge a finished run again from its logged metrics: its saved ``collapse`` section with ``settings`` (say
    ``patience`` and ``drop``) changed; the run's collapse summary (its verdict, collapse step and dose) is replaced
    in memory, never on disk."""
    saved = config.get("collapse") if isinstance(config.get("collapse"), Mapping) else {}
    known = {f.name for f in dataclasses.fields(CollapseSection)}
    section = CollapseSection(**{k: v for k, v in {**saved, **settings}.items() if k in known})
    summary = point.summary or {}
    point.summary = {**summary, "collapse": detect_collapse(point.metrics, section, summary.get("reason"),
                                                            summary.get("stopped_at_step"))}


def _config_difference(a: dict[str, Any], b: dict[str, Any], exempt: tuple[str, ...]) -> list[tuple[str, Any, Any]]:
    """(key, value in a, value in b) for every non-exempt key where the two configs differ; a key one of them lacks
    (saved before it existed) counts as its default."""
    defaults = default_config()
    missing = object()
    diffs = []
    for key in sorted(set(a) | set(b)):
        if key in exempt or any(key.startswith(e + ".") for e in exempt):
            continue
        va, vb = a.get(key, defaults.get(key, missing)), b.get(key, defaults.get(key, missing))
        if va != vb:
            diffs.append((key, "(absent)" if va is missing else va, "(absent)" if vb is missing else vb))
    return diffs


def _run_label(run: _Run) -> str:
    return f"'{run.sweep}' point '{run.point.name}'"


def _check_testbed(reference: _Run, run: _Run, exempt: tuple[str, ...], what: str) -> None:
    """One error naming the first key where ``run``'s config leaves ``reference``'s testbed (and how many more)."""
    diffs = _config_difference(reference.config, run.config, exempt)
    if diffs:
        key, a, b = diffs[0]
        more = (f" (and {len(diffs) - 1} more key(s): {', '.join(k for k, _, _ in diffs[1:4])})"
                if len(diffs) > 1 else "")
        raise ValueError(f"{what}: {_run_label(reference)} and {_run_label(run)} differ in {key} ({a!r} vs {b!r})"
                         f"{more}: their runs are not one testbed, so they cannot share one dose-response fit")


def _sweep_curve(key: CurveKey, by_h: dict[Any, list[_Run]]) -> dict[str, Any]:
    """One correction's curve from the runs of several sweeps: the runs of one horizon (task.max_len) merged into one
    dose-response fit when their configs agree apart from ``RUN_KEYS`` and ``BOOKKEEPING_KEYS``; the horizons of the
    curve agree apart from ``HORIZON_SETTINGS`` too."""
    correction, source, lag = key
    per_run = RUN_KEYS + BOOKKEEPING_KEYS
    curve_reference: tuple[Any, _Run] | None = None  # (its horizon value, the run)
    for value in sorted(by_h, key=horizon_order):
        configured = by_h[value]
        for run in configured[1:]:
            _check_testbed(configured[0], run, per_run, f"correction {correction!r} at {HORIZON_KEY} = {value}")
        if configured and curve_reference is None:
            curve_reference = value, configured[0]
        elif configured and curve_reference is not None:
            _check_testbed(curve_reference[1], configured[0], per_run + HORIZON_SETTINGS,
                           f"correction {correction!r}, horizons {HORIZON_KEY} = {curve_reference[0]} and {value}")
    curve = fit_curve(_label(key), correction, {v: [r.point for r in runs] for v, runs in by_h.items()})
    curve["source"], curve["policy_lag"] = source, lag
    for h in curve["horizons"]:
        counts: dict[str, int] = {}
        for run in by_h[h["horizon_value"]]:
            counts[run.sweep] = counts.get(run.sweep, 0) + 1
        h["sweeps"] = counts
    curve["provenance"] = {"what": f"{RUNS_OF}{', '.join(sorted({r.sweep for rs in by_h.values() for r in rs}))} "
                                   f"({HORIZON_KEY} = {', '.join(str(v) for v in sorted(by_h, key=horizon_order))})"}
    if curve_reference is not None:
        curve["testbed"] = {k: v for k, v in sorted(curve_reference[1].config.items())
                            if k not in per_run + HORIZON_SETTINGS and not any(k.startswith(e + ".") for e in per_run)}
    return curve


def _label(key: CurveKey) -> str:
    return f"correction={key[0]}, source={key[1]}" + (f", policy_lag={key[2]}" if key[2] else "")


MERGED = "Merged, horizon by horizon: "
RUNS_OF = "the runs of "


def _what_parts(what: str) -> list[str]:
    """A curve's provenance sentence as its inputs' sentences: a merged one ("Merged, horizon by horizon: [a] + [b]",
    nested when a map was rebuilt from itself) flattened into [a, b, ...], anything else as itself."""
    if not (what.startswith(MERGED + "[") and what.endswith("]")):
        return [what]
    inner, parts, depth, start = what[len(MERGED):], [], 0, 0
    for i, char in enumerate(inner):  # split on " + " between top-level brackets
        depth += (char == "[") - (char == "]")
        if depth == 0 and char == "]":
            parts.extend(_what_parts(inner[start + 1:i]))
            start = i + 4  # past "] + ["'s "] + "
    return parts


def _runs_of(part: str) -> list[str]:
    """The sweep directories a "the runs of A, B (task.max_len = ...)" sentence names (none for other sentences)."""
    if not part.startswith(RUNS_OF) or " (" not in part:
        return []
    return [d.strip() for d in part[len(RUNS_OF):part.index(" (")].split(",")]


def _merge_sources(curve_key: CurveKey, file_curves: list[tuple[dict[str, Any], str]], swept: dict[str, Any] | None,
                   given_dirs: frozenset[str] = frozenset()) -> dict[str, Any]:
    """One (correction, source)'s curve from the curves of map files and (``swept``) the curve fitted to sweep
    directories' runs. A single input stays as it is; several are merged horizon by horizon (one horizon in two
    inputs is an error: a file holds thresholds, not runs) and the law refitted over all of them. A file's horizon
    that was fitted from sweep directories given again (``given_dirs``: its ``sweeps`` name only those) is superseded
    by their runs, which now hold more points: a map grows by rebuilding it from itself and the same directories."""
    name = curve_key[0]
    swept_values = {h.get("horizon_value") for h in (swept or {}).get("horizons") or []}
    file_curves = [({**curve, "horizons": [h for h in curve.get("horizons") or []
                                           if not (h.get("horizon_value") in swept_values and h.get("sweeps")
                                                   and set(h["sweeps"]) <= given_dirs)]}, where)
                   for curve, where in file_curves]
    sources: list[tuple[dict[str, Any], str]] = list(file_curves) + ([(swept, "sweep directories")] if swept else [])
    if len(sources) == 1:
        return dict(sources[0][0])
    seen: dict[Any, str] = {}
    horizons = []
    for curve, where in sources:
        for h in curve.get("horizons") or []:
            key = h.get("horizon_value")
            if key in seen:
                raise ValueError(f"two sources hold correction {name!r} at {HORIZON_KEY} = {key}: {seen[key]} and "
                                 f"{where}: a scaling.json holds thresholds, not runs, so only sweep directories "
                                 "can be merged at one horizon (give that sweep's directory instead of its file)")
            seen[key] = f"'{where}'" if where != "sweep directories" else "the sweep directories"
            horizons.append({**h, "sweeps": h.get("sweeps") or {where: h.get("runs_total")}})
    testbeds = [(c["testbed"], w) for c, w in sources if isinstance(c.get("testbed"), dict)]
    for (a, wa), (b, wb) in zip(testbeds, testbeds[1:]):
        diffs = _config_difference(a, b, HORIZON_SETTINGS)
        if diffs:
            key, va, vb = diffs[0]
            raise ValueError(f"correction {name!r}: the curves of '{wa}' and '{wb}' come from different testbeds: "
                             f"{key} is {va!r} vs {vb!r}")
    unchecked = [w for c, w in sources if not isinstance(c.get("testbed"), dict)]
    horizons.sort(key=lambda h: horizon_order(h.get("horizon_value")))
    law = fit_law(horizons)
    parts: list[str] = []
    for c, w in sources:
        for part in _what_parts(str((c.get("provenance") or {}).get("what") or f"the curve of '{w}'")):
            superseded = w != "sweep directories" and set(_runs_of(part)) <= given_dirs and _runs_of(part)
            if not superseded and part not in parts:  # a directory given again speaks for itself, once
                parts.append(part)
    merged = {"curve": _label(curve_key), "correction": name, "source": curve_key[1], "policy_lag": curve_key[2],
              **law, "horizons": horizons,
              "shape": compare_shapes(horizons),
              "provenance": {"what": parts[0] if len(parts) == 1 else MERGED + " + ".join(f"[{p}]" for p in parts),
                             "testbed_unchecked": [w for w in unchecked if w != "sweep directories"]}}
    if testbeds:
        merged["testbed"] = testbeds[0][0]
    return merged


def build_map(paths: list[str | Path], made_by: str | None = None, only: dict[str, list[Any]] | None = None,
              detector: dict[str, Any] | None = None) -> dict[str, Any]:
    """One map from sweep directories (their runs) and ``scaling.json`` files or maps (their curves), one curve per
    correction, ordered as ``correction_names()``.

    The runs of one (correction, horizon) from several sweep directories are merged into one dose-response fit when
    their resolved configs agree apart from ``RUN_KEYS`` and ``BOOKKEEPING_KEYS`` (else one error naming the key
    that differs); a curve's horizons must agree apart from ``HORIZON_SETTINGS`` too. A file's curve joins them
    horizon by horizon (its configs are unknown: the curve's provenance lists it under ``testbed_unchecked``). α is
    refitted over every horizon of a correction; a horizon where nothing collapsed is a bound, kept in the curve,
    never a threshold in the fit. Each curve gets its shape comparison. The top level is the ``bypass`` curve (else
    the first) so that readers of the single-curve format read it; ``provenance`` names the command and inputs.
    ``only`` (``parse_only``) keeps the runs of the sweep directories whose saved config holds those values (a
    scoped filter, ``SWEEP:KEY``, those of the sweep of that name only); ``detector`` judges their runs again
    under other collapse settings (``redetect``; ``sensitivity``)."""
    if not paths:
        raise ValueError("build-map needs at least one sweep directory or scaling.json")
    file_curves: dict[CurveKey, list[tuple[dict[str, Any], str]]] = {}
    swept: dict[CurveKey, dict[Any, list[_Run]]] = {}
    given_dirs = frozenset(str(Path(p)) for p in paths if Path(p).is_dir())
    unknown = {_scope_and_key(key)[0] for key in only or {}} - {Path(p).name for p in given_dirs} - {""}
    if unknown:
        raise ValueError(f"--only names sweep(s) {', '.join(sorted(unknown))} that are not among the sweep "
                         f"directories given ({', '.join(sorted(Path(p).name for p in given_dirs)) or 'none'})")
    if (only or detector) and not given_dirs:  # a scaling.json's thresholds are fitted already
        flag = "--only" if only else "the collapse settings (--patience, --drop, ...)"
        raise ValueError(f"{flag} {'applies' if only else 'apply'} to the runs of sweep directories, and none was "
                         "given (only map files): "
                         "nothing would be filtered or judged again")
    head: dict[str, Any] = {}
    replayed = 0
    for path in paths:
        path = Path(path)
        if path.is_dir():
            if not (path / "sweep.json").is_file():
                raise ValueError(f"'{path}' is a directory without sweep.json: give a sweep directory or a "
                                 "scaling.json file")
            runs_of, left_out = _sweep_runs(path, only, detector)
            replayed += left_out
            for key, by_h in runs_of.items():
                for value, runs in by_h.items():
                    swept.setdefault(key, {}).setdefault(value, []).extend(runs)
            data = {"metric": METRIC, "horizon_key": HORIZON_KEY, "horizon_metric": HORIZON_METRIC}
            curves: list[dict[str, Any]] = []
        else:
            data = load_map(path)
            curves = data["curves"]
        for key in ("metric", "horizon_key", "horizon_metric"):
            if key in head and data.get(key) != head[key]:
                raise ValueError(f"'{path}' has {key} {data.get(key)!r} but an earlier input has {head[key]!r}: one "
                                 "map holds curves of one metric over one horizon")
            head.setdefault(key, data.get(key))
        for curve in curves:
            curve = dict(curve)
            if "provenance" not in curve and isinstance(data.get("provenance"), dict):
                curve["provenance"] = data["provenance"]
            if "meter" not in curve and isinstance(data.get("meter"), dict) and curve.get("curve") == data.get("curve"):
                curve["meter"] = data["meter"]  # the file's meter comparison belongs to its primary curve
            file_curves.setdefault((curve["correction"], curve["source"], curve["policy_lag"]), []).append(
                (curve, str(path)))
    built = []
    for key in dict.fromkeys([*file_curves, *swept]):
        curve = _merge_sources(key, file_curves.get(key, []),
                               _sweep_curve(key, swept[key]) if key in swept else None, given_dirs)
        curve["shape"] = compare_shapes(curve.get("horizons") or [])
        built.append(curve)
    # the first input's sources first (a map rebuilt from itself keeps its default source), then corrections in
    # registry order
    sources = list(dict.fromkeys(c["source"] for c in built))
    order = {name: i for i, name in enumerate(correction_names())}
    ordered = sorted(built, key=lambda c: (sources.index(c["source"]), c["policy_lag"],
                                           order.get(c["correction"], len(order))))
    primary = next((c for c in ordered if c["correction"] == DEFAULT_CORRECTION), ordered[0])
    provenance = {"made_by": made_by or "vexact.map.build.build_map", "sources": [str(p) for p in paths],
                  "curves": {c["curve"]: (c.get("provenance") or {}).get("what") for c in ordered},
                  "router_replay_runs_left_out": replayed, **({"only": only} if only else {})}
    return {**head, **{k: v for k, v in primary.items() if k != "provenance"}, "curves": ordered,
            "provenance": provenance}


SENSITIVITY_PATIENCE = (10, 20, 30)  # steps the reward must stay down: the runs' own 20 and either side
SENSITIVITY_DROP = (0.4, 0.5, 0.6)  # fraction of the peak lost: the runs' own 0.5 and either side


def sensitivity(paths: list[str | Path], patiences: tuple[int, ...] = SENSITIVITY_PATIENCE,
                drops: tuple[float, ...] = SENSITIVITY_DROP, correction: str = DEFAULT_CORRECTION,
                source: str | None = None, only: dict[str, list[Any]] | None = None) -> list[dict[str, Any]]:
    """The collapse detector's sensitivity: the map rebuilt (``build_map``) with every run of the sweep directories
    judged again from its logged metrics under each (``patience``, ``drop``) (``redetect``), one row each: α with
    its interval and each horizon of the curve of ``correction`` and ``source`` (None: the map's default). Horizons
    a map file brings (no runs behind them) keep their thresholds: ``from_runs`` says which horizons were judged
    again."""
    rows = []
    for patience in patiences:
        for drop in drops:
            built = build_map(paths, only=only, detector={"patience": patience, "drop": drop})
            curve = curve_for(built, correction, source)
            rows.append({"patience": patience, "drop": drop, "status": curve.get("status"),
                         "alpha": curve.get("alpha"), "alpha_ci_low": curve.get("alpha_ci_low"),
                         "alpha_ci_high": curve.get("alpha_ci_high"),
                         "horizons": [{k: h.get(k) for k in ("horizon_value", "horizon", "status", "threshold_50",
                                                             "ci_low", "ci_high", "lower_bound", "upper_bound",
                                                             "collapsed", "runs")}
                                      for h in curve.get("horizons") or []],
                         "from_runs": [h.get("horizon_value") for h in curve.get("horizons") or []
                                       if any(Path(s).is_dir() for s in (h.get("sweeps") or {}))]})
    return rows


def _horizon_cell(h: dict[str, Any]) -> str:
    """One horizon's threshold or bound in a sensitivity line, with its collapse count."""
    count = f" ({h.get('collapsed')}/{h.get('runs')})"
    if h.get("status") == "fitted" and positive(h.get("threshold_50")):
        return f"{h['threshold_50']:.2g}{interval_text(h.get('ci_low'), h.get('ci_high'))}{count}"
    if h.get("status") == "above_range" and positive(h.get("lower_bound")):
        return f"above {h['lower_bound']:.2g}{count}"
    if h.get("status") == "below_range" and positive(h.get("upper_bound")):
        return f"below {h['upper_bound']:.2g}{count}"
    return f"{h.get('status')}{count}"


def sensitivity_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The sensitivity rows as printed lines: per (patience, drop), α and the horizons judged again."""
    lines = []
    for r in rows:
        alpha = (f"α {r['alpha']:.2f}" + (f" [{r['alpha_ci_low']:.2f}, {r['alpha_ci_high']:.2f}]"
                                          if finite(r.get("alpha_ci_low")) else
                                          " (no interval: a horizon's threshold interval is open)")
                 if finite(r.get("alpha")) else f"no α ({r['status']})")
        cells = [f"L = {h['horizon_value']}: {_horizon_cell(h)}" for h in r["horizons"]
                 if h["horizon_value"] in r["from_runs"]]
        lines.append(f"patience {r['patience']}, drop {r['drop']}: {alpha}; " + "; ".join(cells))
    return lines


def _curve_name(curve: dict[str, Any], curves: list[dict[str, Any]]) -> str:
    """A curve in printed lines: its correction, its source where the map has several, and its policy lag where
    it is not 0."""
    several = len({c.get("source") for c in curves}) > 1
    name = f"{curve['correction']} / {curve.get('source')}" if several else curve["correction"]
    return f"{name} / policy lag {curve['policy_lag']}" if curve.get("policy_lag") else name


def band_lines(curve: dict[str, Any]) -> list[str]:
    """Each fitted horizon of a fitted curve against the law's 95% band at its T: inside, or which side it misses."""
    lines = []
    for h in curve.get("horizons") or []:
        band = law_band(curve.get("replicates") or [], h["horizon"]) if positive(h.get("horizon")) else None
        if h.get("status") != "fitted" or band is None:
            continue
        ci = interval_text(h.get("ci_low"), h.get("ci_high"))
        where = ("inside" if band[0] <= h["threshold_50"] <= band[1] else
                 "MISSED (above)" if h["threshold_50"] > band[1] else "MISSED (below)")
        lines.append(f"{HORIZON_KEY} = {h['horizon_value']} (T {fmt_t(h['horizon'])}): threshold "
                     f"{h['threshold_50']:.2g}{ci}{one_run(h)}; the law's 95% band {band[0]:.2g} .. {band[1]:.2g}: "
                     f"{where}")
    return lines


def build_lines(built: dict[str, Any]) -> list[str]:
    """What build-map prints per curve: its law (or why none), its shape comparison, and its bounds."""
    lines = []
    for c in built["curves"]:
        lines.append(f"{_curve_name(c, built['curves'])} ({c['status']}, {len(c.get('horizons') or [])} horizons): "
                     f"{c['note']}")
        lines.append(f"  shape: {c['shape']['note']}")
        lines += [f"  band: {b}" for b in band_lines(c)]
        lines += [f"  failure: {b}" for b in failure_lines(c)]
        lines += [f"  bound (not in the fit): {b}" for b in bound_lines(c)]
    return lines


def _parse_list(text: str, kind: type, flag: str) -> list[Any]:
    """A comma-separated list of numbers of one kind; one error naming the flag otherwise."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated {kind.__name__} values") from None
    if not values:
        raise ValueError(f"{flag} is empty")
    return values


def main(argv: list[str] | None = None) -> int:
    from ..records.runlog import json_safe

    parser = argparse.ArgumentParser(prog="python -m vexact.map", description=(
        "build-map: assemble one collapse map (one curve per correction) from sweep directories (their runs of one "
        "correction and horizon merged into one fit) and scaling.json files; "
        "shape: print the power-law / saturating comparison of each curve of a map."))
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build-map", help="write OUT from the runs of sweep directories and the curves of "
                                             "scaling.json files")
    build.add_argument("out", type=Path, metavar="OUT")
    build.add_argument("inputs", type=Path, nargs="+", metavar="SWEEP_DIR_OR_SCALING_JSON")
    build.add_argument("--only", action="append", default=[], metavar="[SWEEP:]KEY=VALUE[,VALUE...]",
                       help="keep the sweep directories' runs whose saved config holds one of the values (repeat for "
                            "more keys), e.g. --only task.distractors=1002; SWEEP: (a sweep directory's name) "
                            "binds that sweep's runs only")
    sens = sub.add_parser("sensitivity", help="the collapse detector's sensitivity: α and each horizon's threshold "
                                               "with every run of the sweep directories judged again under each "
                                               "recovery window (patience) and drop fraction")
    sens.add_argument("inputs", type=Path, nargs="+", metavar="SWEEP_DIR_OR_SCALING_JSON")
    sens.add_argument("--patience", default=",".join(map(str, SENSITIVITY_PATIENCE)), metavar="STEPS[,STEPS...]",
                      help="recovery windows, in steps (default: %(default)s)")
    sens.add_argument("--drop", default=",".join(map(str, SENSITIVITY_DROP)), metavar="FRACTION[,FRACTION...]",
                      help="drop fractions of the peak (default: %(default)s)")
    sens.add_argument("--correction", default=DEFAULT_CORRECTION, help="the curve to show (default: %(default)s)")
    sens.add_argument("--source", default=None, help="its source (default: the map's first)")
    sens.add_argument("--only", action="append", default=[], metavar="[SWEEP:]KEY=VALUE[,VALUE...]",
                      help="as build-map's --only")
    shape = sub.add_parser("shape", help="print each curve's shape comparison and its fitted horizons against the "
                                         "law's 95%% band (default: the shipped map)")
    shape.add_argument("map", type=Path, nargs="?", default=None, metavar="MAP")
    args = parser.parse_args(argv)
    try:
        if args.command == "build-map":
            command = "python -m vexact.map build-map " + " ".join(
                [str(p) for p in [args.out, *args.inputs]] + [f"--only {item}" for item in args.only])
            built = build_map(list(args.inputs), made_by=command, only=parse_only(args.only))
            if args.out.is_dir():
                raise ValueError(f"'{args.out}' is a directory: give the map's file name")
            # published whole: load_map readers never see half a map, a failed write leaves the old one
            write_text_atomic(args.out, json.dumps(json_safe(built), indent=1, ensure_ascii=False) + "\n")
            print(f"wrote {args.out}: " + "; ".join(f"{_curve_name(c, built['curves'])} ({c['status']}, "
                                                     f"{len(c.get('horizons') or [])} horizons)"
                                                     for c in built["curves"]))
            print("\n".join(build_lines(built)))
            return 0
        if args.command == "sensitivity":
            patiences = tuple(_parse_list(args.patience, int, "--patience"))
            drops = tuple(_parse_list(args.drop, float, "--drop"))
            if any(p < 0 for p in patiences) or any(not 0 < d < 1 for d in drops):
                raise ValueError("--patience takes steps >= 0 and --drop fractions strictly between 0 and 1")
            rows = sensitivity(list(args.inputs), patiences, drops, args.correction, args.source,
                               parse_only(args.only))
            print("\n".join(sensitivity_lines(rows)))
            return 0
        curves = load_map(args.map)["curves"]
        for curve in curves:
            print(f"{_curve_name(curve, curves)}: {compare_shapes(curve.get('horizons') or [])['note']}")
            if curve.get("status") == "fitted":
                print(f"  law: {curve['note']} ({curve.get('alpha_ci_method') or 'interval method not recorded'})")
            for line in band_lines(curve):
                print(f"  band: {line}")
            for line in failure_lines(curve):
                print(f"  failure: {line}")
        return 0
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
