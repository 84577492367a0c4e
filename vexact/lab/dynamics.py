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
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from .report import PointData, SweepData, _series

K3 = "rollout_corr/k3_kl"
TRACKED = {"entropy": "actor/entropy", "grad_norm": "actor/grad_norm", "response_length": "response_length/mean"}
WINDOW = 0.2  # early / late = first / last fifth of the steps before collapse
MIN_STEPS = 10  # fewer usable steps than this: no statement about the run


def run_dynamics(point: PointData) -> dict[str, Any] | None:
    """One run's early/late k3 and correlations; None when it has fewer than ``MIN_STEPS`` usable steps."""
    end = point.collapse.get("collapse_step") if point.collapse.get("collapsed") else None
    rows = {}
    for step, k3 in zip(*_series(point, K3)):
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
        other = dict(zip(*_series(point, key)))
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
        out.append(entry)
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
