"""The collapse threshold against the response horizon T: per horizon a dose-response fit, over the horizons a
power law with its regression interval.

``scaling(data)`` turns a loaded sweep over (horizon, mismatch) into ``scaling.json`` (a contract)::

    {"metric": "rollout_corr/k3_kl", "horizon_key": "task.max_len", "horizon_metric": "response_length/mean",
     "curve": ..., "correction": ..., "status": ..., "note": "...", "alpha": .., "alpha_ci_low": ..,
     "alpha_ci_high": .., "log10_prefactor": .., "horizon_range": [T_min, T_max], "replicates": [[log10 A, alpha], ...],
     "horizons": [{"horizon_value", "horizon", "threshold_50", "ci_low", "ci_high", "status", ...}, ...],
     "shape": {...}, "curves": [ ... the same for every curve, each with its "correction" ... ]}

The top level is the primary curve (the ``bypass`` one when the sweep has it). A map is such a file
(``vexact.map.verdict``).

**Threshold per horizon.** ``dose_response.fit_threshold`` over that horizon's runs (dose = realised k3 before
collapse, collapse or not, seed): ``threshold_50`` with its 95% interval (``ci_method``: the profile likelihood,
a seed bootstrap and the bracketing runs, ``dose_response.CI_METHOD``), or a bound
(``above_range``: the 50% point lies above ``lower_bound``, the largest dose tested; ``below_range``: below
``upper_bound``, the smallest).

**The law.** log10 threshold = log10 A − α·log10 T, least squares over the horizons with a fitted threshold
(``status: fitted`` needs two or more; with exactly two the line passes through both, no residual is left to
measure the horizons' scatter about it, and α has no interval: None, no replicates).
Interval of α (``alpha_ci_method``: ``ALPHA_CI_METHOD``): a regression
interval by residual bootstrap, ``BOOTSTRAP`` refits to the fitted values plus resampled residuals plus each
horizon's own threshold noise (a normal whose 95% range is its interval), so the scatter of the horizons about the
line widens it (a horizon whose interval is open on one side enters mirrored from its finite side, listed in
``alpha_ci_mirrored``; open on both sides, it leaves α's interval open: None). The replicates give the law's
95% band at any T (``law_band``); ``band_misses`` lists the fitted horizons whose threshold lies outside it, and
``alpha_leave_one_out`` α without each horizon (how much the law leans on one). A horizon whose dose levels each
hold one run (``runs_per_dose``, ``single_run_per_dose``: no seed scatter behind its interval) is named in
``single_run_horizons`` and in every verdict from the law; so is a horizon whose threshold interval was made by an
earlier method than ``dose_response.CI_METHOD`` (``earlier_ci_horizons``: carried from a map file, not refitted from
its runs; the current method's interval is never narrower). Horizons with only a bound never enter as numbers: the
fit lists them and says whether the line respects them; with fewer than two fitted horizons, pairs of (threshold or
bound) give bounds on α (``alpha_lower_bound``/``alpha_upper_bound``), ``status: bounds_only``. Other statuses:
``no_horizon``, ``single_horizon``, ``insufficient`` (points without the metrics), each with one sentence in
``note``. The shape comparison: ``vexact.map.shapes``.
"""

from __future__ import annotations

import math
import random
from typing import Any

from ..records import CONFIG_FILE
from ..sweeps.dose_response import CI_METHOD, METRIC, fit_threshold, run_dose
from ..sweeps.failure import horizon_failures
from ..sweeps.sweep_data import SEED_KEY, PointData, SweepData
from .naming import DEFAULT_CORRECTION, default_config
from .points import (
    HORIZON_KEY,
    HORIZON_METRIC,
    curve_keys,
    finite,
    horizon_value,
    interval_text,
    measured_horizon,
    point_policy_lag,
    point_setup,
    positive,
    sweep_variants,
)
from .shapes import compare_shapes, fit_line, respects_value

BOOTSTRAP = 1000
BOOTSTRAP_SEED = 0
ALPHA_CI_METHOD = ("regression interval by residual bootstrap: the line's fitted values plus the residuals resampled "
                   "with replacement (scaled by sqrt(n/(n-2))) plus each horizon's threshold redrawn within its own "
                   "95% interval, widened about the fit to at least the least-squares t-interval (n-2 df)")
"""How α's interval (and the replicates a verdict's interval at a new T comes from) is made: ``alpha_ci_method``
in a curve. It carries the scatter of the horizons about the line, which redrawing each threshold within its own
interval alone (the method before) left out."""
Z_95 = 1.96  # a normal's 95% range is its mean ± Z_95 sd
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Student's t 97.5% quantiles for 1 .. 30 degrees of freedom (two-sided 95%): the t with ν df solving
∫_{-t}^{t} Γ((ν+1)/2) / (√(νπ) Γ(ν/2)) (1 + x²/ν)^(−(ν+1)/2) dx = 0.95 (tests/map/test_scaling.py integrates it)."""


def t_975(df: int) -> float:
    """Student's t 97.5% quantile with ``df`` degrees of freedom: ``T_975`` up to 30, beyond it the Cornish-Fisher
    expansion z + (z³ + z)/(4ν) + (5z⁵ + 16z³ + 3z)/(96ν²) about the normal's z = 1.96 (within 1e-3 from 31 on)."""
    if df <= len(T_975):
        return T_975[df - 1]
    z = Z_95
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
REPLICATES_KEPT = BOOTSTRAP  # replicates stored in scaling.json: the law's band at a new T (a verdict, a plot)


def scaling(data: SweepData) -> dict[str, Any]:
    """The ``scaling.json`` object of a loaded sweep (module docstring)."""
    variants = sweep_variants(data)
    base = {"metric": METRIC, "horizon_key": HORIZON_KEY, "horizon_metric": HORIZON_METRIC, "alpha": None,
            "alpha_ci_low": None, "alpha_ci_high": None, "horizons": [], "curves": []}
    with_h = [p for p in data.points if horizon_value(p, variants) is not None]
    if not with_h:
        return {**base, "status": "no_horizon",
                "note": f"the sweep sets no horizon key ({HORIZON_KEY} in its grid or its variants), so it has no "
                        "horizon axis: no scaling law"}
    keys = curve_keys(data, variants)
    defaults = default_config()
    setups = [point_setup(p, variants, defaults) for p in with_h]  # (correction, source) of each point
    several = len({source for _, source in setups}) > 1
    started: dict[tuple[str, str, str, int], list[PointData]] = {}
    pending: dict[tuple[str, str, str, int], list[PointData]] = {}
    for p, (correction, source) in zip(with_h, setups):  # one curve per correction, source and lag (and other
        # curve key): never one fit over several
        label = ", ".join([f"correction={correction}", *([f"source={source}"] if several else []),
                           *(f"{k}={p.overrides.get(k)}" for k in keys)])
        # a point never started is named from its overrides alone (sweep.json keeps no `set:` block), which may
        # name the wrong correction: it joins a curve of started runs, never starts one
        group = started if p.has_result or (p.dir / CONFIG_FILE).is_file() else pending
        group.setdefault((label, correction, source, point_policy_lag(p, variants)), []).append(p)
    curves = {key: points + pending.get(key, []) for key, points in started.items()} or pending
    results = [{**fit_curve(label, correction, _by_horizon(points, variants)), "source": source, "policy_lag": lag}
               for (label, correction, source, lag), points in curves.items()]
    primary = next((c for c in results if c["correction"] == DEFAULT_CORRECTION), results[0])
    return {**base, **primary, "curves": results}


def _by_horizon(points: list[PointData], variants: dict[str, dict[str, Any]]) -> dict[Any, list[PointData]]:
    by_h: dict[Any, list[PointData]] = {}
    for p in points:
        by_h.setdefault(horizon_value(p, variants), []).append(p)
    return by_h


def horizon_order(value: Any) -> tuple[bool, Any]:
    return not finite(value), value if finite(value) else str(value)


def fit_curve(label: str, correction: str, by_h: dict[Any, list[PointData]]) -> dict[str, Any]:
    """One curve from its runs grouped by horizon value: a threshold (or bound) per horizon, the law, the shape."""
    horizons, missing = [], 0
    for value in sorted(by_h, key=horizon_order):
        done = [p for p in by_h[value] if p.has_result]
        runs, lengths, levels = [], [], {}
        for p in done:
            dose, t = run_dose(p), measured_horizon(p)
            if dose is None or t is None:
                missing += 1
                continue
            lengths.append(t)
            if dose > 0:
                runs.append((dose, p.collapse.get("collapsed") is True, p.overrides.get(SEED_KEY)))
                levels[_dose_level(p)] = levels.get(_dose_level(p), 0) + 1
        threshold = fit_threshold(runs, len(levels))  # a level is a sweep group: its seeds realise different doses
        per_dose = [levels[k] for k in sorted(levels, key=str)]
        horizons.append({"horizon_value": value, "horizon": sum(lengths) / len(lengths) if lengths else None,
                         "runs_total": len(by_h[value]), "runs_with_result": len(done), **threshold,
                         "runs_per_dose": per_dose, "single_run_per_dose": bool(per_dose) and max(per_dose) == 1,
                         **horizon_failures(done),
                         # not collapses in the fit, and not clean survivals: a bound over them says so
                         "dropped_unconfirmed": sum(p.dropped_unconfirmed for p in done)})
    law = fit_law(horizons)
    if missing:
        law["note"] += f"; {missing} run(s) without a realised {METRIC} or {HORIZON_METRIC} are left out"
    return {"curve": label, "correction": correction, **law, "horizons": horizons, "shape": compare_shapes(horizons)}


def _dose_level(point: PointData) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The dose level a run belongs to: its sweep and its overrides but the seed (the seeds of one level are its
    replicates; a horizon whose levels each hold one run has no seed scatter to bootstrap)."""
    return str(point.dir.parent.parent), tuple(sorted((str(k), str(v)) for k, v in point.overrides.items()
                                                      if k != SEED_KEY))


def fit_law(horizons: list[dict[str, Any]]) -> dict[str, Any]:
    """α of threshold ∝ T^(−α) over per-horizon threshold dicts (``horizon`` = measured T; the threshold fields of
    ``dose_response.fit_threshold``), with its interval, or bounds on α, or why neither (module docstring)."""
    out: dict[str, Any] = {"metric": METRIC, "alpha": None, "alpha_ci_low": None, "alpha_ci_high": None,
                           "log10_prefactor": None, "replicates": [], "horizon_range": None, "band_misses": []}
    usable = [h for h in horizons if positive(h.get("horizon"))]
    if not usable:
        return {**out, "status": "insufficient",
                "note": f"no horizon has runs with a realised {METRIC} and {HORIZON_METRIC}: nothing to fit"}
    # the measured horizons: a horizon whose runs give neither a threshold nor a bound (too few runs) measured
    # nothing, so it does not stretch the range a verdict counts as measured
    said = [h for h in usable if h.get("status") in ("fitted", "above_range", "below_range")]
    ts = [h["horizon"] for h in said or usable]
    out["horizon_range"] = [min(ts), max(ts)]
    if len(usable) < 2:
        h = usable[0]
        found = (f"; its 50% threshold: k3 {h['threshold_50']:.2g}{interval_text(h.get('ci_low'), h.get('ci_high'))}"
                 if h.get("status") == "fitted" and positive(h.get("threshold_50")) else "")
        return {**out, "status": "single_horizon",
                "note": f"one horizon (T = {ts[0]:.1f}): a law in T needs at least two{found}"}
    fitted = [h for h in usable if h.get("status") == "fitted"]
    bounded = [h for h in usable if h.get("status") in ("above_range", "below_range")]
    if len(fitted) < 2:
        return {**out, **_alpha_bounds(fitted, bounded), "horizon_range": [min(ts), max(ts)]}
    if len({h["horizon"] for h in fitted}) < 2:  # a line through one T has no slope to give (fit_line: 0)
        return {**out, "status": "single_horizon",
                "note": f"the {len(fitted)} fitted thresholds were all measured at T = {fitted[0]['horizon']:.1f}: "
                        "a law in T needs at least two distinct horizons"}
    xs = [math.log10(h["horizon"]) for h in fitted]
    ys = [math.log10(h["threshold_50"]) for h in fitted]
    slope, intercept = fit_line(xs, ys)
    out.update(alpha=-slope, log10_prefactor=intercept)
    noise = [_threshold_sd(h) for h in fitted]
    sds = [sd for sd, _ in noise]
    open_ends = [h["horizon_value"] for h, sd in zip(fitted, sds) if sd is None]
    mirrored = [h["horizon_value"] for h, (_, was_mirrored) in zip(fitted, noise) if was_mirrored]
    out["alpha_ci_method"] = ALPHA_CI_METHOD
    two = len(fitted) == 2  # a line through two points: no residual, no scatter about it to measure
    if not open_ends and not two:
        reps = _residual_bootstrap(xs, ys, [sd or 0.0 for sd in sds])
        alphas = sorted(a for _, a in reps)
        out["alpha_ci_low"], out["alpha_ci_high"] = _percentile(alphas, 0.025), _percentile(alphas, 0.975)
        out["replicates"] = [[round(c, 6), round(a, 6)] for c, a in reps[:REPLICATES_KEPT]]
        out["band_misses"] = band_misses(fitted, reps)
        if mirrored:
            out["alpha_ci_mirrored"] = mirrored
    violated = [h["horizon_value"] for h in bounded if not _respects(h, intercept, slope)]
    fitted_ts = [h["horizon"] for h in fitted]  # the law's own range: ts holds the bounds' horizons too
    note = (f"threshold ∝ T^(−{-slope:.2f})" + (f" (no interval: horizon(s) {open_ends} have an open threshold "
                                               "interval)" if open_ends else
                                               " (no interval: a line through two horizons leaves no residual, so "
                                               "nothing measures their scatter about it)" if two else
                                               f" [α in {out['alpha_ci_low']:.2f} .. {out['alpha_ci_high']:.2f}, "
                                               "a regression interval]")
            + f" over {len(fitted)} horizons with a fitted threshold (T = {min(fitted_ts):.0f} .. "
              f"{max(fitted_ts):.0f})")
    if len(fitted) == 3 and not open_ends:
        note += "; 3 horizons: the interval rests on one residual degree of freedom"
    if mirrored and not open_ends and not two:
        note += (f"; the threshold interval of {HORIZON_KEY} = {', '.join(map(str, mirrored))} is open on one side "
                 "(the runs do not bound it there): α's interval mirrors its finite side")
    out["alpha_leave_one_out"] = leave_one_out_alphas(fitted)
    if out["alpha_leave_one_out"]:
        loo = out["alpha_leave_one_out"]
        low_key, high_key = min(loo, key=loo.__getitem__), max(loo, key=loo.__getitem__)
        note += (f"; α without one horizon: {loo[low_key]:.2f} (without {HORIZON_KEY} = {low_key}) .. "
                 f"{loo[high_key]:.2f} (without {high_key})")
    if out.get("band_misses"):
        note += (f"; the law's 95% band misses the threshold of {len(out['band_misses'])} of {len(fitted)} "
                 f"({HORIZON_KEY} = {', '.join(map(str, out['band_misses']))})")
    single = [h["horizon_value"] for h in fitted if h.get("single_run_per_dose")]
    if single:
        out["single_run_horizons"] = single
        note += f"; fitted from one run per dose: {HORIZON_KEY} = {', '.join(map(str, single))}"
    earlier = earlier_method_horizons(fitted)
    if earlier:  # carried from a map file whose runs were not given again: the interval cannot be refitted here
        out["earlier_ci_horizons"] = earlier
        note += (f"; the threshold interval of {HORIZON_KEY} = {', '.join(map(str, earlier))} was made by an earlier "
                 "method (not ci_method's), which can be narrower: α's interval may be too narrow")
    if bounded:
        note += (f"; {len(bounded)} horizon(s) give only a bound and are not in the fit"
                 + (f" (the line violates the bound at {violated})" if violated else " (the line respects them)"))
    return {**out, "status": "fitted", "note": note, "bounds_violated": violated}


def earlier_method_horizons(horizons: list[dict[str, Any]]) -> list[Any]:
    """The ``horizon_value`` of each fitted horizon whose threshold interval was made by an earlier method than
    ``CI_METHOD`` (no ``ci_method``, or another): read from the horizons themselves, so a map or scaling.json made
    before ``ci_method`` existed is found the same as the curve's stored ``earlier_ci_horizons``."""
    return [h.get("horizon_value") for h in horizons if h.get("status") == "fitted" and h.get("ci_method") != CI_METHOD]


def _threshold_sd(horizon: dict[str, Any]) -> tuple[float | None, bool]:
    """(sd in dex, mirrored) of a horizon's threshold noise in α's interval: a normal whose 95% range is its
    interval. An interval open on one side (``dose_response``: the profile likelihood reaches past the tested doses
    there, or a seed resample in which every run collapsed, or none did) is mirrored about the threshold from its
    finite side (mirrored True); open on both sides, sd None (α's interval stays open)."""
    thr, lo, hi = horizon.get("threshold_50"), horizon.get("ci_low"), horizon.get("ci_high")
    if positive(lo) and positive(hi):
        return (math.log10(hi) - math.log10(lo)) / (2 * Z_95), False
    finite_end = lo if positive(lo) else hi if positive(hi) else None
    if finite_end is None or not positive(thr):
        return None, False
    return abs(math.log10(finite_end) - math.log10(thr)) / Z_95, True


def _residual_bootstrap(xs: list[float], ys: list[float], sds: list[float]) -> list[tuple[float, float]]:
    """``BOOTSTRAP`` replicate lines (log10 A, α) of the law (``ALPHA_CI_METHOD``): a regression interval by
    bootstrap. Each replicate refits the line to its fitted values plus the residuals resampled with replacement
    (scaled by √(n/(n−2)): the line took two degrees of freedom) plus each horizon's own threshold noise (a normal
    whose 95% range is its interval); the replicate lines are then scaled about the fitted line until α's 2.5/97.5
    percentiles lie at least the least-squares t-interval's half-width (``t_975(n − 2)`` standard errors) from α.
    The residuals carry the horizons' scatter about the line into α's interval; on points that lie on the line it
    is their own intervals' alone. Deterministic (``BOOTSTRAP_SEED``)."""
    slope, intercept = fit_line(xs, ys)
    n = len(xs)
    residuals = [y - (intercept + slope * x) for x, y in zip(xs, ys)]
    inflate = math.sqrt(n / (n - 2))  # (fit_law makes no interval from two points: the line passes through both)
    rng = random.Random(BOOTSTRAP_SEED)
    reps = []
    for _ in range(BOOTSTRAP):
        drawn = [intercept + slope * x + inflate * rng.choice(residuals) + rng.gauss(0.0, sd) for x, sd in zip(xs, sds)]
        s, c = fit_line(xs, drawn)
        reps.append((c, -s))
    # a bootstrap of few residuals is narrower than their t-interval (3 horizons: 1 df, t = 12.7): the replicate
    # lines are scaled about the fit until α's interval holds the least-squares t-interval on both sides
    mean_x = sum(xs) / n
    se = math.sqrt(sum(r * r for r in residuals) / (n - 2) / sum((x - mean_x) ** 2 for x in xs))
    alphas = sorted(a for _, a in reps)
    half = t_975(n - 2) * se
    sides = [x for x in (-slope - _percentile(alphas, 0.025), _percentile(alphas, 0.975) + slope) if x > 0]
    scale = max([1.0] + [half / side for side in sides])
    if scale > 1.0:
        reps = [(intercept + scale * (c - intercept), -slope + scale * (a + slope)) for c, a in reps]
    return reps


def leave_one_out_alphas(fitted: list[dict[str, Any]]) -> dict[str, float]:
    """α refitted without each fitted horizon ({horizon value as text: α}; three fitted horizons or more): how much
    the law leans on any one of them."""
    if len(fitted) < 3:
        return {}
    out = {}
    for i, h in enumerate(fitted):
        rest = fitted[:i] + fitted[i + 1:]
        out[str(h["horizon_value"])] = -fit_line([math.log10(r["horizon"]) for r in rest],
                                              [math.log10(r["threshold_50"]) for r in rest])[0]
    return out


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (the lower neighbour, as every interval here)."""
    return values[int(q * (len(values) - 1))]


def law_band(replicates: list[Any], horizon: float) -> tuple[float, float] | None:
    """The law's 95% band at ``horizon``: the 2.5/97.5 percentiles of the replicate lines' thresholds there (None
    without replicates)."""
    lt = math.log10(horizon)
    values = sorted(10 ** (c - a * lt) for c, a in replicates or [])
    return (_percentile(values, 0.025), _percentile(values, 0.975)) if values else None


def band_misses(fitted: list[dict[str, Any]], replicates: list[Any]) -> list[Any]:
    """The horizon values of the fitted horizons whose threshold lies outside the law's 95% band at their T."""
    misses = []
    for h in fitted:
        band = law_band(replicates, h["horizon"])
        if band is not None and not band[0] <= h["threshold_50"] <= band[1]:
            misses.append(h["horizon_value"])
    return misses


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
    return respects_value(h, 10 ** (intercept + slope * math.log10(h["horizon"])))
