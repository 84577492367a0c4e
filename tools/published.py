"""The map against published runs: each operating point a public source pins down, and what the map says for it.

``python -m tools.published [--map FILE]`` prints the tables of docs/results/published_runs.md: the points and
bars of ``published_runs.yaml`` (the data: source, what it logged, k3, T, correction, model, outcome) with what the
map says, computed here with ``vexact.map`` -- so the map's columns are generated, never typed:

* **their correction's curve**: ``place_on_map`` on the curve of the point's own correction, when the source names
  it, gives its T, and the map has that curve;
* **the bypass law**: the bypass curve's verdict at the point's T, or, without a T, the horizon at which the law's
  50% threshold falls to the point's k3 (``horizon_at``): above that T the law calls this k3 a collapse level;
  a horizon whose 50% point lies below its smallest dose, a dose <= k3, puts it earlier when the law says later
  (``measured_horizon``);
* **agrees?**: the outcome against the verdict of their correction's curve (``agreement``), else against the bypass
  law, labelled as such; "cannot test" where the map has no verdict for the point (no k3, no T, no outcome).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vexact.map.naming import BYPASS, correction_names
from vexact.map.verdict import (
    DEFAULT_TAIL_MAP,
    collapsed_from,
    curve_for,
    default_source,
    load_map,
    map_curves,
    map_vocab,
    placement,
)
from vexact.rl.validate import parse_yaml
from vexact.sweeps.markdown_table import markdown_table

__all__ = ["POINTS_FILE", "Bar", "PublishedPoint", "agreement", "bars_table", "horizon_at", "load_published",
           "measured_horizon", "measured_horizon_at",
           "points_table"]

POINTS_FILE = Path(__file__).with_name("published_runs.yaml")
OUTCOMES = ("collapsed", "survived", "not stated")


@dataclass(frozen=True)
class PublishedPoint:
    """One published run. ``k3`` / ``k3_high``: the value or range placed on the map (None: the source gives none);
    ``horizon``: mean response length T in tokens (None: not given); ``correction``: a map curve name (None: not
    stated); ``*_text``: the source's own words where they say more than the number."""

    id: str
    source: str
    model: str
    published: str
    outcome: str
    k3: float | None = None
    k3_high: float | None = None
    horizon: float | None = None
    horizon_text: str | None = None
    correction: str | None = None
    correction_text: str | None = None
    outcome_text: str | None = None
    why: str = ""


@dataclass(frozen=True)
class Bar:
    """A published level users weigh their own against (no run behind it)."""

    id: str
    source: str
    bar: str
    k3: float | None = None
    why: str = ""


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def load_published(path: str | Path | None = None) -> tuple[list[PublishedPoint], list[Bar]]:
    """The points and bars of ``published_runs.yaml`` (or ``path``), checked: one ValueError naming the entry."""
    path = Path(path) if path is not None else POINTS_FILE
    data = parse_yaml(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise ValueError(f"{path}: expected a mapping with a 'points' list (and 'bars')")
    points, bars = [], []
    for i, entry in enumerate(data["points"]):
        where = f"{path}: points[{i}]"
        try:
            point = PublishedPoint(**entry)
        except TypeError as err:
            raise ValueError(f"{where}: {err}") from None
        if point.outcome not in OUTCOMES:
            raise ValueError(f"{where} ({point.id}): outcome {point.outcome!r} is none of {', '.join(OUTCOMES)}")
        if point.correction is not None and point.correction not in correction_names():
            raise ValueError(f"{where} ({point.id}): correction {point.correction!r} is none of "
                             f"{', '.join(correction_names())}")
        for key in ("k3", "k3_high", "horizon"):
            value = getattr(point, key)
            if value is not None and not _positive(value):
                raise ValueError(f"{where} ({point.id}): {key} must be a positive number or null, got {value!r}")
        points.append(point)
    for i, entry in enumerate(data.get("bars") or []):
        try:
            bars.append(Bar(**entry))
        except TypeError as err:
            raise ValueError(f"{path}: bars[{i}]: {err}") from None
    return points, bars


def horizon_at(curve: dict[str, Any], k3: float) -> float | None:
    """The T at which a fitted curve's law puts its 50% threshold at ``k3`` (None without a law)."""
    if curve.get("status") != "fitted":
        return None
    return 10 ** ((curve["log10_prefactor"] - math.log10(k3)) / curve["alpha"])


def measured_horizon(curve: dict[str, Any], k3: float) -> dict[str, Any] | None:
    """The shortest horizon whose 50% point lies below its smallest dose D <= ``k3`` (every run collapsed, or the fit
    put it there): the threshold is below ``k3`` there already, whatever the law says (None when no such horizon was
    measured)."""
    below = [h for h in curve.get("horizons") or []
             if h.get("status") == "below_range" and isinstance(h.get("horizon"), (int, float))
             and isinstance(h.get("upper_bound"), (int, float)) and h["upper_bound"] <= k3]
    return min(below, key=lambda h: (h["horizon"], h["upper_bound"])) if below else None


def measured_horizon_at(curve: dict[str, Any], k3: float) -> tuple[float, float] | None:
    """(T_b, D) of ``measured_horizon``: its horizon and smallest dose."""
    h = measured_horizon(curve, k3)
    return None if h is None else (h["horizon"], h["upper_bound"])


def agreement(outcome: str, verdict: str) -> str:
    """A published outcome against a verdict: a collapse agrees with "above" / "near", a survival with "far below"
    / "below every level tested"; a survival "near" the range is consistent with it; anything else cannot test."""
    if outcome == "not stated":
        return "cannot test: no outcome"
    if verdict.startswith(("above", "near")):
        if outcome == "collapsed":
            return "agrees"
        return "disagrees" if verdict.startswith("above") else "consistent (near the range: either outcome)"
    if verdict.startswith(("far below", "below every level tested")):
        return "agrees" if outcome == "survived" else "disagrees"
    return "cannot test: the map has no verdict here"


def _k3_text(point: PublishedPoint) -> str:
    if point.k3 is None:
        return "—"
    return f"{point.k3:.3g}" + (f" – {point.k3_high:.3g}" if point.k3_high is not None else "")


def _num(x: float) -> str:
    """A horizon or a factor in a cell: whole numbers with thousands separators from 100 on."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _short(placed: dict[str, Any]) -> str:
    """A verdict in a table cell: its first clause, the threshold, the range the two shapes allow beyond the measured
    horizons, how far T was extrapolated, and whether the law rests on horizons of one run per dose."""
    core = placed["verdict"].split(";")[0]
    parts = [f"threshold {placed['threshold_50']:.2g}"] if placed["threshold_50"] is not None else []
    if placed.get("range_low") is not None:
        parts.append(f"range {placed['range_low']:.2g} .. {placed['range_high']:.2g}")
    if placed["extrapolation_factor"] > 1:
        parts.append(f"T {_num(placed['extrapolation_factor'])}x outside the curve")
    if "the law rests on horizon(s) fitted from one run per dose" in placed["verdict"]:
        parts.append("the law rests on one run per dose at its longest horizon" if placed["extrapolation_factor"] > 1
                     else "the law rests on one run per dose at some horizons")
    return core + (f" ({', '.join(parts)})" if parts else "")


def _cells(texts: list[str], ends: list[float]) -> str:
    """One cell for a k3 or a k3 range: the text once when both ends say the same, else each end's."""
    if len(set(texts)) == 1:
        return texts[0]
    return "; ".join(f"k3 {k3:.3g}: {text}" for k3, text in zip(ends, texts))


def _at_horizon(t: float | None) -> str:
    if t is None:
        return "no law"
    return "above the threshold at every T ≥ 1" if t < 1 else f"the threshold falls to it at T ≈ {_num(t)}"


def _horizon_text(curve: dict[str, Any], k3: float) -> str:
    """Where the threshold falls to ``k3``: the law's T, unless a measured collapse at a lower dose puts it earlier
    (a horizon whose 50% point lies below its smallest dose is a measurement the law was not fitted to, and it wins)."""
    t = horizon_at(curve, k3)
    there = measured_horizon(curve, k3)
    if there is not None and (t is None or t > there["horizon"]):
        return (f"the threshold is below it by T ≈ {_num(there['horizon'])} (measured: {collapsed_from(there)} there, "
                f"from k3 {there['upper_bound']:.2g})" + (f"; the law says T ≈ {_num(t)}" if t is not None else ""))
    return _at_horizon(t)


def _default_source_corrections(map_data: dict[str, Any]) -> set[str]:
    """The corrections a map has curves for on its default source: published points are placed on those curves (none
    of them names its source as one of the map's)."""
    default = default_source(map_data)
    return {c["correction"] for c in map_curves(map_data) if c["source"] == default}


def _assess(point: PublishedPoint, map_data: dict[str, Any]) -> tuple[str, str, str]:
    """(their correction's curve, the bypass law, agrees?) for one point."""
    names = _default_source_corrections(map_data)
    own = own_verdict = None
    if point.k3 is None:
        return "no k3", "no k3", "cannot test: no k3"
    if point.correction is None:
        own = "correction not stated"
    elif point.correction not in names:
        own = f"no {point.correction} curve on the map"
    elif point.horizon is None:
        own = "no T"
    ends = [point.k3] + ([point.k3_high] if point.k3_high is not None else [])
    if own is None:
        placed = [placement(map_data, k3, point.horizon, point.correction) for k3 in ends]
        own = _cells([_short(p) for p in placed], ends)
        own_verdict = placed[-1 if point.outcome == "collapsed" else 0]["verdict"]  # the end that tests the outcome
    bypass, bypass_verdict = "no bypass curve on the map", None
    if BYPASS in names:
        curve = curve_for(map_data, BYPASS)
        if point.horizon is not None:
            placed = [placement(map_data, k3, point.horizon, BYPASS) for k3 in ends]
            bypass = _cells([_short(p) for p in placed], ends)
            bypass_verdict = placed[-1 if point.outcome == "collapsed" else 0]["verdict"]
        elif curve.get("status") == "fitted":
            t0, t1 = curve["horizon_range"]
            bypass = _cells([_horizon_text(curve, k3) for k3 in ends], ends) + (
                f" (measured: T = {t0:.0f} .. {t1:.0f})")
        else:
            bypass = f"no law on the bypass curve ({curve.get('status')})"
    if own_verdict is not None:
        agrees = agreement(point.outcome, own_verdict)
    elif bypass_verdict is not None:
        result = agreement(point.outcome, bypass_verdict)
        agrees = result if result.startswith("cannot") else f"bypass law {result}; their correction is not on the map"
    else:
        agrees = "cannot test: no T"
    return own, bypass, agrees


def _tail_cell(point: PublishedPoint, tail_map: dict[str, Any]) -> str:
    """What the tail map (the map ``compare --map --vocab`` picks for a real vocabulary) says for a point: on their
    correction's curve when the tail map has it, else on its bypass curve, named."""
    if point.k3 is None or point.horizon is None:
        return "no k3" if point.k3 is None else "no T"
    names = _default_source_corrections(tail_map)
    name = point.correction if point.correction in names else BYPASS if BYPASS in names else None
    if name is None:
        return "no curve"
    ends = [point.k3] + ([point.k3_high] if point.k3_high is not None else [])
    placed = [placement(tail_map, k3, point.horizon, name) for k3 in ends]
    texts = []
    for p in placed:
        if p["verdict"].startswith("no verdict"):
            t0, t1 = curve_for(tail_map, name)["horizon_range"]
            texts.append(f"no verdict at T = {_num(point.horizon)} (measured at T = {_num(t0)} .. {_num(t1)})")
        else:
            texts.append(_short(p))
    label = "" if name == point.correction else f"{name} curve: "
    return label + _cells(texts, ends)


def points_table(map_data: dict[str, Any], points: list[PublishedPoint], tail_map: dict[str, Any] | None = None
                 ) -> str:
    """The published points with what the map says (Markdown); with ``tail_map``, what it says too (every published
    run has a real vocabulary, so ``compare --map --vocab`` answers from it)."""
    rows = []
    for p in points:
        own, bypass, agrees = _assess(p, map_data)
        horizon = "—" if p.horizon is None else f"{p.horizon:,.0f}"
        rows.append([
            p.source, p.model, p.published, _k3_text(p), horizon + (f" ({p.horizon_text})" if p.horizon_text else ""),
            (p.correction or "not stated") + (f" ({p.correction_text})" if p.correction_text else ""),
            p.outcome + (f": {p.outcome_text}" if p.outcome_text else ""), own, bypass, agrees,
            *([_tail_cell(p, tail_map)] if tail_map is not None else [])])
    tail = [f"tail map (V = {map_vocab(tail_map):,}, what --vocab picks)"] if tail_map is not None else []
    return markdown_table(["source", "model", "as published", "k3 placed", "T (tokens)", "correction", "outcome",
                           "map: their correction's curve", "map: the bypass law", "agrees?", *tail], rows)


def bars_table(map_data: dict[str, Any], bars: list[Bar]) -> str:
    """Published bars with the T at which the bypass law's threshold falls to each (Markdown)."""
    names = _default_source_corrections(map_data)
    rows = []
    for b in bars:
        if b.k3 is None:
            says = b.why or "not placeable"
        elif BYPASS not in names:
            says = "no bypass curve on the map"
        else:
            says = _horizon_text(curve_for(map_data, BYPASS), b.k3)
        rows.append([b.source, b.bar, "—" if b.k3 is None else f"{b.k3:.2g}", says])
    return markdown_table(["source", "bar", "k3 placed", "map: the bypass law"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.published",
                                     description="print the published-runs tables with what the map says")
    parser.add_argument("--map", type=Path, default=None, metavar="FILE", help="a map (default: the shipped one)")
    parser.add_argument("--tail-map", type=Path, default=None, metavar="FILE",
                        help="a map with a vocabulary tail, for its own column (default: the shipped tail map, when "
                             "there is one)")
    parser.add_argument("--points", type=Path, default=None, metavar="FILE",
                        help="the points (default: tools/published_runs.yaml)")
    args = parser.parse_args(argv)
    try:
        map_data = load_map(args.map)
        tail_path = args.tail_map or (DEFAULT_TAIL_MAP if DEFAULT_TAIL_MAP.is_file() else None)
        tail_map = load_map(tail_path) if tail_path is not None else None
        points, bars = load_published(args.points)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(points_table(map_data, points, tail_map))
    print()
    print(bars_table(map_data, bars))
    return 0


if __name__ == "__main__":
    sys.exit(main())
