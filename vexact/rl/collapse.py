"""Collapse detection on a run's ``metrics.jsonl`` history (settings: ``CollapseSection`` in
``vexact/rl/config_schema.py``).

A run "collapses" when its policy stops being able to do the task it had learned. By default this is judged on
``eval/reward_mean``, the reward of the **clean** evaluation (the policy sampled without any injected mismatch),
not on ``reward/mean``: the rollout reward measures the perturbed sampler that generated the training batch, so a
rollout-reward drop can be the perturbation itself rather than damage to the policy, and a damaged policy can
hide behind a rollout reward that the perturbation happens to prop up. Set ``collapse.metric`` to judge another
series.

Reading the history: rows are taken in order of ``"step"`` (0-based; the row's position when absent). A value
is a number, or one of the strings ``"nan"``/``"inf"``/``"-inf"`` (how non-finite floats are written), read as
the non-finite float; anything else (missing, ``None``, other strings, bools) is treated as absent.

Rules (the contract; ``detect_collapse`` returns the result of applying them):

1. **Reward drop** (reason ``"reward_drop"``). The series is the (step, value) pairs of the rows where
   ``cfg.metric`` is present and finite. The smoothed value at point i is the mean of the last ``cfg.smoothing``
   raw values up to and including i (fewer at the start). The running peak at i is the max of the smoothed
   values at points 0..i. The threshold at i is ``(1 - cfg.drop) * running peak at i``. Point i is a
   *candidate* when running peak >= ``cfg.min_peak`` and ``smoothed[i] < threshold``. A candidate is
   *confirmed* when every later point with ``step <= step_i + cfg.patience`` has a smoothed value still below
   the candidate's threshold **and** the series has a point with ``step >= step_i + cfg.patience`` (the run
   lasted long enough to tell; with ``patience = 0`` the candidate confirms itself). A candidate that recovers
   (some point in its patience window at or above its threshold) is discarded and the search continues with the
   next point. The first confirmed candidate's step is the reward-drop collapse step. A candidate that never
   recovered but whose series ends before ``step_i + patience`` is reported as ``collapse_unconfirmed_step``
   (the first such candidate) and is not a collapse; this is reported whatever the other triggers say.
2. **Non-finite** (reason ``"non_finite"``). If ``stopped_reason`` contains "non-finite" (case-insensitive; the
   trainer's ``RunStopped`` messages, e.g. "non-finite loss (nan)"), the run collapsed at ``stopped_step``
   (when that is None: one past the last row's step, the step whose row was never written; 0 for an empty
   history). Any row whose ``actor/pg_loss`` or ``actor/grad_norm`` is present and non-finite is a collapse at
   that row's step. The earliest of these is the non-finite step.
3. **Thresholds**, only when configured: the first step whose ``actor/grad_norm > cfg.grad_norm_max``
   (reason ``"grad_norm"``), and the first step whose ``rollout_corr/k3_kl > cfg.k3_kl_max`` (reason
   ``"k3_kl"``). Plain float comparison: ``+inf`` exceeds a threshold, NaN never does.
4. **Verdict**: the earliest step among the triggers of rules 1-3 is ``collapse_step`` and its reason is
   ``collapse_reason``. Ties go, in this order, to ``reward_drop``, ``non_finite``, ``grad_norm``, ``k3_kl``
   (so a non-finite collapse takes precedence over a reward drop only when strictly earlier).
5. **Length surge** (early warning from "Beyond Precision", Zhang et al.: the response length climbs before the
   reward collapses; the length-triggered LR decay fires at this same surge). Over
   the rows with a finite ``response_length/mean``, with ``w = cfg.length_surge_window``: baseline = mean of the
   first w values; smoothed length at row j = mean of the w values ending at j. The surge step is the step of
   the first row j after the baseline window (j >= w) with smoothed length > ``cfg.length_surge_ratio *
   baseline``. None with fewer than w + 1 such rows or a baseline <= 0. ``length_surge_lead = collapse_step -
   length_surge_step`` when both exist and the surge is not after the collapse, else None.
6. **Summaries**: ``peak_reward``/``peak_step`` = max of the smoothed series and the step of its first
   occurrence; ``initial_reward``/``final_reward`` = first/last raw value of the series. ``mean_k3_kl`` and
   ``mean_abs_dlogp`` = means of the finite ``rollout_corr/k3_kl`` / ``mismatch/abs_dlogp_mean`` values over all
   rows; ``mean_k3_kl_before_collapse`` = the same over rows with step < ``collapse_step`` (all rows when there
   is no collapse). Each is None when there is no value to summarize.

Everything returned is JSON-serializable (finite floats, ints, strings, None).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ..metric_keys import ABS_DLOGP_MEAN, GRAD_NORM, K3_KL, PG_LOSS, RESPONSE_LENGTH_MEAN
from ..records.metrics_log import non_finite_value

if TYPE_CHECKING:  # the config imports the LR schedules, which import this module
    from .config_schema import CollapseSection

PG_LOSS = PG_LOSS

# Tie-break among triggers at the same step (rule 4): earlier in this tuple wins.
REASONS = ("reward_drop", "non_finite", "grad_norm", "k3_kl")


# --- reading values ---------------------------------------------------------------------------------------


def as_float(value: Any) -> float | None:
    """A metric value as a float (``"nan"``/``"inf"``/``"-inf"`` strings included); None when not a number."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return non_finite_value(value)  # metrics_log's one table of NaN/Inf spellings
    return None


def _ordered_rows(history: list[dict]) -> list[tuple[int, dict]]:
    """(step, row) pairs sorted by step; a row without an int ``step`` uses its position."""
    rows = []
    for position, row in enumerate(history):
        step = row.get("step", position)
        rows.append((step if isinstance(step, int) and not isinstance(step, bool) else position, row))
    rows.sort(key=lambda pair: pair[0])
    return rows


def _finite_series(rows: list[tuple[int, dict]], key: str) -> list[tuple[int, float]]:
    """(step, value) for the rows where ``key`` is present and finite."""
    out = []
    for step, row in rows:
        value = as_float(row.get(key))
        if value is not None and math.isfinite(value):
            out.append((step, value))
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values up to and including each index (fewer at the start)."""
    # Each window summed afresh (math.fsum, exactly rounded): no drift from a running sum, and window 1
    # returns the raw values unchanged.
    return [math.fsum(values[max(0, i + 1 - window):i + 1]) / min(i + 1, window) for i in range(len(values))]


# --- rule 1: reward drop ----------------------------------------------------------------------------------


def reward_drop(series: list[tuple[int, float]], cfg: CollapseSection) -> tuple[int | None, int | None]:
    """(confirmed collapse step, unconfirmed candidate step) of the reward series, rule 1."""
    steps = [step for step, _ in series]
    smoothed = trailing_mean([value for _, value in series], cfg.smoothing)
    peak = -math.inf
    for i, value in enumerate(smoothed):
        peak = max(peak, value)
        threshold = (1.0 - cfg.drop) * peak
        if peak < cfg.min_peak or not value < threshold:
            continue
        horizon = steps[i] + cfg.patience
        window = [smoothed[j] for j in range(i + 1, len(series)) if steps[j] <= horizon]
        if any(v >= threshold for v in window):
            continue  # recovered within patience: discarded
        if steps[-1] >= horizon:
            return steps[i], None
        return None, steps[i]  # still down when the series ended, too soon to tell
    return None, None


# --- rules 2 and 3: non-finite values and thresholds ------------------------------------------------------


def non_finite_step(rows: list[tuple[int, dict]], stopped_reason: str | None, stopped_step: int | None) -> int | None:
    """Earliest non-finite collapse step, rule 2."""
    candidates = []
    if stopped_reason is not None and "non-finite" in stopped_reason.lower():
        if stopped_step is None:
            stopped_step = rows[-1][0] + 1 if rows else 0
        candidates.append(stopped_step)
    for step, row in rows:
        values = (as_float(row.get(PG_LOSS)), as_float(row.get(GRAD_NORM)))
        if any(v is not None and not math.isfinite(v) for v in values):
            candidates.append(step)
            break
    return min(candidates) if candidates else None


def first_step_above(rows: list[tuple[int, dict]], key: str, limit: float | None) -> int | None:
    """First step whose ``key`` exceeds ``limit`` (None when ``limit`` is None), rule 3."""
    if limit is None:
        return None
    for step, row in rows:
        value = as_float(row.get(key))
        if value is not None and value > limit:
            return step
    return None


# --- rule 5: length surge ---------------------------------------------------------------------------------


def surge_index(values: list[float], window: int, ratio: float) -> int | None:
    """Index of the first value after the baseline window whose trailing mean > ratio x baseline, else None.

    Baseline = mean of the first ``window`` values; the trailing mean at j averages the ``window`` values ending
    at j. Shared by rule 5 and the length-triggered LR schedule, so both call the same thing a surge."""
    if len(values) <= window:
        return None
    baseline = sum(values[:window]) / window
    if baseline <= 0:
        return None
    smoothed = trailing_mean(values, window)
    for j in range(window, len(values)):
        if smoothed[j] > ratio * baseline:
            return j
    return None


def length_surge_step(rows: list[tuple[int, dict]], window: int, ratio: float) -> int | None:
    """First step after the baseline window whose trailing-mean response length > ratio x baseline, rule 5."""
    series = _finite_series(rows, RESPONSE_LENGTH_MEAN)
    j = surge_index([value for _, value in series], window, ratio)
    return None if j is None else series[j][0]


# --- the verdict ------------------------------------------------------------------------------------------


def detect_collapse(history: list[dict], cfg: CollapseSection, stopped_reason: str | None = None,
                    stopped_step: int | None = None) -> dict:
    """Apply the module's rules 1-6 to a run's metric history; see the module docstring for the definitions.

    ``stopped_reason``/``stopped_step``: the run's ``summary.json`` ``reason`` and ``stopped_at_step`` when it
    was stopped (the row of the failing step is never written, so only these say where it ended).
    """
    rows = _ordered_rows(history)
    series = _finite_series(rows, cfg.metric)
    drop_step, unconfirmed_step = reward_drop(series, cfg)
    triggers = {
        "reward_drop": drop_step,
        "non_finite": non_finite_step(rows, stopped_reason, stopped_step),
        "grad_norm": first_step_above(rows, GRAD_NORM, cfg.grad_norm_max),
        "k3_kl": first_step_above(rows, K3_KL, cfg.k3_kl_max),
    }
    fired = [(step, REASONS.index(reason), reason) for reason, step in triggers.items() if step is not None]
    collapse_step, _, collapse_reason = min(fired) if fired else (None, None, None)

    smoothed = trailing_mean([value for _, value in series], cfg.smoothing)
    peak_index = max(range(len(smoothed)), key=smoothed.__getitem__) if smoothed else None
    surge_step = length_surge_step(rows, cfg.length_surge_window, cfg.length_surge_ratio)
    k3 = _finite_series(rows, K3_KL)
    lead = None
    if collapse_step is not None and surge_step is not None and surge_step <= collapse_step:
        lead = collapse_step - surge_step
    return {
        "collapsed": collapse_step is not None,
        "collapse_step": collapse_step,
        "collapse_reason": collapse_reason,
        "collapse_unconfirmed_step": unconfirmed_step,
        "peak_reward": smoothed[peak_index] if peak_index is not None else None,
        "peak_step": series[peak_index][0] if peak_index is not None else None,
        "final_reward": series[-1][1] if series else None,
        "initial_reward": series[0][1] if series else None,
        "mean_k3_kl": _mean([v for _, v in k3]),
        "mean_abs_dlogp": _mean([v for _, v in _finite_series(rows, ABS_DLOGP_MEAN)]),
        "mean_k3_kl_before_collapse": _mean([v for s, v in k3 if collapse_step is None or s < collapse_step]),
        "length_surge_step": surge_step,
        "length_surge_lead": lead,
        "criteria": {"metric": cfg.metric, "smoothing": cfg.smoothing, "drop": cfg.drop,
                     "min_peak": cfg.min_peak, "patience": cfg.patience},
    }

