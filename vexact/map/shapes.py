"""The law's shape: the power law against a saturating threshold F + B/T.

``compare_shapes``: both fitted in log10 on the fitted horizons, compared by AIC and leave-one-out error (three
fitted horizons or more). ``fit_line`` (least squares) and ``respects_value`` (a predicted threshold against a
horizon's bound) serve the power-law fit too.
"""

from __future__ import annotations

import math
from typing import Any

from .points import positive

SHAPE_MIN_HORIZONS = 3  # two 2-parameter shapes: three points leave one degree of freedom each


def respects_value(h: dict[str, Any], predicted: float) -> bool:
    """Does a threshold ``predicted`` at a bounded horizon agree with its bound (above a lower bound, below an
    upper one)?"""
    if h["status"] == "above_range":
        return predicted >= h["lower_bound"]
    return predicted <= h["upper_bound"]


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return slope, my - slope * mx


GOLDEN = (math.sqrt(5) - 1) / 2
SATURATING_GRID = 100  # floor values tried before the golden-section refinement


def compare_shapes(horizons: list[dict[str, Any]]) -> dict[str, Any]:
    """Is the threshold still falling as a power of T, or levelling off? Over the horizons with a fitted threshold,
    fit both in log10 by least squares -- the power law log10 A − α·log10 T and the saturating floor F + B/T
    (F, B >= 0; F = 0 is the power law with α = 1) -- and compare them by AIC (n·ln(RSS/n) + 2k, k = 2 each) and
    by leave-one-out error (each horizon predicted from a fit to the others). ΔAIC = AIC(power) − AIC(saturating):
    above 2 the data prefer the floor, below −2 the power law, between them neither. The horizons with only a bound
    (no collapse up to X, or collapse from the smallest dose) stay out of both fits and test them: each shape lists
    the bounds its curve violates (``bounds_violated``, horizon values), and the note names them."""
    pts = sorted((h["horizon"], h["threshold_50"]) for h in horizons if h.get("status") == "fitted"
                 and positive(h.get("horizon")) and positive(h.get("threshold_50")))
    n = len(pts)
    if n < SHAPE_MIN_HORIZONS:
        return {"status": "too_few", "horizons": n,
                "note": f"{n} horizon(s) with a fitted threshold: comparing a power law with a saturating threshold "
                        f"(two parameters each) needs at least {SHAPE_MIN_HORIZONS}"}
    ts, ys = [t for t, _ in pts], [math.log10(v) for _, v in pts]
    bounded = [h for h in horizons if positive(h.get("horizon")) and (
        (h.get("status") == "above_range" and positive(h.get("lower_bound")))
        or (h.get("status") == "below_range" and positive(h.get("upper_bound"))))]
    fits = {"power": _fit_power, "saturating": _fit_saturating}
    out: dict[str, Any] = {"status": "compared", "horizons": n, "horizon_range": [ts[0], ts[-1]]}
    for name, fit in fits.items():
        params, predict = fit(ts, ys)
        rss = sum((predict(t) - y) ** 2 for t, y in zip(ts, ys))
        loo = []
        for i in range(n):
            _, predict_i = fit(ts[:i] + ts[i + 1:], ys[:i] + ys[i + 1:])
            loo.append(predict_i(ts[i]) - ys[i])
        out[name] = {**params, "rss": rss, "aic": n * math.log(max(rss, 1e-12) / n) + 2 * 2,
                     "loo_rmse": math.sqrt(sum(e * e for e in loo) / n)}
        out[name]["bounds_violated"] = [h["horizon_value"] for h in bounded if not respects_value(
            h, 10 ** predict(h["horizon"]))]
    delta = out["power"]["aic"] - out["saturating"]["aic"]
    out["delta_aic"] = delta
    out["preferred"] = "saturating" if delta > 2 else "power" if delta < -2 else None
    p, f = out["power"], out["saturating"]
    verdict = {"saturating": "the data prefer the saturating shape", "power": "the data prefer the power law",
               None: "the two shapes cannot be told apart (|ΔAIC| < 2)"}[out["preferred"]]
    out["note"] = (f"shape over {n} fitted horizons (T = {ts[0]:.0f} .. {ts[-1]:.0f}): power law α = {p['alpha']:.2f}, "
                   f"RSS {p['rss']:.2g} dex², leave-one-out RMSE {p['loo_rmse']:.2g} dex; saturating "
                   f"{f['floor']:.2g} + {f['scale']:.2g}/T, RSS {f['rss']:.2g} dex², leave-one-out RMSE "
                   f"{f['loo_rmse']:.2g} dex; ΔAIC (power − saturating) = {delta:+.2f}: {verdict}"
                   + (f" ({n} points for 2 parameters each: a weak test)" if n <= SHAPE_MIN_HORIZONS else "")
                   + _bounds_against_shapes(bounded, out))
    return out


def _bounds_against_shapes(bounded: list[dict[str, Any]], shapes: dict[str, Any]) -> str:
    """One clause per bound: which shapes it rules out (their curve crosses it), or that both respect it."""
    clauses = []
    for h in bounded:
        side = (f"above k3 {h['lower_bound']:.2g}" if h["status"] == "above_range"
                else f"below k3 {h['upper_bound']:.2g}")
        against = [name for name in ("power", "saturating") if h["horizon_value"] in shapes[name]["bounds_violated"]]
        verdict = ("both shapes respect it" if not against else "both shapes violate it" if len(against) == 2
                   else f"it rules out the {'power law' if against == ['power'] else 'saturating shape'}")
        clauses.append(f"the bound at T {h['horizon']:.0f} (threshold {side}): {verdict}")
    return ("; " + "; ".join(clauses)) if clauses else ""


def _fit_power(ts: list[float], ys: list[float]) -> tuple[dict[str, float], Any]:
    slope, intercept = fit_line([math.log10(t) for t in ts], ys)
    return {"alpha": -slope, "log10_prefactor": intercept}, lambda t: intercept + slope * math.log10(t)


def _fit_saturating(ts: list[float], ys: list[float]) -> tuple[dict[str, float], Any]:
    """F + B/T (F, B >= 0) by least squares in log10: for each floor F the best B (golden section in log10 B), over
    F a grid on [0, max threshold] refined by golden section. Deterministic."""
    top = max(10 ** y for y in ys)
    u_lo = math.log10(min(10 ** y * t for t, y in zip(ts, ys))) - 4  # B/T spans the thresholds with room
    u_hi = math.log10(max(10 ** y * t for t, y in zip(ts, ys))) + 4

    def rss(floor: float, u: float) -> float:
        return sum((math.log10(floor + 10 ** u / t) - y) ** 2 for t, y in zip(ts, ys))

    def best_u(floor: float) -> float:
        return _golden(lambda u: rss(floor, u), u_lo, u_hi)

    def cost(floor: float) -> float:
        return rss(floor, best_u(floor))

    grid = [top * k / SATURATING_GRID for k in range(SATURATING_GRID + 1)]
    costs = [cost(f) for f in grid]
    k = min(range(len(grid)), key=costs.__getitem__)
    floor = _golden(cost, grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)])
    if cost(floor) > costs[k]:
        floor = grid[k]
    u = best_u(floor)
    scale = 10 ** u
    return {"floor": floor, "scale": scale}, lambda t: math.log10(floor + scale / t)


def _golden(f: Any, lo: float, hi: float, steps: int = 60) -> float:
    """The minimiser of a unimodal ``f`` on [lo, hi] by golden-section search."""
    a, b = lo, hi
    c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - GOLDEN * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + GOLDEN * (b - a)
            fd = f(d)
    return (a + b) / 2
