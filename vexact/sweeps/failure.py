"""What a collapse is: the failure each collapsed run shows when its reward falls, from its logged metrics.

Collapse here is a rule on the reward (``vexact/rl/collapse.py``); runs reach it in different ways, and a threshold
measured over one way is not a threshold for another. ``failure_of(point)`` classifies a run that collapsed on its
reward (``collapse_reason`` ``reward_drop``, from a peak above 0) into one of ``FAILURE_KINDS``; a collapse on
another trigger (``non_finite``, ``grad_norm``, ``k3_kl``) has no reward fall to classify and gets no kind (None):

- ``length_lost``: the policy loses its length: the eval length (``eval/response_length_mean``) falls by
  ``LENGTH_LOST`` or more below its value just before the fall (checked first: a policy whose evaluated answers
  shrink has lost the task's length, whatever its training batches do);
- ``limit_overrun``: the answers run into the generation limit (``rollout.max_new_tokens``): the eval length reaches
  ``OVERRUN_LENGTH`` of the limit from below it, or the training batches' ``response_length/clip_ratio`` (the
  fraction cut at the limit) reaches ``OVERRUN_CLIP`` during the fall, ``OVERRUN_RISE`` above the steps before it
  (a task whose answers always fill the limit does not count);
- ``reward_lost_at_intact_length``: neither; the answers keep their length and lose their reward.

**The fall** is where the raw evaluated reward first sits at or below (1 − drop) × the run's (smoothed) peak after
its peak step (the detector's own ``drop`` and peak), up to the detector's collapse step; the window classified runs
from there to the collapse step (the detector confirms on a trailing mean, so its step comes later). Without such
an eval row the window is the collapse step alone. ``surge_before`` says whether the detector's length surge
(``length_surge_step``, the early warning of a response-length blow-up) came at or before the collapse.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import yaml

from ..metric_keys import EVAL_RESPONSE_LENGTH_MEAN, RESPONSE_LENGTH_CLIP_RATIO
from ..records import CONFIG_FILE
from ..rl.config_schema import CollapseSection
from ..rl.validate import parse_yaml
from .sweep_data import PointData, collapse_step_of, is_num

FAILURE_KINDS = ("length_lost", "limit_overrun", "reward_lost_at_intact_length")
FAILURE_WORDS = {"limit_overrun": "limit overrun", "length_lost": "length lost",
                 "reward_lost_at_intact_length": "reward lost at intact length"}
OVERRUN_CLIP = 0.3  # a third of the batch cut at the limit ...
OVERRUN_RISE = 0.2  # ... and that many more than just before the fall (a task that always fills the limit is not one)
OVERRUN_LENGTH = 0.95  # eval length this close to the limit
LENGTH_LOST = 0.3  # eval length down by this fraction from just before the fall
BEFORE_STEPS = 10  # the training steps before the fall whose clip ratio is the "before"


def _series(point: PointData, key: str) -> list[tuple[float, float]]:
    return sorted((float(m["step"]), float(m[key])) for m in point.metrics
                  if is_num(m.get("step")) and is_num(m.get(key)) and math.isfinite(m[key]))


def _config(point: PointData) -> dict[str, Any]:
    try:
        path = point.dir / CONFIG_FILE
        loaded = parse_yaml(path.read_text()) if path.is_file() else {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _section(config: dict[str, Any], name: str) -> dict[str, Any]:
    section = config.get(name)
    return section if isinstance(section, dict) else {}


def failure_of(point: PointData) -> dict[str, Any] | None:
    """The failure of a run collapsed on its reward (None when it did not collapse, or collapsed on another
    trigger, or from a peak of 0): ``kind`` (one of ``FAILURE_KINDS``),
    ``fall_step``, ``collapse_step``, the eval length just before the fall and its least and largest value in the
    window, the clip ratio before and at most in it, the task's ``L`` (``task.max_len``) and ``max_new_tokens`` from
    the run's config.yaml (None when it has none), ``surge_step`` and ``surge_before``."""
    collapse = point.collapse
    end = collapse_step_of(collapse)
    peak, peak_step = collapse.get("peak_reward"), collapse.get("peak_step")
    # the kinds are ways a reward falls: a collapse on another trigger has no fall, and from a peak of 0 every
    # value sits "at or below" the drop at once (a k3_kl collapse at reward 0 read as a fall at step 0)
    if (collapse.get("collapsed") is not True or not is_num(end) or collapse.get("collapse_reason") != "reward_drop"
            or not is_num(peak) or not peak > 0):
        return None
    criteria = collapse.get("criteria") if isinstance(collapse.get("criteria"), dict) else {}
    drop = criteria.get("drop") if is_num(criteria.get("drop")) else CollapseSection.drop
    metric = criteria.get("metric") if isinstance(criteria.get("metric"), str) else CollapseSection.metric
    reward = _series(point, metric)
    fall = next((s for s, v in reward if (not is_num(peak_step) or s > peak_step) and s <= end
                 and v <= (1.0 - drop) * peak), float(end))
    lengths = _series(point, EVAL_RESPONSE_LENGTH_MEAN)
    before = [v for s, v in lengths if s < fall]
    during = [v for s, v in lengths if fall <= s <= end] or [v for s, v in lengths if s >= fall][:1]
    clips = _series(point, RESPONSE_LENGTH_CLIP_RATIO)
    clip_before = [v for s, v in clips if fall - BEFORE_STEPS <= s < fall]
    clip_during = [v for s, v in clips if fall <= s <= end]
    config = _config(point)
    limit = _section(config, "rollout").get("max_new_tokens")
    out: dict[str, Any] = {
        "fall_step": fall, "collapse_step": end, "length_before": before[-1] if before else None,
        "length_min": min(during) if during else None, "length_max": max(during) if during else None,
        "clip_before": sum(clip_before) / len(clip_before) if clip_before else None,
        "clip_max": max(clip_during) if clip_during else None,
        "L": _section(config, "task").get("max_len"), "max_new_tokens": limit,
        "surge_step": collapse.get("length_surge_step"),
    }
    out["surge_before"] = is_num(out["surge_step"]) and out["surge_step"] <= end
    overrun = (is_num(limit) and out["length_max"] is not None and out["length_max"] >= OVERRUN_LENGTH * limit
               and (out["length_before"] is None or out["length_before"] < OVERRUN_LENGTH * limit))
    if out["clip_max"] is not None:
        overrun = overrun or (out["clip_max"] >= OVERRUN_CLIP
                              and out["clip_max"] >= (out["clip_before"] or 0.0) + OVERRUN_RISE)
    lost = (out["length_before"] is not None and out["length_min"] is not None
            and out["length_min"] <= (1.0 - LENGTH_LOST) * out["length_before"])
    out["kind"] = "length_lost" if lost else "limit_overrun" if overrun else "reward_lost_at_intact_length"
    return out


def failure_words(f: dict[str, Any]) -> str:
    """One run's failure in words: the kind, with the lengths and clip ratios that decided it."""
    def num(v: Any) -> str:
        return "?" if v is None else f"{v:.0f}" if abs(v) >= 10 else f"{v:.2g}"

    parts = [f"eval length {num(f['length_before'])} → {num(f['length_min'])}..{num(f['length_max'])}"]
    if f["clip_max"] is not None:
        parts.append(f"cut at the limit {num(f['clip_before'])} → {num(f['clip_max'])}")
    parts.append(f"L {f['L']}, limit {f['max_new_tokens']}" if f["L"] is not None else "")
    surge = f"length surge at step {num(f['surge_step'])}" if f["surge_before"] else "no length surge before it"
    return (f"{FAILURE_WORDS[f['kind']]} (fall at step {num(f['fall_step'])}, collapse {num(f['collapse_step'])}; "
            + "; ".join(p for p in parts if p) + f"; {surge})")


def horizon_failures(points: list[PointData]) -> dict[str, Any]:
    """The failures of one horizon's collapsed runs: ``failure_kinds`` ({kind: runs}), ``surge_before_collapse``
    (runs whose length surge came first) and ``collapsed_classified``."""
    found = [f for f in (failure_of(p) for p in points) if f is not None]
    kinds = Counter(f["kind"] for f in found)
    return {"failure_kinds": {k: kinds[k] for k in FAILURE_KINDS if kinds[k]},
            "surge_before_collapse": sum(f["surge_before"] for f in found), "collapsed_classified": len(found)}


def horizon_failure_words(h: dict[str, Any]) -> str | None:
    """Which failure a horizon's threshold measures, in words (None for a horizon without the record)."""
    kinds = h.get("failure_kinds")
    n = h.get("collapsed_classified")
    if not isinstance(kinds, dict) or not is_num(n):
        return None
    if not n:
        return "no reward-drop collapse to classify"
    parts = ", ".join(f"{FAILURE_WORDS.get(k, k)} {v} of {n}" for k, v in kinds.items())
    surge = h.get("surge_before_collapse") or 0
    return parts + ("; a length surge preceded " + f"{surge} of {n}" if surge else "; no length surge before any")


def failure_table(points: list[PointData]) -> list[dict[str, Any]]:
    """One row per collapsed run with a result: its name and ``failure_of``."""
    rows = []
    for p in points:
        f = failure_of(p) if p.has_result else None
        if f is not None:
            rows.append({"point": p.name, **f})
    return rows


def failure_summary(rows: list[dict[str, Any]]) -> str:
    """One line: how many collapses of each kind."""
    if not rows:
        return "failure kinds: no reward-drop collapse"
    kinds = Counter(r["kind"] for r in rows)
    surge = sum(r["surge_before"] for r in rows)
    return (f"failure kinds of {len(rows)} collapse(s): "
            + ", ".join(f"{FAILURE_WORDS[k]} {kinds[k]}" for k in FAILURE_KINDS if kinds[k])
            + f"; a length surge before {surge} of {len(rows)}")


__all__ = ["FAILURE_KINDS", "failure_of", "failure_summary", "failure_table", "failure_words", "horizon_failures",
           "horizon_failure_words"]
