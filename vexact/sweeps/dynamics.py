"""Mismatch dynamics: does the realised mismatch grow during a run, and what does it move with?

Under a fixed injection (a precision or kernel source has no knob that changes over time), the rollout-training
k3 KL can still change because the *policy* changes: a sharper policy puts more mass on tokens whose logits sit
close together or in low-precision tails. ``mismatch_dynamics(data)`` answers, per sweep group (``dynamics.json``):

- ``k3_early`` / ``k3_late``: mean ``rollout_corr/k3_kl`` over the first and last ``WINDOW`` fraction of each run's
  steps (before any collapse), averaged over seeds; ``growth`` = late / early, and ``runs_growing`` the runs whose
  own ratio exceeds 1;
- ``corr``: for each of ``TRACKED`` (policy entropy, grad norm, response length), the Pearson correlation over a
  run's steps between ``log10(k3)`` and that metric, averaged over seeds. Negative with entropy = the mismatch
  rises as the policy sharpens.

Steps with k3 <= 0 (exact, no mismatch) or non-finite values are skipped; a group without enough steps gets None.

Across the length surge ("Beyond Precision" says the mismatch and the gradient noise grow once the
response length surges), every group also gets ``surge`` (``surge_dynamics``), zero-mismatch groups included:

- ``runs_surged``: runs whose collapse detector reported a ``length_surge_step``; ``surge_step`` its median;
- ``length_surge_lead``: the runs' ``collapse_step - length_surge_step`` (collapses after a surge), and
  ``collapsed_after_surge`` / ``collapsed_before_surge`` / ``collapsed_without_surge`` counts;
- ``phases``: per quantity of ``SURGE_TRACKED``, the seed mean of each run's mean *before* (steps < s - w),
  *during* (s - w <= step < s + w) and *after* (s + w <= step, up to the collapse) the surge step s, w being the
  detector's window (``SURGE_WINDOW``, the ``collapse.length_surge_window`` default) -- the trailing window that
  fired is "during", so "before" is the flat start; and ``after_before`` / ``during_before``, the seed means of
  each run's ratio (None where a run's before-mean is 0, e.g. the k3 of an exact run).

The sequence-level mismatch is ``mismatch/log_ppl_abs_diff_sum`` (the mean over sequences of
``|sum_t (logp_train - logp_roll)|``: paper 003's eq. 8 summed, the spread of the sequence log-ratio), the per-token
ones ``rollout_corr/k3_kl`` and ``rollout_corr/log_ppl_abs_diff`` (verl's per-token mean inside each sequence).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from ..metric_keys import (
    ENTROPY,
    GRAD_NORM,
    K3_KL,
    LOG_PPL_ABS_DIFF,
    LOG_PPL_ABS_DIFF_SUM,
    RESPONSE_LENGTH_MEAN,
    REWARD_MEAN,
)
from .sweep_data import PointData, SweepData, metric_series

TRACKED = {"entropy": ENTROPY, "grad_norm": GRAD_NORM, "response_length": RESPONSE_LENGTH_MEAN}
SURGE_TRACKED = {"response_length": RESPONSE_LENGTH_MEAN, "reward": REWARD_MEAN, "k3": K3_KL,
                 "log_ppl_abs_diff": LOG_PPL_ABS_DIFF,
                 "seq_log_ratio_abs": LOG_PPL_ABS_DIFF_SUM,
                 "grad_norm": GRAD_NORM, "entropy": ENTROPY}
SURGE_WINDOW = 10  # the surge detector's default window (collapse.length_surge_window)
PHASES = ("before", "during", "after")
MIN_PHASE_STEPS = 3  # a phase with fewer steps than this has no mean
WINDOW = 0.2  # early / late = first / last fifth of the steps before collapse
MIN_STEPS = 10  # fewer usable steps than this: no statement about the run


def run_dynamics(point: PointData) -> dict[str, Any] | None:
    """One run's early/late k3 and correlations; None when it has fewer than ``MIN_STEPS`` usable steps."""
    end = point.collapse_step
    rows = {}
    for step, k3 in zip(*metric_series(point, K3_KL)):
        if k3 > 0 and math.isfinite(k3) and (end is None or step < end):
            rows[step] = k3
    if len(rows) < MIN_STEPS:
        return None
    steps = sorted(rows)
    n = max(1, int(len(steps) * WINDOW))
    early = statistics.fmean(rows[s] for s in steps[:n])
    late = statistics.fmean(rows[s] for s in steps[-n:])
    corr = {}
    for name, key in TRACKED.items():
        other = dict(zip(*metric_series(point, key)))
        pairs = [(math.log10(rows[s]), other[s]) for s in steps if s in other and math.isfinite(other[s])]
        corr[name] = _pearson(pairs)
    return {"k3_early": early, "k3_late": late, "growth": late / early, "corr": corr}


def mismatch_dynamics(data: SweepData) -> list[dict[str, Any]]:
    """One entry per group: the seed-averaged dynamics (see the module docstring)."""
    out = []
    for values, points in data.groups():
        runs = [d for d in (run_dynamics(p) for p in points if p.has_result) if d is not None]
        entry: dict[str, Any] = {"group": data.group_label(values), "runs": len(runs)}
        if runs:
            entry.update(
                k3_early=statistics.fmean(r["k3_early"] for r in runs),
                k3_late=statistics.fmean(r["k3_late"] for r in runs),
                runs_growing=sum(r["growth"] > 1 for r in runs),
                growth=statistics.fmean(r["growth"] for r in runs),
                corr={name: _mean_or_none([r["corr"][name] for r in runs]) for name in TRACKED},
            )
        entry["surge"] = surge_dynamics([p for p in points if p.has_result])
        out.append(entry)
    return out


def run_phases(point: PointData, window: int = SURGE_WINDOW) -> dict[str, dict[str, float | None]] | None:
    """One run's mean of each ``SURGE_TRACKED`` quantity before / during / after its length surge (see the
    module docstring); None when the run has no surge step. Steps from the collapse step on are left out."""
    surge = point.collapse.get("length_surge_step")
    if not isinstance(surge, int):
        return None
    end = point.collapse_step
    bounds = {"before": (-math.inf, surge - window), "during": (surge - window, surge + window),
              "after": (surge + window, math.inf if end is None else end)}
    out: dict[str, dict[str, float | None]] = {}
    for name, key in SURGE_TRACKED.items():
        steps, values = metric_series(point, key)
        out[name] = {}
        for phase, (lo, hi) in bounds.items():
            vals = [v for s, v in zip(steps, values) if lo <= s < hi and math.isfinite(v)
                    and (end is None or s < end)]
            out[name][phase] = statistics.fmean(vals) if len(vals) >= MIN_PHASE_STEPS else None
    return out


def surge_dynamics(points: list[PointData], window: int = SURGE_WINDOW) -> dict[str, Any]:
    """The group's surge statistics over its finished runs ``points`` (see the module docstring)."""
    surged = [p for p in points if isinstance(p.collapse.get("length_surge_step"), int)]
    leads = [p.collapse["length_surge_lead"] for p in surged if isinstance(p.collapse.get("length_surge_lead"), int)]
    collapsed = [p for p in points if p.collapse.get("collapsed")]
    after = sum(1 for p in collapsed if isinstance(p.collapse.get("length_surge_lead"), int))
    no_surge = sum(1 for p in collapsed if not isinstance(p.collapse.get("length_surge_step"), int))
    out: dict[str, Any] = {
        "runs": len(points), "runs_surged": len(surged),
        "surge_step": statistics.median(p.collapse["length_surge_step"] for p in surged) if surged else None,
        "length_surge_lead": sorted(leads), "collapsed_after_surge": after,
        "collapsed_before_surge": len(collapsed) - after - no_surge, "collapsed_without_surge": no_surge,
    }
    runs = [r for r in (run_phases(p, window) for p in surged) if r is not None]
    phases: dict[str, dict[str, float | None]] = {}
    for name in SURGE_TRACKED:
        row: dict[str, float | None] = {ph: _mean_or_none([r[name][ph] for r in runs]) for ph in PHASES}
        for ph in ("after", "during"):
            row[f"{ph}_before"] = _mean_or_none([
                r[name][ph] / r[name]["before"] for r in runs
                if r[name][ph] is not None and r[name]["before"] not in (None, 0.0)])
        phases[name] = row
    out["phases"] = phases
    return out


def _pearson(pairs: list[tuple[float, float]]) -> float | None:
    if len(pairs) < MIN_STEPS:
        return None
    xs, ys = zip(*pairs)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in pairs) / math.sqrt(sxx * syy)


def _mean_or_none(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None
