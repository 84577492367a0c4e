"""Collapse scaling: how the 50% collapse threshold moves with the response horizon T, and where a user sits.

``scaling(data)`` turns a loaded sweep over (horizon, mismatch) into ``scaling.json`` (a contract)::

    {"metric": "rollout_corr/k3_kl", "horizon_key": "task.max_len", "horizon_metric": "response_length/mean",
     "curve": ..., "status": ..., "note": "...", "alpha": .., "alpha_ci_low": .., "alpha_ci_high": ..,
     "log10_prefactor": .., "horizon_range": [T_min, T_max], "replicates": [[log10 A, alpha], ...],
     "horizons": [{"horizon_value", "horizon", "threshold_50", "ci_low", "ci_high", "status", ...}, ...],
     "curves": [ ... the same for every curve ... ]}

The top level is the primary curve (old log-probs from the rollout, "bypass", when the sweep has it): the one
``compare --map`` reads.

**Horizon.** A point's horizon group is its ``task.max_len`` (the scratchpad length L of ``horizon``, or the input
length of another task), set in the sweep's grid or in its variant's bundle; its horizon T is measured: the run
mean of ``response_length/mean`` (tokens per response). A sweep that sets no ``task.max_len`` has no horizon axis.

**Threshold per horizon.** ``dose_response.fit_threshold`` over that horizon's runs (dose = realised k3 before
collapse, collapse or not, seed): ``threshold_50`` with its seed-bootstrap interval, or a bound
(``above_range``: the 50% point lies above ``lower_bound``, the largest dose tested; ``below_range``: below
``upper_bound``, the smallest).

**The law.** log10 threshold = log10 A − α·log10 T, least squares over the horizons with a fitted threshold
(``status: fitted`` needs two or more). Interval of α: ``BOOTSTRAP`` refits, each horizon's log threshold drawn
from a normal whose 95% range is its bootstrap interval (a horizon with an open interval end leaves α's interval
open: None). Horizons with only a bound never enter as numbers: the fit lists them and says whether the line
respects them; with fewer than two fitted horizons, pairs of (threshold or bound) give bounds on α
(``alpha_lower_bound``/``alpha_upper_bound``), ``status: bounds_only``. Other statuses: ``no_horizon``,
``single_horizon``, ``insufficient`` (points without the metrics), each with one sentence in ``note``.

**Placing a user.** ``place_on_map(map_data, k3, horizon)`` evaluates the law at the user's T (its interval from
the replicates), the ratio k3 / threshold, a verdict in words and how far T lies outside the measured horizons.
``load_map(None)`` is the map shipped with vexact (``default_map.json``, from the docs' horizon sweeps).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from ..metric_keys import K3_KL, RESPONSE_LENGTH_MEAN
from .dose_response import METRIC, fit_threshold, run_dose
from .sweep_data import SEED_KEY, PointData, SweepData

__all__ = ["BOOTSTRAP", "DEFAULT_MAP", "HORIZON_KEY", "fit_law", "load_map", "place_on_map", "plot_scaling",
           "scaling", "write_scaling"]

HORIZON_KEY = "task.max_len"
HORIZON_METRIC = RESPONSE_LENGTH_MEAN
BOOTSTRAP = 1000
BOOTSTRAP_SEED = 0
REPLICATES_KEPT = 200  # replicates stored in scaling.json for the map's interval at a new T
DEFAULT_MAP = Path(__file__).with_name("default_map.json")
PRIMARY_CURVE = ("algorithm.old_logprobs", "rollout")
MAP_KEYS = ("horizon", "k3", "threshold_50", "ci_low", "ci_high", "ratio", "verdict", "extrapolation_factor")
ASSUMPTIONS = (
    "the threshold follows the fitted power law threshold ∝ T^(−alpha) beyond the measured horizons",
    "the map's testbed (a 0.5M-parameter decoder on CPU, on-policy GRPO, the map's old-log-prob mode and run "
    "length) stands for your stack; model size, vocabulary, mini-batches and run length are not on the map",
    "k3 is the token mean of exp(r) − r − 1 over your dump (rollout_corr/k3_kl); the map's doses are run means of "
    "the same metric before collapse",
    "your horizon is your dump's mean response length (tokens per sequence)",
)


# ----------------------------------------------------------------------------- reading a sweep


def _variants(data: SweepData) -> dict[str, dict[str, Any]]:
    try:
        spec = json.loads((data.path / "sweep.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    variants = spec.get("variants") if isinstance(spec, dict) else None
    return variants if isinstance(variants, dict) else {}


def horizon_value(point: PointData, variants: dict[str, dict[str, Any]]) -> Any:
    """The point's ``task.max_len``: from its overrides, else from its variant's bundle; None when neither sets it."""
    if HORIZON_KEY in point.overrides:
        return point.overrides[HORIZON_KEY]
    bundle = variants.get(str(point.overrides.get("variant")), {})
    return bundle.get(HORIZON_KEY) if isinstance(bundle, dict) else None


def measured_horizon(point: PointData) -> float | None:
    """The run mean of ``response_length/mean`` (None without it)."""
    values = [m[HORIZON_METRIC] for m in point.metrics if _number(m.get(HORIZON_METRIC))]
    return sum(values) / len(values) if values else None


def _curve_keys(data: SweepData, variants: dict[str, dict[str, Any]]) -> list[str]:
    """Keys that split curves: every non-seed group key outside ``inject.*``, the horizon key and ``variant`` when
    the variants carry the horizon (or inject settings)."""
    keys = []
    for k in data.group_keys:
        if k in (SEED_KEY, HORIZON_KEY) or k.startswith("inject."):
            continue
        if k == "variant" and variants and any(HORIZON_KEY in b or any(x.startswith("inject.") for x in b)
                                               for b in variants.values() if isinstance(b, dict)):
            continue
        keys.append(k)
    return keys


# ----------------------------------------------------------------------------- the fit


def scaling(data: SweepData) -> dict[str, Any]:
    """The ``scaling.json`` object of a loaded sweep (module docstring)."""
    variants = _variants(data)
    base = {"metric": METRIC, "horizon_key": HORIZON_KEY, "horizon_metric": HORIZON_METRIC, "alpha": None,
            "alpha_ci_low": None, "alpha_ci_high": None, "horizons": [], "curves": []}
    with_h = [p for p in data.points if horizon_value(p, variants) is not None]
    if not with_h:
        return {**base, "status": "no_horizon",
                "note": f"the sweep sets no horizon key ({HORIZON_KEY} in its grid or its variants), so it has no "
                        "horizon axis: no scaling law"}
    keys = _curve_keys(data, variants)
    curves: dict[str, list[PointData]] = {}
    for p in with_h:
        label = ", ".join(f"{k}={p.overrides.get(k)}" for k in keys) or "all"
        curves.setdefault(label, []).append(p)
    results = [_curve(label, points, variants) for label, points in curves.items()]
    primary = next((c for c in results if f"{PRIMARY_CURVE[0]}={PRIMARY_CURVE[1]}" in c["curve"]), results[0])
    return {**base, **{k: v for k, v in primary.items() if k != "curve"}, "curve": primary["curve"],
            "curves": results}


def _curve(label: str, points: list[PointData], variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    by_h: dict[Any, list[PointData]] = {}
    for p in points:
        by_h.setdefault(horizon_value(p, variants), []).append(p)
    horizons, missing = [], 0
    for value in sorted(by_h, key=lambda v: (not _number(v), v if _number(v) else str(v))):
        done = [p for p in by_h[value] if p.has_result]
        runs, lengths = [], []
        for p in done:
            dose, t = run_dose(p), measured_horizon(p)
            if dose is None or t is None:
                missing += 1
                continue
            lengths.append(t)
            if dose > 0:
                runs.append((dose, p.collapse.get("collapsed") is True, p.overrides.get(SEED_KEY)))
        threshold = fit_threshold(runs)
        horizons.append({"horizon_value": value, "horizon": sum(lengths) / len(lengths) if lengths else None,
                         "runs_total": len(by_h[value]), "runs_with_result": len(done), **threshold})
    law = fit_law(horizons)
    if missing:
        law["note"] += f"; {missing} run(s) without a realised {METRIC} or {HORIZON_METRIC} are left out"
    return {"curve": label, **law, "horizons": horizons}


def fit_law(horizons: list[dict[str, Any]]) -> dict[str, Any]:
    """α of threshold ∝ T^(−α) over per-horizon threshold dicts (``horizon`` = measured T; the threshold fields of
    ``dose_response.fit_threshold``), with its interval, or bounds on α, or why neither (module docstring)."""
    out: dict[str, Any] = {"metric": METRIC, "alpha": None, "alpha_ci_low": None, "alpha_ci_high": None,
                           "log10_prefactor": None, "replicates": [], "horizon_range": None}
    usable = [h for h in horizons if _positive(h.get("horizon"))]
    if not usable:
        return {**out, "status": "insufficient",
                "note": f"no horizon has runs with a realised {METRIC} and {HORIZON_METRIC}: nothing to fit"}
    ts = [h["horizon"] for h in usable]
    out["horizon_range"] = [min(ts), max(ts)]
    if len(usable) < 2:
        return {**out, "status": "single_horizon",
                "note": f"one horizon (T = {ts[0]:.1f}): a law in T needs at least two"}
    fitted = [h for h in usable if h.get("status") == "fitted"]
    bounded = [h for h in usable if h.get("status") in ("above_range", "below_range")]
    if len(fitted) < 2:
        return {**out, **_alpha_bounds(fitted, bounded), "horizon_range": [min(ts), max(ts)]}
    xs = [math.log10(h["horizon"]) for h in fitted]
    ys = [math.log10(h["threshold_50"]) for h in fitted]
    slope, intercept = _line(xs, ys)
    out.update(alpha=-slope, log10_prefactor=intercept)
    sds = []
    for h in fitted:
        lo, hi = h.get("ci_low"), h.get("ci_high")
        sds.append((math.log10(hi) - math.log10(lo)) / 3.92 if _positive(lo) and _positive(hi) else None)
    open_ends = [h["horizon_value"] for h, sd in zip(fitted, sds) if sd is None]
    if not open_ends:
        rng = random.Random(BOOTSTRAP_SEED)
        reps = []
        for _ in range(BOOTSTRAP):
            s, c = _line(xs, [y + rng.gauss(0.0, sd) for y, sd in zip(ys, sds)])
            reps.append((c, -s))
        alphas = sorted(a for _, a in reps)
        out["alpha_ci_low"], out["alpha_ci_high"] = alphas[int(0.025 * (BOOTSTRAP - 1))], alphas[
            int(0.975 * (BOOTSTRAP - 1))]
        out["replicates"] = [[round(c, 6), round(a, 6)] for c, a in reps[:REPLICATES_KEPT]]
    violated = [h["horizon_value"] for h in bounded if not _respects(h, intercept, slope)]
    note = (f"threshold ∝ T^(−{-slope:.2f})" + (f" [α in {out['alpha_ci_low']:.2f} .. {out['alpha_ci_high']:.2f}]"
                                               if not open_ends else
                                               f" (no interval: horizon(s) {open_ends} have an open threshold "
                                               "interval)")
            + f" over {len(fitted)} horizons with a fitted threshold (T = {min(ts):.0f} .. {max(ts):.0f})")
    if bounded:
        note += (f"; {len(bounded)} horizon(s) give only a bound and are not in the fit"
                 + (f" (the line violates the bound at {violated})" if violated else " (the line respects them)"))
    return {**out, "status": "fitted", "note": note, "bounds_violated": violated}


def _alpha_bounds(fitted: list[dict[str, Any]], bounded: list[dict[str, Any]]) -> dict[str, Any]:
    """With fewer than two thresholds: bounds on α from pairs where one is a threshold or bound below and the other
    a threshold or bound above. thr(T2)/thr(T1) = (T2/T1)^(−α) for T2 > T1."""
    lower, upper = [], []
    items = [(h["horizon"], h) for h in fitted + bounded]
    for t1, a in items:
        for t2, b in items:
            if t2 <= t1:
                continue
            span = math.log10(t2 / t1)
            a_hi = _value(a, "upper")  # thr(T1) <= a_hi
            a_lo = _value(a, "lower")  # thr(T1) >= a_lo
            b_hi, b_lo = _value(b, "upper"), _value(b, "lower")
            if a_lo is not None and b_hi is not None:  # α = log(thr1/thr2)/span >= log(a_lo/b_hi)/span
                lower.append(math.log10(a_lo / b_hi) / span)
            if a_hi is not None and b_lo is not None:
                upper.append(math.log10(a_hi / b_lo) / span)
    lo, hi = (max(lower) if lower else None), (min(upper) if upper else None)
    parts = [f"{len(fitted)} horizon(s) with a fitted threshold, {len(bounded)} with only a bound: no exponent "
             "can be fitted"]
    if lo is not None or hi is not None:
        parts.append("the measurements bound it: " + " and ".join(
            x for x in (f"α ≥ {lo:.2f}" if lo is not None else "", f"α ≤ {hi:.2f}" if hi is not None else "") if x))
    else:
        parts.append("and they bound it on neither side")
    return {"status": "bounds_only", "alpha_lower_bound": lo, "alpha_upper_bound": hi, "note": "; ".join(parts)}


def _value(h: dict[str, Any], side: str) -> float | None:
    """A bound on a horizon's threshold: a fitted threshold bounds it by its interval's ends (an open end: none),
    never by its point value, which between two tested doses the data cannot place."""
    if h.get("status") == "fitted":
        return h.get("ci_low") if side == "lower" else h.get("ci_high")
    if side == "lower" and h.get("status") == "above_range":
        return h.get("lower_bound")
    if side == "upper" and h.get("status") == "below_range":
        return h.get("upper_bound")
    return None


def _respects(h: dict[str, Any], intercept: float, slope: float) -> bool:
    line = 10 ** (intercept + slope * math.log10(h["horizon"]))
    if h["status"] == "above_range":
        return line >= h["lower_bound"]
    return line <= h["upper_bound"]


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return slope, my - slope * mx


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive(v: Any) -> bool:
    return _number(v) and v > 0


# ----------------------------------------------------------------------------- report output


def write_scaling(data: SweepData, out: Path) -> tuple[list[Path], str]:
    """``scaling.json`` and ``scaling.png`` in ``out`` (the report directory) and the line the report prints.

    A sweep without a horizon axis (most sweeps) writes no file: the line says why there is no law."""
    from ..rl.runlog import json_safe

    result = scaling(data)
    meter_path = data.path / "meter.json"
    if meter_path.is_file() and result["status"] != "no_horizon":
        result["meter"] = against_meter(result, json.loads(meter_path.read_text()))
    line = f"scaling ({result.get('curve', 'no curve')}): {result['status']}: {result['note']}"
    if result["status"] == "no_horizon":
        return [], f"scaling: {result['note']}"
    path = out / "scaling.json"
    path.write_text(json.dumps(json_safe(result), indent=2) + "\n")
    files = [path]
    try:
        files.append(plot_scaling(result, out / "scaling.png", data.name))
    except ImportError:
        pass
    return files, line


def against_meter(result: dict[str, Any], meter: dict[str, Any]) -> dict[str, Any]:
    """The meter's bias ratio at each horizon's threshold: does collapse happen at a common bias ratio?

    ``meter``: a ``vexact meter`` result whose cells' ``horizon`` is the sweep's ``task.max_len`` (copy meter.json
    into the sweep directory). At each horizon with a fitted threshold, the bias ratio is interpolated in log-log
    over that horizon's cells (every source) by realised k3; outside their k3 range it is not extrapolated."""
    rows = []
    for h in result["horizons"]:
        cells = sorted((c["k3_kl"], c["bias_ratio"]) for c in meter.get("cells", [])
                       if c.get("horizon") == h["horizon_value"] and _positive(c.get("k3_kl"))
                       and _positive(c.get("bias_ratio")))
        ratio = None
        if h.get("status") == "fitted" and len(cells) >= 2 and cells[0][0] <= h["threshold_50"] <= cells[-1][0]:
            x = math.log10(h["threshold_50"])
            for (k0, b0), (k1, b1) in zip(cells, cells[1:]):
                if k0 <= h["threshold_50"] <= k1:
                    w = 0.0 if k1 == k0 else (x - math.log10(k0)) / (math.log10(k1) - math.log10(k0))
                    ratio = 10 ** (math.log10(b0) + w * (math.log10(b1) - math.log10(b0)))
                    break
        rows.append({"horizon_value": h["horizon_value"], "horizon": h.get("horizon"),
                     "threshold_50": h.get("threshold_50"), "bias_ratio_at_threshold": ratio})
    found = [r["bias_ratio_at_threshold"] for r in rows if r["bias_ratio_at_threshold"] is not None]
    if len(found) < 2:
        note = (f"{len(found)} horizon(s) have both a fitted threshold and meter cells bracketing it: no comparison "
                "across horizons")
    else:
        note = (f"bias ratio at the threshold: {', '.join(f'{v:.2g}' for v in found)} across {len(found)} horizons "
                f"(spread {max(found) / min(found):.2g}x)")
    return {"horizons": rows, "note": note}


def plot_scaling(result: dict[str, Any], path: Path, title: str = "") -> Path:
    """Threshold (with interval) against T, log-log, one colour per curve; bounds as arrows; the fitted law."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    cmap = plt.get_cmap("tab10")
    any_point = False
    ys: list[float] = []
    for i, curve in enumerate(result["curves"]):
        colour = cmap(i % 10)
        for h in curve["horizons"]:
            if not _positive(h.get("horizon")):
                continue
            if h["status"] == "fitted":
                lo, hi = h.get("ci_low") or h["threshold_50"], h.get("ci_high") or h["threshold_50"]
                ax.errorbar([h["horizon"]], [h["threshold_50"]], yerr=[[h["threshold_50"] - lo],
                            [hi - h["threshold_50"]]], color=colour, marker="o", capsize=3)
                any_point = True
                ys += [lo, hi]
            elif h["status"] in ("above_range", "below_range"):
                up = h["status"] == "above_range"
                y = h["lower_bound"] if up else h["upper_bound"]
                ax.scatter([h["horizon"]], [y], color=colour, marker="^" if up else "v", s=70)
                any_point = True
                ys.append(y)
        label = f"{curve['curve']}: {curve['status']}"
        if curve["status"] == "fitted" and curve["horizon_range"]:
            t0, t1 = curve["horizon_range"]
            xs = [t0 * (t1 / t0) ** (k / 50) for k in range(51)]
            ax.plot(xs, [10 ** (curve["log10_prefactor"] - curve["alpha"] * math.log10(x)) for x in xs],
                    color=colour, lw=1.2)
            label += f", α = {curve['alpha']:.2f}"
        ax.plot([], [], color=colour, label=label)
    if any_point:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(min(ys) / 5, max(ys) * 5)  # at least a decade: bounds alone would zoom into noise
    ax.set_xlabel("horizon T (mean response length, tokens)")
    ax.set_ylabel(f"50% collapse threshold ({METRIC})")
    ax.set_title((f"{title}\n" if title else "") + "collapse threshold vs horizon (▲ lower bound, ▼ upper bound)",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- the map


def load_map(path: str | Path | None = None) -> dict[str, Any]:
    """A map (a ``scaling.json``); None = the map shipped with vexact. One clear error on a bad file."""
    path = Path(path) if path is not None else DEFAULT_MAP
    if not path.is_file():
        raise ValueError(f"map file not found: '{path}'")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"map file '{path}' is not valid JSON: {e}") from None
    if not isinstance(data, dict) or "status" not in data or "horizon_range" not in data:
        raise ValueError(f"map file '{path}' is not a scaling.json (no 'status' / 'horizon_range'); make one with "
                         "vexact report on a sweep over task.max_len")
    data.setdefault("source", "the map shipped with vexact (vexact/lab/default_map.json)" if path == DEFAULT_MAP
                    else str(path))
    return data


def place_on_map(map_data: dict[str, Any], k3: float, horizon: float) -> dict[str, Any]:
    """The map's threshold at ``horizon`` (with its interval), ``ratio`` = k3 / threshold, a ``verdict`` in words,
    and ``extrapolation_factor`` (how many times beyond the measured horizons T lies; 1.0 inside them)."""
    if not _number(k3) or k3 < 0:
        raise ValueError(f"k3 must be a finite number >= 0, got {k3!r}")
    if not _positive(horizon):
        raise ValueError(f"the horizon (mean response length) must be a positive number, got {horizon!r}: the dump "
                         "has no response lengths to place on the map")
    t_range = map_data.get("horizon_range")
    if not (isinstance(t_range, list) and len(t_range) == 2 and all(_positive(t) for t in t_range)):
        raise ValueError("the map has no measured horizons (horizon_range): it cannot place a horizon")
    t0, t1 = t_range
    factor = horizon / t1 if horizon > t1 else t0 / horizon if horizon < t0 else 1.0
    out: dict[str, Any] = {"horizon": float(horizon), "k3": float(k3), "threshold_50": None, "ci_low": None,
                           "ci_high": None, "ratio": None, "verdict": None, "extrapolation_factor": factor}
    if map_data.get("status") == "fitted":
        lt = math.log10(horizon)
        thr = 10 ** (map_data["log10_prefactor"] - map_data["alpha"] * lt)
        reps = sorted(10 ** (c - a * lt) for c, a in map_data.get("replicates") or [])
        lo = reps[int(0.025 * (len(reps) - 1))] if reps else None
        hi = reps[int(0.975 * (len(reps) - 1))] if reps else None
        out.update(threshold_50=thr, ci_low=lo, ci_high=hi, ratio=k3 / thr)
        low, high = lo or thr, hi or thr
        if k3 < low / 10:
            out["verdict"] = "far below the measured collapse range"
        elif k3 < high:
            out["verdict"] = "near the measured collapse range"
        else:
            out["verdict"] = "above the measured collapse range"
        return out
    safe = [h.get("lower_bound") for h in map_data.get("horizons", [])
            if h.get("status") == "above_range" and not h.get("collapsed")]  # nothing collapsed up to the bound
    safe = [s for s in safe if _positive(s)]
    if safe and k3 < min(safe) and factor == 1.0:
        out["verdict"] = (f"below every level tested (no collapse up to k3 = {min(safe):.2g} at any mapped "
                          "horizon); the map has no threshold to extrapolate")
    elif safe and k3 < min(safe):
        out["verdict"] = (f"no verdict at this horizon: nothing collapsed up to k3 = {min(safe):.2g} at the mapped "
                          f"horizons (T = {t0:.0f} .. {t1:.0f}), above your k3, but the map has no law to carry that "
                          f"{factor:.3g}x beyond them")
    else:
        out["verdict"] = f"unknown: the map has no fitted law ({map_data.get('status')}): {map_data.get('note')}"
    return out


def map_lines(placed: dict[str, Any], map_data: dict[str, Any]) -> list[str]:
    """The placement as printed lines, assumptions included."""
    p = placed
    lines = [f"map ({map_data.get('source', 'map')}): k3 = {p['k3']:.3g} at T = {p['horizon']:.1f} tokens"]
    if p["threshold_50"] is not None:
        ci = (f" [{p['ci_low']:.2g}, {p['ci_high']:.2g}]" if p["ci_low"] is not None else " [no interval]")
        lines.append(f"  extrapolated 50% collapse threshold at this T: k3 = {p['threshold_50']:.2g}{ci} "
                     f"(α = {map_data['alpha']:.2f}); ratio k3 / threshold = {p['ratio']:.2g}")
    lines.append(f"  verdict: {p['verdict']}")
    t0, t1 = map_data["horizon_range"]
    lines.append(f"  extrapolation: T is {p['extrapolation_factor']:.3g}x beyond the measured horizons "
                 f"(T = {t0:.0f} .. {t1:.0f})" if p["extrapolation_factor"] > 1 else
                 f"  T lies within the measured horizons (T = {t0:.0f} .. {t1:.0f})")
    lines.append("  assumptions: " + "; ".join(ASSUMPTIONS))
    what = (map_data.get("provenance") or {}).get("what")
    if what:
        lines.append(f"  the map: {what}")
    return lines


def compare_map(summary: dict[str, Any], map_path: str | Path | None) -> tuple[dict[str, Any], list[str]]:
    """``vexact compare --map``: place a compare summary (its k3 and mean response length) on a map; returns the
    ``map`` JSON object (``MAP_KEYS`` exactly) and the lines to print."""
    map_data = load_map(None if map_path in (None, "default") else map_path)
    sequences, tokens = summary.get("sequences") or 0, summary.get("tokens") or 0
    if not sequences or not tokens:
        raise ValueError("the dump has no response lengths (no tokens): nothing to place on the map")
    placed = place_on_map(map_data, summary["metrics"][K3_KL], tokens / sequences)
    return {k: placed[k] for k in MAP_KEYS}, map_lines(placed, map_data)
