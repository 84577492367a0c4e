"""Dose-response: how the chance of collapse grows with the realised mismatch, and where it crosses 50%.

``dose_response(data)`` turns a loaded sweep into ``dose_response.json`` (a contract)::

    {"metric": "rollout_corr/k3_kl", "summary": "...", "curve_keys": [...], "curves": [
        {"curve": "algorithm.old_logprobs=rollout", "keys": {...},
         "points": [{"group", "overrides", "runs", "realised_k3_kl", "collapsed", "collapse_prob",
                     "median_collapse_step"}, ...],
         "baseline": {"runs", "collapsed"} | None,          # points whose realised mismatch is exactly 0
         "threshold": {"metric", "threshold_50", "ci_low", "ci_high", "ci_method", "status", "note", ...}}, ...]}

**Dose.** A run's dose is its realised ``rollout_corr/k3_kl``, averaged over the steps before it collapsed (the
whole run when it did not): ``collapse.mean_k3_kl_before_collapse``. It is measured, not the knob, so precision,
kernel and noise sources sit on one axis. A *point* of the curve is a sweep group (one source/magnitude, all its
seeds); a *curve* is the set of groups sharing the values of the sweep's ``curves`` keys (say, one curve per
old-log-prob mode).

**Fit.** Logistic regression of the collapse outcome (0/1, one per run) on ``log10(dose)``, over the runs with
a positive dose, with a weak ridge penalty on the slope (``RIDGE``) so perfectly separated outcomes still give a
finite fit whose 50% point lies between the largest safe and the smallest collapsing dose. ``threshold_50`` is
the dose at which the fitted collapse probability within the run length is 50%.

**Interval** (``ci_method``: ``CI_METHOD``). ``ci_low``/``ci_high`` hold the hull of three intervals, so none of
them can make it narrower:

- the *profile-likelihood interval* of the 50% point under a penalised fit whose ridge is ``RIDGE`` at half-decade
  level spacing and scales with the square of the sweep's mean spacing (``PROFILE_SPACING``: the same penalty per
  level gap, so finely spaced levels are not held open by it): every t where
  2 x (the maximum penalised log-likelihood − its maximum over the slope with the 50% point held at t) is at most
  ``CHI2_95`` (3.841, chi-square with 1 df). Where that set reaches the end of the tested doses (or beyond them:
  far away the profile tends to a flat fit's, so a slope whose likelihood ratio is under 3.841 leaves both ends
  open) that end is open (None): the data do not bound it there;
- the 2.5/97.5 percentiles of ``threshold_50`` over ``BOOTSTRAP`` resamples of the seeds (a resample takes every run
  of the drawn seeds; seeds drawn with replacement; fixed RNG seed, so the report is deterministic);
- the bracket: the largest dose of a run that did not collapse below the threshold, and the smallest dose of a run
  that collapsed above it (``bracket_low``/``bracket_high``). Between tested doses the data cannot place the
  threshold, so an interval narrower than the gap between them would claim more than was measured.

The bootstrap and bracket alone held the true 50% point in as few as 57% of simulated sweeps like the shipped ones
(1-3 seeds per level: 3 seeds give only 10 distinct resamples, 1 seed none; 9 of 12 designs under 93%); with the
profile likelihood the interval holds it in at least 95% of them in every design (a fit above or below the tested
doses counted a miss; ``tests/map/test_threshold_coverage.py``). With one seed per level an end is always open: 4-5
runs do not bound the threshold on both sides.

**No made-up thresholds.** ``status`` says what could be estimated:

- ``fitted``: some runs collapsed and some did not, over at least two dose levels, with a rising fit;
- ``above_range``: the 50% point lies above the largest dose tested: nothing collapsed, or the fit puts it there
  (fewer than half collapsed); ``threshold_50`` is None and ``lower_bound`` is the largest dose tested;
- ``below_range``: the 50% point lies below the smallest dose tested: everything collapsed, or the fit puts it
  there; ``upper_bound`` is the smallest dose tested;
- ``not_monotone``: collapse did not become more likely with the dose (fitted slope <= 0);
- ``insufficient``: fewer than two dose levels with a positive dose, or no run with a result.

A bootstrap resample that cannot place the threshold inside the tested doses (no collapse in it, only collapses,
a fit that does not rise, or a 50% point outside them) counts as above or below the range; when such resamples
reach a percentile, that end of the interval is None and the note says so. With one seed (or runs without one)
there is nothing to resample: the bracket and the profile likelihood make the interval. A *dose level* is a sweep
group (its seeds realise slightly different doses), so one group with mixed outcomes is ``insufficient``, not a fit.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

from ..metric_keys import K3_KL
from ..records.atomic import publish
from .sweep_data import SEED_KEY, PointData, SweepData, median
from .text_table import fmt_value

METRIC = K3_KL
SUMMARY = "run mean of rollout_corr/k3_kl over the steps before collapse (the whole run without collapse)"
DOSE_FIELDS = ("mean_k3_kl_before_collapse", "mean_k3_kl")  # the collapse summary's field, then the fallback
RIDGE = 0.05  # penalty on the slope (per decade of k3, squared): keeps separated data finite, barely biases the rest
BOOTSTRAP = 1000
BOOTSTRAP_SEED = 0
PROFILE_SPACING = 0.5
"""The level spacing (decades) at which the profile likelihood's ridge is ``RIDGE``; at a sweep's mean spacing g
(log10 dose range / (levels - 1)) it is RIDGE (g / PROFILE_SPACING)^2: the same penalty on the slope per level gap
whatever the spacing, so the interval does not depend on the dose axis's units. A fixed ridge per decade^2 weighs
more against the likelihood the closer the levels: at 0.15 decade it opened both ends of perfectly separated 4 x 3
sweeps and of 143 of 145 simulated ones. No penalty at all (the slope capped) undercovers: 0.85-0.94 in the moderate
designs of ``tests/map/test_threshold_coverage.py``, whose 0.5-decade designs keep about the interval they had
(their realised spacing is near 0.5)."""
CHI2_95 = 1.959963984540054**2  # chi-square, 1 df, 95% quantile (3.841): the profile-likelihood interval's cut
CI_METHOD = ("hull of the profile-likelihood interval of the 50% point under a ridge-penalised logistic fit whose "
             "ridge scales with the squared level spacing (RIDGE at half a decade) "
             "(every t where 2 x (the maximum penalised log-likelihood - its maximum with the 50% point held at t) "
             "<= 3.841; an end where that set reaches past the tested doses, or where the data do not establish a "
             "slope at all, is open), the 2.5/97.5 percentiles of a seed bootstrap, and the bracketing runs' doses")
"""How a fitted threshold's ``ci_low``/``ci_high`` are made: ``ci_method`` in the threshold dict. The bootstrap and
bracket alone held the true 50% point in as few as 57% of simulated sweeps of 1-3 seeds per level
(``tests/map/test_threshold_coverage.py``): 3 seeds give only 10 distinct resamples, 1 seed none."""


def run_dose(point: PointData) -> float | None:
    """A run's realised mismatch (see the module docstring); None when the run has no such metric."""
    for name in DOSE_FIELDS:
        value = point.collapse.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
            return float(value)
    return None


def default_curve_keys(group_keys: list[str]) -> list[str]:
    """Without ``curves`` in the sweep file: every non-seed grid key outside ``inject.*`` splits curves."""
    return [k for k in group_keys if not k.startswith("inject.")]


def dose_response(data: SweepData, curve_keys: list[str] | None = None) -> dict[str, Any]:
    """The ``dose_response.json`` object of a loaded sweep (see the module docstring)."""
    keys = [k for k in (curve_keys if curve_keys is not None else
                        data.curves if data.curves is not None else default_curve_keys(data.group_keys))
            if k in data.group_keys]
    curves: dict[str, dict[str, Any]] = {}
    for values, points in data.groups():
        group = dict(zip(data.group_keys, values))
        curve_values = {k: group[k] for k in keys}
        label = ", ".join(f"{k}={fmt_value(v)}" for k, v in curve_values.items()) or "all"
        curve = curves.setdefault(label, {"curve": label, "keys": curve_values, "groups": []})
        curve["groups"].append((data.group_label(values), group, points))
    return {"metric": METRIC, "summary": SUMMARY, "curve_keys": keys,
            "curves": [_curve(c["curve"], c["keys"], c["groups"]) for c in curves.values()]}


def _curve(label: str, keys: dict[str, Any], groups: list[tuple[str, dict, list[PointData]]]) -> dict[str, Any]:
    rows, runs, missing = [], [], 0
    for group_label, overrides, points in groups:
        done = [p for p in points if p.has_result]
        with_dose = [(p, run_dose(p)) for p in done]
        missing += sum(d is None for _, d in with_dose)
        with_dose = [(p, d) for p, d in with_dose if d is not None]
        collapsed = [p for p, _ in with_dose if _collapsed(p)]
        rows.append({
            "group": group_label, "overrides": overrides, "runs": len(with_dose),
            "realised_k3_kl": statistics.fmean(d for _, d in with_dose) if with_dose else None,
            "collapsed": len(collapsed),
            "collapse_prob": len(collapsed) / len(with_dose) if with_dose else None,
            "median_collapse_step": median(p.collapse.get("collapse_step") for p in collapsed),
            "missing_metric": len(done) - len(with_dose),
            "without_result": len(points) - len(done),
        })
        runs += [(d, _collapsed(p), p.overrides.get(SEED_KEY)) for p, d in with_dose]
    zero = [r for r in runs if r[0] == 0.0]
    baseline = {"runs": len(zero), "collapsed": sum(c for _, c, _ in zero)} if zero else None
    levels = sum(1 for row in rows if row["runs"] and row["realised_k3_kl"])  # groups with a positive dose
    threshold = fit_threshold([r for r in runs if r[0] > 0.0], levels)
    notes = [threshold.pop("note")]
    if missing:
        notes.append(f"{missing} run(s) have no realised {METRIC} (no mismatch metric logged) and are left out")
    if baseline and baseline["collapsed"]:
        notes.append(f"{baseline['collapsed']}/{baseline['runs']} run(s) with zero mismatch collapsed too: "
                     "collapse here is not caused by mismatch alone")
    threshold["note"] = "; ".join(notes)
    return {"curve": label, "keys": keys, "points": rows, "baseline": baseline, "threshold": threshold}


def fit_threshold(runs: list[tuple[float, bool, Any]], levels: int | None = None) -> dict[str, Any]:
    """``runs``: (positive dose, collapsed, seed) per run. Returns the threshold dict (with a ``note``).

    ``levels``: how many dose levels (sweep groups) the runs come from; default: their distinct doses. A group's
    seeds realise slightly different doses, so one group is one level however many doses its runs have."""
    out: dict[str, Any] = {"metric": METRIC, "threshold_50": None, "ci_low": None, "ci_high": None,
                           "runs": len(runs), "collapsed": sum(c for _, c, _ in runs)}
    doses = sorted({d for d, _, _ in runs})
    levels = len(doses) if levels is None else min(levels, len(doses))
    if levels < 2:  # the one level's realised dose kept: a verdict says what was measured, never places on it
        return {**out, **({"dose_min": doses[0], "dose_max": doses[-1]} if doses else {}), "status": "insufficient",
                "note": f"{levels} dose level(s) with a positive realised mismatch: no curve to fit"}
    lo, hi = doses[0], doses[-1]
    out.update(dose_min=lo, dose_max=hi)
    n_collapsed = out["collapsed"]
    if n_collapsed == 0:
        return {**out, "status": "above_range", "lower_bound": hi,
                "note": f"no collapse in {len(runs)} runs up to {METRIC} = {hi:.2e}: the threshold lies above the "
                        "largest value tested"}
    if n_collapsed == len(runs):
        return {**out, "status": "below_range", "upper_bound": lo,
                "note": f"all {len(runs)} runs collapsed, from {METRIC} = {lo:.2e}: the threshold lies below the "
                        "smallest value tested"}
    fit = _logistic([math.log10(d) for d, _, _ in runs], [c for _, c, _ in runs])
    if fit is None or fit[1] <= 0:
        return {**out, "status": "not_monotone",
                "note": "collapse did not become more likely with the realised mismatch (fitted slope <= 0)"}
    intercept, slope = fit
    log_threshold = -intercept / slope  # compared in log10 first: a slope of 1e-16 puts it at 10^(1e16), no float
    # A 50% point outside the tested doses is an extrapolation of a nearly flat fit (say 1 of 4 runs collapsed,
    # all at one dose level): report the side it lies on, not the number.
    log_lo, log_hi = math.log10(lo), math.log10(hi)
    if log_threshold > log_hi:
        return {**out, "status": "above_range", "lower_bound": hi,
                "note": f"{n_collapsed} of {len(runs)} runs collapsed, up to {METRIC} = {hi:.2e}; the fitted 50% point "
                        "lies above the largest value tested"}
    if log_threshold < log_lo:
        return {**out, "status": "below_range", "upper_bound": lo,
                "note": f"{n_collapsed} of {len(runs)} runs collapsed, from {METRIC} = {lo:.2e}; the fitted 50% point "
                        "lies below the smallest value tested"}
    threshold = 10**log_threshold
    bracket_low = max((d for d, c, _ in runs if not c and d <= threshold), default=None)
    bracket_high = min((d for d, c, _ in runs if c and d >= threshold), default=None)
    if len({s for _, _, s in runs}) < 2:  # every resample would be the same runs: no spread to take, only the bracket
        low, high = bracket_low, bracket_high
        note = ("one seed: no bootstrap spread; the interval is the bracketing runs' doses (an end without a "
                "bracketing run is open), widened")
    else:
        low, high, note = _bootstrap(runs, log_lo, log_hi)
        if low is not None and bracket_low is not None:
            low = min(low, bracket_low)
        if high is not None and bracket_high is not None:
            high = max(high, bracket_high)
        note += ", widened to the bracketing runs' doses and"
    # the bootstrap of 1-3 seeds is far too narrow (3 seeds: 10 distinct resamples): the profile likelihood,
    # never narrower than what came before (an open end of any of the three stays open)
    ridge = RIDGE * ((log_hi - log_lo) / (levels - 1) / PROFILE_SPACING) ** 2  # the same per level gap
    profile_fit = _logistic([math.log10(d) for d, _, _ in runs], [c for _, c, _ in runs], ridge=ridge)
    if profile_fit is None or profile_fit[1] <= 0:  # levels too close for a finite fit: the point estimate's ridge
        profile_fit, ridge = (intercept, slope), RIDGE
    profile_low, profile_high, profile_note = _profile_interval(runs, *profile_fit, log_lo, log_hi, ridge)
    low = None if low is None or profile_low is None else min(low, profile_low)
    high = None if high is None or profile_high is None else max(high, profile_high)
    note += f" to the profile-likelihood interval{profile_note}"
    out.update(status="fitted", threshold_50=threshold, ci_low=low, ci_high=high, bracket_low=bracket_low,
               bracket_high=bracket_high, slope_per_decade=slope, ci_method=CI_METHOD)
    return {**out, "note": note}


def _penalised_loglik(x: list[float], y: list[bool], a: float, b: float, ridge: float = RIDGE) -> float:
    """The objective ``_logistic`` maximises: the log-likelihood of y under logit p = a + b x, less ridge b^2 / 2."""
    total = -0.5 * ridge * b * b
    for xi, yi in zip(x, y):
        eta = a + b * xi
        total += (eta if yi else 0.0) - (max(eta, 0.0) + math.log1p(math.exp(-abs(eta))))  # y eta - log(1 + e^eta)
    return total


def _profile_slope(x: list[float], y: list[bool], t: float, b: float, ridge: float = RIDGE) -> tuple[float, float]:
    """(slope, penalised log-likelihood) of the best fit whose 50% point is t (logit p = b (x - t)), from slope b: a
    damped Newton ascent, concave in b (the ridge keeps it strictly so)."""
    u = [xi - t for xi in x]
    value = _penalised_loglik(u, y, 0.0, b, ridge)
    for _ in range(100):
        grad, curv = -ridge * b, ridge
        for ui, yi in zip(u, y):
            p = _sigmoid(b * ui)
            grad += ui * (yi - p)
            curv += ui * ui * p * (1.0 - p)
        step = grad / curv
        new_value = _penalised_loglik(u, y, 0.0, b + step, ridge)
        while new_value < value and abs(step) > 1e-12:  # damped: a full step past a saturated fit can overshoot
            step /= 2
            new_value = _penalised_loglik(u, y, 0.0, b + step, ridge)
        if new_value < value:
            break
        b, value = b + step, new_value
        if abs(step) < 1e-10:
            break
    return b, value


def _profile_interval(runs: list[tuple[float, bool, Any]], intercept: float, slope: float, log_lo: float,
                      log_hi: float, ridge: float = RIDGE) -> tuple[float | None, float | None, str]:
    """The 50% point's profile-likelihood interval (``CI_METHOD``) as doses, with a note for its open ends. The
    profile deviance D(t) = 2 (max penalised log-likelihood - its maximum with the 50% point at t) is 0 at the fit and
    tends, far from the doses on either side, to the deviance of a flat fit (the slope's likelihood-ratio
    statistic): where it stays under ``CHI2_95`` at the tested doses' end or beyond them, that end is open.
    (``intercept``, ``slope``): the fit maximising the penalised log-likelihood with this ``ridge``."""
    x, y = [math.log10(d) for d, _, _ in runs], [c for _, c, _ in runs]
    best = _penalised_loglik(x, y, intercept, slope, ridge)
    rate = sum(y) / len(y)
    flat = 2 * (best - sum(math.log(rate) if yi else math.log(1.0 - rate) for yi in y))  # D far from the doses
    centre = -intercept / slope
    b_at = {centre: slope}  # each profiled t's best slope: the next t's Newton starts from its neighbour's

    def deviance(t: float, start: float) -> float:
        b_at[t], value = _profile_slope(x, y, t, start, ridge)
        return 2 * (best - value)

    ends = []
    for edge in (log_lo, log_hi):
        if flat <= CHI2_95 or deviance(edge, slope) <= CHI2_95:
            ends.append(None)  # the set reaches past the tested doses on this side
            continue
        # the end nearest the edge where D <= CHI2_95: a coarse scan from the edge inward (D need not be monotone),
        # then bisection between the last point above the cut and the first under it
        grid = [edge + (centre - edge) * k / 16 for k in range(17)]
        outside, inside = edge, centre
        for prev, t in zip(grid, grid[1:]):
            if deviance(t, b_at[prev]) <= CHI2_95:
                outside, inside = prev, t
                break
        for _ in range(40):
            mid = (outside + inside) / 2
            if deviance(mid, b_at[inside]) <= CHI2_95:
                inside = mid
            else:
                outside = mid
        ends.append(10**inside)
    note = ""
    if flat <= CHI2_95:
        note = (f" (open at both ends: a flat fit is within the 95% cut, likelihood ratio {flat:.2f} <= "
                f"{CHI2_95:.2f}: these runs do not establish that collapse rises with the dose)")
    elif ends[0] is None and ends[1] is None:
        note = " (open at both ends: the profile stays within the 95% cut out to both ends of the doses tested)"
    elif ends[0] is None:
        note = " (open below: the profile stays within the 95% cut down to the smallest dose tested)"
    elif ends[1] is None:
        note = " (open above: the profile stays within the 95% cut up to the largest dose tested)"
    return ends[0], ends[1], note


def _bootstrap(runs: list[tuple[float, bool, Any]], log_lo: float, log_hi: float
               ) -> tuple[float | None, float | None, str]:
    """The threshold's percentile interval over seed resamples; a resample whose 50% point the tested doses
    [10^log_lo, 10^log_hi] do not hold (none collapsed, all did, a fit that does not rise or lies outside) counts
    as below or above the range, as the whole fit's does."""
    seeds = sorted({s for _, _, s in runs}, key=str)
    by_seed = {s: [r for r in runs if r[2] == s] for s in seeds}
    rng = random.Random(BOOTSTRAP_SEED)
    log_thresholds = []
    fitted: dict[tuple[int, ...], float] = {}  # a resample is a multiset of seeds: 3 seeds have 10, fitted once each
    for _ in range(BOOTSTRAP):
        drawn = tuple(sorted(rng.choices(range(len(seeds)), k=len(seeds))))
        if drawn in fitted:
            log_thresholds.append(fitted[drawn])
            continue
        sample = [r for i in drawn for r in by_seed[seeds[i]]]
        outcomes = [c for _, c, _ in sample]
        if not any(outcomes):
            log_thresholds.append(math.inf)
        elif all(outcomes):
            log_thresholds.append(-math.inf)
        else:
            fit = _logistic([math.log10(d) for d, _, _ in sample], outcomes)
            t = math.inf if fit is None or fit[1] <= 0 else -fit[0] / fit[1]
            log_thresholds.append(t if log_lo <= t <= log_hi else -math.inf if t < log_lo else math.inf)
        fitted[drawn] = log_thresholds[-1]
    log_thresholds.sort()
    low, high = (log_thresholds[int(q * (BOOTSTRAP - 1))] for q in (0.025, 0.975))
    note = f"95% interval from {BOOTSTRAP} bootstrap resamples of {len(seeds)} seeds"
    if not math.isfinite(low):
        note += "; its lower end lies below the tested range (resamples that collapsed throughout, or put it there)"
    if not math.isfinite(high):
        note += ("; its upper end lies above the tested range (resamples without a collapse, or whose fit does not "
                 "rise or puts it there)")
    as_dose = lambda x: 10**x if math.isfinite(x) else None  # noqa: E731
    return as_dose(low), as_dose(high), note


def _sigmoid(z: float) -> float:
    """The logistic function, its argument clamped to ±50 (exp overflows far beyond; p is 0 or 1 there anyway)."""
    return 1.0 / (1.0 + math.exp(-max(min(z, 50.0), -50.0)))


def _logistic(x: list[float], y: list[bool], iterations: int = 100, ridge: float = RIDGE
              ) -> tuple[float, float] | None:
    """Ridge-penalised logistic regression of y on x by Newton's method: (intercept, slope), None if it fails."""
    a = b = 0.0
    for _ in range(iterations):
        grad_a = grad_b = 0.0
        h_aa, h_ab, h_bb = 0.0, 0.0, ridge
        grad_b -= ridge * b
        for xi, yi in zip(x, y):
            p = _sigmoid(a + b * xi)
            grad_a += yi - p
            grad_b += (yi - p) * xi
            w = p * (1.0 - p)
            h_aa += w
            h_ab += w * xi
            h_bb += w * xi * xi
        h_aa += 1e-9  # the intercept is unpenalised; keep the Hessian invertible
        det = h_aa * h_bb - h_ab * h_ab
        if det <= 0 or not math.isfinite(det):
            return None
        step_a = (h_bb * grad_a - h_ab * grad_b) / det
        step_b = (h_aa * grad_b - h_ab * grad_a) / det
        a, b = a + step_a, b + step_b
        if abs(step_a) < 1e-10 and abs(step_b) < 1e-10:
            break
    return (a, b) if math.isfinite(a) and math.isfinite(b) else None


def collapse_probability(threshold: dict[str, Any], dose: float) -> float | None:
    """The fitted curve at ``dose`` (for plots); None without a fitted threshold."""
    if threshold.get("status") != "fitted":
        return None
    slope = threshold["slope_per_decade"]
    z = slope * (math.log10(dose) - math.log10(threshold["threshold_50"]))
    return _sigmoid(z)


def plot_dose_response(result: dict[str, Any], path: Any, title: str = "") -> Any:
    """``dose_response.png``: collapse probability against realised k3 (log x), one curve per ``curves`` entry,
    the fitted logistic curve, and each threshold with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    cmap = plt.get_cmap("tab10")
    doses = [p["realised_k3_kl"] for c in result["curves"] for p in c["points"]
             if p["realised_k3_kl"] is not None and p["realised_k3_kl"] > 0]
    lines = []
    for i, curve in enumerate(result["curves"]):
        colour = cmap(i % 10)
        pts = [(p["realised_k3_kl"], p["collapse_prob"]) for p in curve["points"]
               if p["realised_k3_kl"] is not None and p["realised_k3_kl"] > 0 and p["collapse_prob"] is not None]
        t = curve["threshold"]
        label = f"{curve['curve']}: " + threshold_words(t)
        if pts:
            ax.scatter(*zip(*sorted(pts)), color=colour, s=50, zorder=3, alpha=0.85, label=label)
            lines.append(label)
        if t["status"] == "fitted" and doses:
            lo, hi = math.log10(min(doses)) - 0.3, math.log10(max(doses)) + 0.3
            xs = [10 ** (lo + (hi - lo) * k / 200) for k in range(201)]
            ax.plot(xs, [collapse_probability(t, x) for x in xs], color=colour, lw=1.5)
            ax.axvline(t["threshold_50"], color=colour, ls="--", lw=1)
            if t["ci_low"] is not None or t["ci_high"] is not None:
                ax.axvspan(t["ci_low"] or 10**lo, t["ci_high"] or 10**hi, color=colour, alpha=0.08)
    ax.axhline(0.5, color="grey", lw=0.8, ls=":")
    if doses:
        ax.set_xscale("log")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
                  frameon=False)  # outside the axes: it covered the low-dose points
    else:
        ax.text(0.5, 0.5, "no run with a positive realised mismatch", transform=ax.transAxes, ha="center",
                va="center", fontsize=12, color="grey")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("realised mismatch: k3 KL between rollout and training log-probs (run mean before collapse)")
    ax.set_ylabel("fraction of seeds that collapsed")
    ax.set_title(f"{title}: collapse probability vs realised mismatch" if title else
                 "collapse probability vs realised mismatch")
    ax.grid(True, which="major", alpha=0.3)
    # "tight" keeps the outside legend in the image; published whole (atomic.publish)
    publish(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return path


def threshold_words(t: dict[str, Any]) -> str:
    """One line for terminals and Markdown: the threshold with its interval, or why there is none."""
    if t["status"] == "fitted":
        ci = f" [{_sci(t['ci_low'])}, {_sci(t['ci_high'])}]"
        return f"50% at k3 = {t['threshold_50']:.1e}{ci}"
    collapsed, runs = t.get("collapsed", 0), t.get("runs", 0)
    if t["status"] == "above_range":
        if not collapsed:
            return f"no collapse up to {t['lower_bound']:.1e}"
        return f"under 50% up to {t['lower_bound']:.1e} ({collapsed} of {runs} collapsed)"
    if t["status"] == "below_range":
        if collapsed == runs:
            return f"all collapsed from {t['upper_bound']:.1e}"
        return f"over 50% from {t['upper_bound']:.1e} ({collapsed} of {runs} collapsed)"
    return t["status"].replace("_", " ")


def _sci(v: float | None) -> str:
    return "?" if v is None else f"{v:.1e}"


def _collapsed(p: PointData) -> bool:
    return p.collapse.get("collapsed") is True


