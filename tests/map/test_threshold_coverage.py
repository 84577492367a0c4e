"""How often the collapse threshold's 95% interval (``dose_response.fit_threshold``) holds the true 50% point, by
simulation: sweeps drawn from a known logistic collapse curve in log10 dose, designed like the shipped ones (4 or 5
dose levels half a decade apart spanning the threshold, 1-3 seeds per level, and 4 x 3 levels 0.15 decade apart as
refinement rounds place them; each seed's realised dose a little off its level's), fitted as a sweep report fits
them. Deterministic (fixed RNG seeds), pure Python.

An open end (None) holds the true point on that side; so that an interval open too often cannot pass, each design
bounds how often a fitted interval has an open end and the median width of the closed ones. A fit above or below
the range claims the threshold lies outside the tested doses: where the true point lies inside them, a miss. A fit
that is not monotone (or too few levels) makes no claim."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

import numpy as np
import pytest

from vexact.sweeps.dose_response import (
    CHI2_95,
    CI_METHOD,
    PROFILE_SPACING,
    RIDGE,
    _logistic,
    _profile_interval,
    fit_threshold,
)

TRUE_LOG10 = -2.0  # the true 50% point: k3 = 0.01
MODERATE = 2 * math.log(9)  # logit slope per decade: collapse goes 10% -> 90% over one decade
STEEP = 5 * MODERATE  # 10% -> 90% over a fifth of a decade
SIMULATED = 150  # sweeps per design
COVERAGE_FLOOR = 0.93  # nominal 95%, less the simulation's own scatter


def _sweep(rng: random.Random, slope: float, levels: int, seeds: int, spacing: float = 0.5
           ) -> list[tuple[float, bool, int]]:
    """One simulated sweep's runs (realised dose, collapsed, seed): levels ``spacing`` decades apart, the grid shifted
    at random by up to half a level gap about the true point, each run's realised dose 0.03 decades (sd) off its
    level."""
    shift = rng.uniform(-0.5, 0.5) * spacing
    runs = []
    for k in range(levels):
        level = TRUE_LOG10 + shift + spacing * (k - (levels - 1) / 2)
        for seed in range(seeds):
            x = level + rng.gauss(0.0, 0.03)
            runs.append((10**x, rng.random() < 1.0 / (1.0 + math.exp(-slope * (x - TRUE_LOG10))), seed))
    return runs


@dataclass
class Coverage:
    held: int  # claims whose interval holds the true point (an above/below-range claim never does)
    claims: int  # fitted sweeps, and above/below-range ones whose tested doses span the true point
    no_claim: int  # the rest: not monotone, insufficient, or a bound on the right side of a truth outside the doses
    fitted: int
    open_end: int  # fitted intervals with an open end
    median_width: float | None  # decades, over the fitted intervals closed at both ends

    def __str__(self) -> str:
        width = "-" if self.median_width is None else f"{self.median_width:.2f}"
        return (f"{self.held}/{self.claims} = {self.held / self.claims:.3f}, open {self.open_end}/{self.fitted} = "
                f"{self.open_end / self.fitted:.2f}, width {width}")


def coverage(slope: float, levels: int, seeds: int, spacing: float = 0.5, sweeps: int = SIMULATED) -> Coverage:
    """The interval's record over ``sweeps`` simulated sweeps of one design."""
    rng = random.Random(f"{slope:.3f}-{levels}-{seeds}" + ("" if spacing == 0.5 else f"-{spacing}"))
    truth = 10**TRUE_LOG10
    held = claims = fitted = open_end = 0
    widths = []
    for _ in range(sweeps):
        runs = _sweep(rng, slope, levels, seeds, spacing)
        t = fit_threshold(runs, levels)
        spanned = min(d for d, _, _ in runs) <= truth <= max(d for d, _, _ in runs)
        if t["status"] in ("above_range", "below_range"):
            claims += spanned  # the truth lies inside the tested doses: a claim that it lies outside them, missed
            continue
        if t["status"] != "fitted":
            continue
        claims += 1
        fitted += 1
        lo, hi = t["ci_low"], t["ci_high"]
        held += (lo is None or lo <= truth) and (hi is None or truth <= hi)
        if lo is None or hi is None:
            open_end += 1
        else:
            widths.append(math.log10(hi / lo))
    return Coverage(held, claims, sweeps - claims, fitted, open_end, statistics.median(widths) if widths else None)


FINE = 2 * math.log(9) / 0.3  # 10% -> 90% over 0.3 decade, sampled by levels 0.15 decade apart (refinement rounds)
# (name, slope, levels, seeds, spacing, open-end ceiling, median-width ceiling in decades). The ceilings are the
# measured values below with a margin (open: +0.10; width: x 1.25), so an interval that opens or widens more than
# the data call for fails. With one seed per level an end is always open (4-5 runs do not bound the threshold on
# both sides, a claim of both ends would be the bracket's): no ceiling there, and no closed interval to measure.
DESIGNS = [
    ("moderate", MODERATE, 4, 1, 0.5, None, None),
    ("moderate", MODERATE, 4, 2, 0.5, 0.89, 1.36),
    ("moderate", MODERATE, 4, 3, 0.5, 0.59, 1.08),
    ("moderate", MODERATE, 5, 1, 0.5, None, None),
    ("moderate", MODERATE, 5, 2, 0.5, 0.54, 1.33),
    ("moderate", MODERATE, 5, 3, 0.5, 0.21, 1.00),
    ("steep", STEEP, 4, 1, 0.5, None, None),
    ("steep", STEEP, 4, 2, 0.5, 0.32, 1.36),
    ("steep", STEEP, 4, 3, 0.5, 0.19, 0.93),
    ("steep", STEEP, 5, 1, 0.5, None, None),
    ("steep", STEEP, 5, 2, 0.5, 0.10, 1.29),
    ("steep", STEEP, 5, 3, 0.5, 0.10, 0.92),
    ("fine", FINE, 4, 3, 0.15, 0.58, 0.36),
]


# Measured, SIMULATED sweeps per design: coverage (held / claims), the fraction of fitted intervals with an open
# end, and the median width (decades) of those closed at both ends; before = the ridge fixed per decade^2 in the
# profile (ci_method's first version), now = the ridge scaled with the level spacing (dose_response.PROFILE_SPACING).
#   moderate, 4 x 1, 0.5
#     before 142/148 = 0.959, open 142/142 = 1.00, width -
#     now    142/148 = 0.959, open 142/142 = 1.00, width -
#   moderate, 4 x 2, 0.5
#     before 143/150 = 0.953, open 114/145 = 0.79, width 1.08
#     now    143/150 = 0.953, open 114/145 = 0.79, width 1.09
#   moderate, 4 x 3, 0.5
#     before 144/150 = 0.960, open 72/148 = 0.49, width 0.85
#     now    144/150 = 0.960, open 72/148 = 0.49, width 0.86
#   moderate, 5 x 1, 0.5
#     before 149/150 = 0.993, open 149/149 = 1.00, width -
#     now    149/150 = 0.993, open 149/149 = 1.00, width -
#   moderate, 5 x 2, 0.5
#     before 146/150 = 0.973, open 65/149 = 0.44, width 1.06
#     now    146/150 = 0.973, open 65/149 = 0.44, width 1.06
#   moderate, 5 x 3, 0.5
#     before 148/150 = 0.987, open 17/150 = 0.11, width 0.80
#     now    148/150 = 0.987, open 17/150 = 0.11, width 0.80
#   steep, 4 x 1, 0.5
#     before 150/150 = 1.000, open 150/150 = 1.00, width -
#     now    150/150 = 1.000, open 150/150 = 1.00, width -
#   steep, 4 x 2, 0.5
#     before 150/150 = 1.000, open 33/150 = 0.22, width 1.07
#     now    150/150 = 1.000, open 33/150 = 0.22, width 1.09
#   steep, 4 x 3, 0.5
#     before 150/150 = 1.000, open 14/150 = 0.09, width 0.73
#     now    150/150 = 1.000, open 14/150 = 0.09, width 0.74
#   steep, 5 x 1, 0.5
#     before 150/150 = 1.000, open 150/150 = 1.00, width -
#     now    150/150 = 1.000, open 150/150 = 1.00, width -
#   steep, 5 x 2, 0.5
#     before 150/150 = 1.000, open 0/150 = 0.00, width 1.02
#     now    150/150 = 1.000, open 0/150 = 0.00, width 1.03
#   steep, 5 x 3, 0.5
#     before 150/150 = 1.000, open 0/150 = 0.00, width 0.72
#     now    150/150 = 1.000, open 0/150 = 0.00, width 0.73
#   fine, 4 x 3, 0.15
#     before 145/150 = 0.967, open 143/145 = 0.99, width 0.52
#     now    143/150 = 0.953, open 69/145 = 0.48, width 0.29
# (The seed bootstrap widened to the bracket alone, before the profile likelihood, held the true point in as few as
# 57% of fitted sweeps: 9 of the 12 half-decade designs under the floor.)
@pytest.mark.parametrize("design", DESIGNS, ids=[f"{d[0]}-{d[2]}x{d[3]}-{d[4]}" for d in DESIGNS])
def test_the_threshold_interval_holds_the_true_50_percent_point_at_about_95_percent(design):
    _, slope, levels, seeds, spacing, open_ceiling, width_ceiling = design
    c = coverage(slope, levels, seeds, spacing)
    assert c.fitted >= SIMULATED // 3, f"only {c.fitted} of {SIMULATED} sweeps fitted a threshold"
    assert c.held / c.claims >= COVERAGE_FLOOR, str(c)
    if open_ceiling is not None:
        assert c.open_end / c.fitted <= open_ceiling, str(c)
    if width_ceiling is not None:
        assert c.median_width is not None and c.median_width <= width_ceiling, str(c)


def test_the_interval_names_its_method_and_is_never_narrower_than_the_bracket():
    runs = [(10 ** (-3 + 0.5 * k), k >= 2, s) for k in range(4) for s in range(3)]
    t = fit_threshold(runs, 4)
    assert t["status"] == "fitted" and t["ci_method"] == CI_METHOD
    assert t["ci_low"] <= t["bracket_low"] < t["threshold_50"] < t["bracket_high"] <= t["ci_high"]
    assert "profile-likelihood interval" in t["note"]


def _separated(spacing: float) -> list[tuple[float, bool, int]]:
    """4 levels x 3 seeds ``spacing`` decades apart, the two lower levels safe and the two upper ones collapsed."""
    return [(10 ** (-2 + spacing * (k - 1.5)), k >= 2, s) for k in range(4) for s in range(3)]


@pytest.mark.parametrize("spacing", [0.5, 0.3, 0.15, 0.05])
def test_perfectly_separated_runs_close_the_interval_however_finely_the_doses_are_spaced(spacing):
    """The profile's ridge scales with the level spacing, so these sweeps, the same on a finer dose axis, give the
    same interval on it (here the bracket: the profile closes inside it). A ridge fixed per decade^2 (0.05) once
    opened both ends at 0.15 decade spacing: the closer the levels, the more the penalised best fit gives up against
    a flat one, and the deviance at the outer levels fell under 3.841."""
    t = fit_threshold(_separated(spacing), 4)
    assert t["status"] == "fitted"
    assert t["ci_low"] is not None and t["ci_high"] is not None, t["note"]
    lo, hi = 10 ** (-2 - 1.5 * spacing), 10 ** (-2 + 1.5 * spacing)
    assert lo < t["ci_low"] <= t["bracket_low"] < t["threshold_50"] < t["bracket_high"] <= t["ci_high"] < hi


def _brute_force_profile_interval(runs: list[tuple[float, bool, int]], ridge: float
                                  ) -> tuple[float | None, float | None]:
    """The profile-likelihood interval of the 50% point by a grid: the log-likelihood of logit p = b (log10 dose - t)
    less ridge b^2 / 2 at every (t, b) of a fine grid, D(t) = 2 (its maximum - its maximum at t); the interval is the
    hull of the t with D <= CHI2_95, an end at the tested doses' end open."""
    x = np.array([math.log10(d) for d, _, _ in runs])
    y = np.array([c for _, c, _ in runs], dtype=float)
    lo, hi = x.min(), x.max()
    ts = np.linspace(lo - 0.5, hi + 0.5, 2001)
    magnitudes = np.concatenate([[0.0], np.geomspace(1e-2, 1e3, 1000)])
    bs = np.concatenate([-magnitudes[::-1], magnitudes])
    profile = np.empty(len(ts))
    for i, t in enumerate(ts):
        eta = bs[:, None] * (x[None, :] - t)
        profile[i] = ((y * eta - np.logaddexp(0.0, eta)).sum(axis=1) - 0.5 * ridge * bs**2).max()
    inside = (ts >= lo) & (ts <= hi)
    within = ts[inside][2 * (profile.max() - profile[inside]) <= CHI2_95]
    step = ts[1] - ts[0]
    return (None if within.min() <= lo + step else 10 ** within.min(),
            None if within.max() >= hi - step else 10 ** within.max())


@pytest.mark.parametrize("case", range(6))
def test_the_profile_interval_is_the_brute_force_grids(case):
    """``_profile_interval`` (a Newton ascent per t, a scan and bisection) against the grid, with the ridge
    ``fit_threshold`` gives the profile: the same ends, to the grid's resolution (under 0.002 decade in t), the same
    open ends. Cases: separated runs at 0.15 and 0.5 decade, and simulated sweeps with overlapping outcomes."""
    levels = 4 if case < 2 else 5
    if case < 2:
        runs = _separated([0.15, 0.5][case])
    else:
        rng = random.Random(f"brute-{case}")
        runs = []
        while not (0 < sum(c for _, c, _ in runs) < len(runs)):
            runs = _sweep(rng, MODERATE, levels, 3)
    x = [math.log10(d) for d, _, _ in runs]
    ridge = RIDGE * ((max(x) - min(x)) / (levels - 1) / PROFILE_SPACING) ** 2
    intercept, slope = _logistic(x, [c for _, c, _ in runs], ridge=ridge)
    low, high, _ = _profile_interval(runs, intercept, slope, min(x), max(x), ridge)
    brute_low, brute_high = _brute_force_profile_interval(runs, ridge)
    for got, want in ((low, brute_low), (high, brute_high)):
        assert (got is None) == (want is None), (low, high, brute_low, brute_high)
        if got is not None:
            assert abs(math.log10(got) - math.log10(want)) < 0.005, (low, high, brute_low, brute_high)
